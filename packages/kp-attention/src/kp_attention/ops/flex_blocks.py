"""Triton helpers the generated mods (kp_attention.ops.flex_codegen) import: floor division and remainder as
PyTorch rounds them, tanh and sigmoid without libdevice, and a clamped index into a captured tensor."""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_core.kernel_constants import LOG2E


@triton.jit
def floordiv(a, b):
    """a // b rounded toward -inf (PyTorch's and Python's), where Triton's // truncates."""
    q = a // b
    return tl.where((a % b != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def floormod(a, b):
    """a % b with the divisor's sign (PyTorch's and Python's), where Triton's % takes the dividend's."""
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def tanh(x):
    """tanh(x) = sign(x) (1 - e) / (1 + e), e = exp(-2|x|): no overflow, no libdevice."""
    e = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))  # tensor first: constexpr * tensor fails interpreted
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def sigmoid(x):
    e = tl.math.exp2(tl.abs(x) * (-1.0 * LOG2E))  # exp(-|x|) <= 1: no overflow
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def offset(META, j, i):
    """Element offset of index i along dimension j of a capture whose sizes and strides META holds: a negative
    index counts from the end (once), then the index is clamped into the dimension."""
    n = tl.load(META + j)
    i = i.to(tl.int64)
    i = tl.where(i < 0, i + n, i)
    i = tl.minimum(tl.maximum(i, 0), n - 1)
    return i * tl.load(META + 4 + j)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
