"""Triton kernel of integer fake quantisation (the maths is in kp_precision.ops.fake_quantize's docstring)."""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_precision.ops.kernel_helpers import tile_of


@triton.jit
def _fake_quantize(
    X,
    stride_x,
    Y,
    stride_y,
    M,
    K,
    QMAX: tl.constexpr,
    EPS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One BLOCK_M x BLOCK_K tile, BLOCK_K a multiple of GROUP (a row's groups of GROUP columns; a whole row when
    GROUP = BLOCK_K >= K): scale = max(amax, EPS) / QMAX, y = clamp(rint(x / scale), -QMAX - 1, QMAX) * scale."""
    rows, cols, mask, _ = tile_of(M, K, BLOCK_M, BLOCK_K)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x3 = tl.reshape(x, (BLOCK_M, BLOCK_K // GROUP, GROUP))
    amax = tl.max(tl.abs(x3), axis=2)
    scale = tl.math.div_rn(tl.maximum(amax, EPS), tl.full(amax.shape, QMAX, tl.float32))[:, :, None]
    v = tl.math.div_rn(x3, tl.broadcast_to(scale, x3.shape))
    # round half to even: adding and subtracting 1.5 * 2**23 leaves an integer in float32 (|v| <= QMAX + 1)
    r = (v + 12582912.0) - 12582912.0
    r = tl.minimum(tl.maximum(r, -QMAX - 1.0), QMAX)
    y = tl.reshape(r * scale, (BLOCK_M, BLOCK_K))
    tl.store(Y + r64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
