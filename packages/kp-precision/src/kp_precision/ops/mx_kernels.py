"""Triton kernels of the MX formats (OCP Microscaling v1.0; the maths is in kp_precision.ops.mx's docstring).

Element formats (ELEM): 0 fp8 e4m3, 1 fp8 e5m2, 2 fp4 e2m1 (two per byte, the first in the low nibble).
A block is 32 consecutive elements of a row; its scale is an E8M0 byte (2**(s - 127), 255 = NaN).
"""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_core.float8_kernels import abs_bits, fp8_value, minifloat_bits, minifloat_value
from kp_precision.ops.kernel_helpers import grouped_tile, tile_of

FP4 = tl.constexpr(2)


@triton.jit
def _encode(y, ELEM: tl.constexpr):
    """y (float32, saturated, or NaN) as element bits (int32), rounded to nearest-even."""
    if ELEM == 0:
        return minifloat_bits(y, 3, 7, 7, 0x7F)
    elif ELEM == 1:
        return minifloat_bits(y, 2, 15, 7, 0x7F)
    else:  # e2m1 has no NaN: a NaN element's block scale is NaN, which is what carries it
        return minifloat_bits(y, 1, 1, 3, 0)


@triton.jit
def _decode(b, ELEM: tl.constexpr):
    if ELEM == FP4:
        return minifloat_value(b, 1, 1, 3)
    return fp8_value(b, ELEM == 1)


@triton.jit
def _e8m0(s):
    """E8M0 scale bytes (int32) as float32: 2**(s - 127); s = 0 is 2**-127 (a float32 subnormal), 255 NaN."""
    v = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
    return tl.where(s == 255, float("nan"), v)


@triton.jit
def _elements(ptr, rows, stride, cols, R, K, ELEM: tl.constexpr):
    """The (rows, cols) elements of a row-major element array (bytes, or fp4 pairs) decoded to float32."""
    mask = (rows < R)[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    if ELEM == FP4:
        byte = tl.load(ptr + r64 * stride + (cols // 2)[None, :], mask=mask, other=0).to(tl.int32)
        b = (byte >> ((cols & 1) * 4)[None, :]) & 0xF
    else:
        b = tl.load(ptr + r64 * stride + cols[None, :], mask=mask, other=0).to(tl.int32)
    return _decode(b, ELEM)


@triton.jit
def _mx_quantize(
    X,
    stride_x,
    Y,
    stride_y,
    S,
    stride_s,
    M,
    K,
    ELEM: tl.constexpr,
    EMAX: tl.constexpr,
    MAXV: tl.constexpr,
    SOFT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One BLOCK_M x BLOCK_K tile (BLOCK_K a multiple of 32, K too): per 32-element block, the shared exponent
    floor(log2 amax) - EMAX (clamped to the E8M0 range; a NaN or inf amax gives the NaN scale), the elements
    x / 2**shared saturated to +-MAXV and rounded to nearest-even."""
    rows, cols, mask, k0 = tile_of(M, K, BLOCK_M, BLOCK_K)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    G: tl.constexpr = BLOCK_K // 32
    x3 = tl.reshape(x, (BLOCK_M, G, 32))
    amax = tl.max(abs_bits(x3), axis=2)  # (BLOCK_M, G) float32 bits: the exponent field is floor(log2 amax)
    shared = tl.minimum(tl.maximum((amax >> 23) - 127 - EMAX, -127), 127)
    groups = k0 // 32 + tl.arange(0, G)
    s_mask = (rows < M)[:, None] & (groups < K // 32)[None, :]
    s_bits = tl.where(amax >= 0x7F800000, 255, shared + 127)
    tl.store(S + r64 * stride_s + groups[None, :], s_bits.to(tl.uint8), mask=s_mask)
    inv = ((127 - shared) << 23).to(tl.float32, bitcast=True)  # 2**-shared, exact (shared <= 125 here)
    y = x3 * inv[:, :, None]
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -MAXV), MAXV))
    y = tl.reshape(y, (BLOCK_M, BLOCK_K))
    if ELEM == FP4:
        lo, hi = tl.split(tl.reshape(_encode(y, ELEM), (BLOCK_M, BLOCK_K // 2, 2)))
        half = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        h_mask = (rows < M)[:, None] & (half < K // 2)[None, :]
        tl.store(Y + r64 * stride_y + half[None, :], (lo | (hi << 4)).to(tl.uint8), mask=h_mask)
    elif SOFT:  # Y is a uint8 view of the float8 data
        tl.store(Y + r64 * stride_y + cols[None, :], _encode(y, ELEM).to(tl.uint8), mask=mask)
    else:
        tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _mx_dequantize(
    Y,
    stride_y,
    S,
    stride_s,
    OUT,
    stride_o,
    M,
    K,
    ELEM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """OUT = element * 2**(scale - 127) in float32, rounded once to OUT's dtype."""
    rows, cols, mask, k0 = tile_of(M, K, BLOCK_M, BLOCK_K)
    r64 = rows.to(tl.int64)[:, None]
    v = _elements(Y, rows, stride_y, cols, M, K, ELEM)
    s = tl.load(S + r64 * stride_s + (cols // 32)[None, :], mask=mask, other=127).to(tl.int32)
    tl.store(OUT + r64 * stride_o + cols[None, :], (v * _e8m0(s)).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _mx_matmul(
    A,
    stride_a,
    SA,
    stride_sa,
    B,
    stride_b,
    SB,
    stride_sb,
    C,
    stride_c,
    M,
    N,
    K,
    A_ELEM: tl.constexpr,
    B_ELEM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C = A @ B.T with A (M, K), B (N, K) in MX: per 32-deep block, the elements' dot product (decoded to
    float32, which holds every element exactly, as do TF32 tensor cores: the products are exact) times both
    blocks' scales, summed in float32. Emulation: Hopper has no MX tensor cores."""
    rm, rn = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, 32):
        a = _elements(A, rm, stride_a, k + rk, M, K, A_ELEM)
        b = _elements(B, rn, stride_b, k + rk, N, K, B_ELEM)
        part = tl.dot(a, tl.trans(b), input_precision="tf32")
        sa = _e8m0(tl.load(SA + rm.to(tl.int64) * stride_sa + k // 32, mask=rm < M, other=127).to(tl.int32))
        sb = _e8m0(tl.load(SB + rn.to(tl.int64) * stride_sb + k // 32, mask=rn < N, other=127).to(tl.int32))
        acc += part * sa[:, None] * sb[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(C + rm.to(tl.int64)[:, None] * stride_c + rn[None, :], acc.to(C.dtype.element_ty), mask=mask)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
