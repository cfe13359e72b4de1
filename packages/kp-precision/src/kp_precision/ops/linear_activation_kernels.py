"""Triton kernels of the fused linear + activation (kp_precision.ops.linear_activation): the forward on TMA, and
the activation's backward.

Persistent: one program per SM walks the output tiles in grouped order (the scaled-matmul kernel's order),
loading X (M, K) and W (N, K) tiles through TMA tensor descriptors, which fetch whole tiles asynchronously and
zero-fill past the tensor's edges, so no masks; the bias, the activation and the cast run on the float32
accumulator, and the descriptor store clips the tile at Y's edges. Needs Triton's host tensor descriptors
(3.4+) and 16-byte aligned rows; the launcher uses the pointer kernel (scaled_mm_kernels._scaled_mm) otherwise.
The activation (ACT: a kp_core.Activation value) and its derivative are kp_core.activation_kernels'.
"""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_core.activation_kernels import act_fwd, act_grad
from kp_precision.ops.kernel_helpers import tile_origin


@triton.jit
def _linear_activation(
    X,
    W,
    Y,
    PRE,
    BIAS,
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    STORE_PRE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    """Y = act(X @ W.T + BIAS) with X, W, Y (and PRE, the value before the activation, when STORE_PRE) as
    tensor descriptors of (BLOCK_M, BLOCK_K), (BLOCK_N, BLOCK_K) and (BLOCK_M, BLOCK_N) blocks; program p takes
    tiles p, p + PROGRAMS, ... (PROGRAMS is the device's SM count, fixed per device so that one compiled kernel
    serves every size; a launch with fewer tiles than that starts one program per tile)."""
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N), PROGRAMS):
        row, col = tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(X.load([row, k]), W.load([col, k]).T, acc)
        if HAS_BIAS:
            rn = col + tl.arange(0, BLOCK_N)
            acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if STORE_PRE:
            PRE.store([row, col], acc.to(PRE.dtype))
        Y.store([row, col], act_fwd(acc, ACT).to(Y.dtype))


@triton.jit
def _activation_grad(DY, Z, DZ, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """DZ = DY * act'(Z), elementwise over n contiguous elements, in float32."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DZ + offs, (dy * act_grad(z, ACT)).to(DZ.dtype.element_ty), mask=mask)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
