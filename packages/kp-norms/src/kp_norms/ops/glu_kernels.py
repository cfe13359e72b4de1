"""Triton kernels of the gated activations (the maths is in kp_norms.ops.glu's docstring)."""

import triton
import triton.language as tl

from kp_core.activation_kernels import act


@triton.jit
def _tile(pid, n_col_blocks, M, H, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row offsets (int64, to multiply by each tensor's row stride), column offsets and the mask."""
    rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < H)[None, :]
    return rows.to(tl.int64)[:, None], cols[None, :], mask


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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACT: tl.constexpr,
    ACC: tl.constexpr,
):
    """y = act(g) * u on one BLOCK_M x BLOCK_N tile (1-D grid: row blocks x column blocks)."""
    r, c, mask = _tile(tl.program_id(0), n_col_blocks, M, H, BLOCK_M, BLOCK_N)
    g = tl.load(G + r * stride_g + c, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(ACC)
    a, _ = act(g, ACT, False)
    tl.store(Y + r * stride_y + c, (a * u).to(Y.dtype.element_ty), mask=mask)


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
    r, c, mask = _tile(tl.program_id(0), n_col_blocks, M, H, BLOCK_M, BLOCK_N)
    dy = tl.load(DY + r * stride_dy + c, mask=mask, other=0.0).to(ACC)
    g = tl.load(G + r * stride_g + c, mask=mask, other=0.0).to(ACC)
    u = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(ACC)
    a, da = act(g, ACT, True)
    tl.store(DG + r * stride_dg + c, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + r * stride_du + c, (dy * a).to(DU.dtype.element_ty), mask=mask)
