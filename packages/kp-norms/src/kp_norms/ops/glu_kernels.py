"""Triton kernels of the gated activations (the maths is in kp_norms.ops.glu's docstring)."""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_core.activation_kernels import act
from kp_core.float8_kernels import abs_bits, multiplier, recip, store_fp8

# FP8: what the forward does for a float8 copy of y: nothing, or y's amax (float32 bits) into QAMAX per row (ROW)
# or for the tensor (TENSOR), by atomic max (a row spans several programs); _glu_cast_float8 then casts y.
NO_FP8 = tl.constexpr(0)
ROW = tl.constexpr(1)
TENSOR = tl.constexpr(2)


@triton.jit
def _tile(pid, n_col_blocks, M, H, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row offsets (int64, to multiply by each tensor's row stride), column offsets, the mask and the rows."""
    rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask, rows


@triton.jit
def _glu_fwd(
    G,
    stride_g,
    U,
    stride_u,
    Y,
    stride_y,
    M,
    H,
    n_col_blocks,
    QAMAX,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,
    ACC: tl.constexpr,
    FP8: tl.constexpr,
):
    """y = act(g) * u on one BLOCK_M x BLOCK_N tile (1-D grid: row blocks x column blocks); FP8: y's amax too."""
    r, c, mask, rows = _tile(tl.program_id(0), n_col_blocks, M, H, BLOCK_M, BLOCK_N)
    g = tl.load(G + r * stride_g + c, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(ACC)
    a, _ = act(g, ACT, False)
    y = (a * u).to(Y.dtype.element_ty)
    tl.store(Y + r * stride_y + c, y, mask=mask)
    if FP8 != NO_FP8:  # the amax of y as stored (rounded), as a cast after the op would see it
        bits = tl.where(mask, abs_bits(y.to(tl.float32)), 0)
        if FP8 == ROW:
            tl.atomic_max(QAMAX + rows, tl.max(bits, axis=1), mask=rows < M)
        else:
            tl.atomic_max(QAMAX, tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _glu_cast_float8(
    Y,
    stride_y,
    Q,
    stride_q,
    M,
    H,
    n_col_blocks,
    QSCALE,
    QAMAX,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWWISE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_EPS: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
    POW2: tl.constexpr,
):
    """y's tile cast to float8 with the amax _glu_fwd left (float32 bits): per row (ROWWISE: the row's first
    column block writes its scale) or for the tensor (program 0 writes the one scale)."""
    pid = tl.program_id(0)
    r, c, mask, rows = _tile(pid, n_col_blocks, M, H, BLOCK_M, BLOCK_N)
    row_ok = rows < M
    if ROWWISE:
        q = multiplier(tl.load(QAMAX + rows, mask=row_ok, other=0), FP8_MAX, FP8_EPS, POW2)
        if pid % n_col_blocks == 0:
            tl.store(QSCALE + rows, recip(q), mask=row_ok)
        q = q[:, None]
    else:
        q = multiplier(tl.load(QAMAX), FP8_MAX, FP8_EPS, POW2)
        if pid == 0:
            tl.store(QSCALE, recip(q))
    y = tl.load(Y + r * stride_y + c, mask=mask, other=0.0).to(tl.float32)
    store_fp8(Q + r * stride_q + c, y * q, mask, FP8_MAX, E5M2, SOFT)


@triton.jit
def _glu_bwd(
    DY,
    stride_dy,
    G,
    stride_g,
    U,
    stride_u,
    DG,
    stride_dg,
    DU,
    stride_du,
    M,
    H,
    n_col_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,
    ACC: tl.constexpr,
):
    """dgate = dy * u * act'(g), dup = dy * act(g); act recomputed from g."""
    r, c, mask, _ = _tile(tl.program_id(0), n_col_blocks, M, H, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + r * stride_dy + c, mask=mask, other=0.0).to(ACC)
    g = tl.load(G + r * stride_g + c, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(ACC)
    a, da = act(g, ACT, True)
    tl.store(DG + r * stride_dg + c, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + r * stride_du + c, (dy * a).to(DU.dtype.element_ty), mask=mask)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
