"""Triton kernels of float8 quantisation (the maths is in kp_precision.ops.quantize's docstring).

Every kernel views its input as (M, K) rows with a row stride and unit column stride. Amaxes are int32 bit
patterns and the cast saturates and rounds as kp_core.float8_kernels says (the helpers are kp-core's).
"""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_core.float8_kernels import abs_bits, fp8_value, multiplier, recip, store_fp8
from kp_precision.ops.kernel_helpers import tile_of

# The quantisation modes: one scale for the tensor, one per row of a tile (rowwise, and 1 x BK blocks), one per
# whole BM x BK tile (square blocks).
TENSOR = tl.constexpr(0)
ROW = tl.constexpr(1)
TILE = tl.constexpr(2)


@triton.jit
def _amax(X, stride_x, AMAX, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """AMAX (int32 bits, zero on entry) = max |x| over the tensor: one tile per program, an atomic max each."""
    rows, cols, mask, k0 = tile_of(M, K, BLOCK_M, BLOCK_K)
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(AMAX, tl.max(tl.max(abs_bits(x), axis=1), axis=0))


@triton.jit
def _quantize(
    X,
    stride_x,
    Y,
    stride_y,
    SCALE,
    stride_s,
    AMAX,
    M,
    K,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DELAYED: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
    POW2: tl.constexpr,
):
    """y = saturate(x * q) as float8 on one BLOCK_M x BLOCK_K tile, with q = FP8_MAX / amax.

    MODE TENSOR: the amax is AMAX (int32 bits, from the _amax pass) and program 0 writes the scale; DELAYED:
    q = 1 / SCALE (a given scale, read only) and this tile's amax goes into AMAX by an atomic max. MODE ROW: a
    scale per row of the tile, at SCALE[row, tile column]; MODE TILE: one per tile, at SCALE[tile row, tile
    column]. Scales are written as 1 / q (what dequantisation multiplies by), amaxes as floats at the same place
    in AMAX."""
    n_k = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    pid_m = pid // n_k
    pid_k = pid % n_k
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == TENSOR:
        if DELAYED:
            q = recip(tl.load(SCALE))
            tl.atomic_max(AMAX, tl.max(tl.max(abs_bits(x), axis=1), axis=0))
        else:
            q = multiplier(tl.load(AMAX), FP8_MAX, EPS, POW2)
            if pid == 0:
                tl.store(SCALE, recip(q))
        y = x * q
    elif MODE == ROW:
        amax_bits = tl.max(abs_bits(x), axis=1)
        q = multiplier(amax_bits, FP8_MAX, EPS, POW2)
        at = rows.to(tl.int64) * stride_s + pid_k
        tl.store(SCALE + at, recip(q), mask=row_ok)
        tl.store(AMAX + at, amax_bits.to(tl.float32, bitcast=True), mask=row_ok)
        y = x * q[:, None]
    else:
        amax_bits = tl.max(tl.max(abs_bits(x), axis=1), axis=0)
        q = multiplier(amax_bits, FP8_MAX, EPS, POW2)
        tl.store(SCALE + pid_m * stride_s + pid_k, recip(q))
        tl.store(AMAX + pid_m * stride_s + pid_k, amax_bits.to(tl.float32, bitcast=True))
        y = x * q
    store_fp8(Y + r64 * stride_y + cols[None, :], y, mask, FP8_MAX, E5M2, SOFT)


@triton.jit
def _quantize_rows_looped(
    X,
    stride_x,
    Y,
    stride_y,
    SCALE,
    AMAX_OUT,
    M,
    K,
    BLOCK_K: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
    POW2: tl.constexpr,
):
    """Rowwise quantisation of rows wider than one tile: one row per program, a pass for the amax and a pass
    (mostly from L2) for the cast."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), tl.int32)
    for start in range(0, K, BLOCK_K):
        c = start + cols
        x = tl.load(X + row * stride_x + c, mask=c < K, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
    amax_bits = tl.max(acc, axis=0)
    q = multiplier(amax_bits, FP8_MAX, EPS, POW2)
    tl.store(SCALE + row, recip(q))
    tl.store(AMAX_OUT + row, amax_bits.to(tl.float32, bitcast=True))
    for start in range(0, K, BLOCK_K):
        c = start + cols
        x = tl.load(X + row * stride_x + c, mask=c < K, other=0.0).to(tl.float32)
        store_fp8(Y + row * stride_y + c, x * q, c < K, FP8_MAX, E5M2, SOFT)


@triton.jit
def _dequantize(
    D,
    stride_d,
    SCALE,
    stride_s0,
    stride_s1,
    Y,
    stride_y,
    M,
    K,
    BM: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
):
    """y = data * SCALE[row // BM, col // BK] (scale strides 0 along a dimension one scale covers). SOFT: the
    data is read as uint8 bits and decoded in integer arithmetic (the interpreter's float8 upcast gets NaN and
    inf wrong)."""
    rows, cols, mask, k0 = tile_of(M, K, BLOCK_M, BLOCK_K)
    r64 = rows.to(tl.int64)[:, None]
    raw = tl.load(D + r64 * stride_d + cols[None, :], mask=mask)  # masked lanes are never stored
    if SOFT:
        d = fp8_value(raw.to(tl.int32), E5M2)
    else:
        d = raw.to(tl.float32)
    s = tl.load(SCALE + (r64 // BM) * stride_s0 + (cols[None, :] // BK) * stride_s1, mask=mask, other=1.0)
    tl.store(Y + r64 * stride_y + cols[None, :], (d * s).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _transpose(X, stride_x, Y, stride_y, M, N, BLOCK: tl.constexpr):
    """Y (N, M) = X (M, N).T for elements as integers of their size (float8 data as uint8, bf16 as int16, ...): a
    BLOCK x BLOCK tile per program, read along X's rows and written along Y's rows (Triton moves the tile
    through shared memory between the two)."""
    tiles_n = tl.cdiv(N, BLOCK)
    rm = (tl.program_id(0) // tiles_n) * BLOCK + tl.arange(0, BLOCK)
    rn = (tl.program_id(0) % tiles_n) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + rm.to(tl.int64)[:, None] * stride_x + rn[None, :], mask=(rm < M)[:, None] & (rn < N)[None, :])
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    tl.store(Y + rn.to(tl.int64)[:, None] * stride_y + rm[None, :], tl.trans(x), mask=mask)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
