"""Fused linear + activation in float16 / bfloat16: launchers, PyTorch path and the op declaration.

    forward     z = x @ w.T + b (float32 sum),  y = act(z)        one GEMM, bias and activation in its epilogue
    backward    dz = dy * act'(z)                                  one elementwise pass (z saved in x's dtype)
                dx = dz @ w,  dw = dz.T @ x,  db = sum(dz)         cuBLAS (torch.mm), the bias sum in float32

The forward GEMM is the float8 scaled-matmul kernel (kp_precision.ops.scaled_mm_kernels) with 16-bit operands
and unit scales; it stores z beside y only when a backward will need it.
"""

import torch

import kp_core
from kp_precision.ops.scaled_mm import ACTIVATIONS, _reference_activation

if kp_core.has_triton():
    from kp_precision.ops import scaled_mm_kernels as kernels

OP = "kp::linear_activation"
PACKAGE = "kp-precision"
SPEC = "linear_activation"
DTYPES = (torch.float16, torch.bfloat16)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M): Triton's Hopper matmul tutorial shape for 16-bit
# operands; the interpreter gets small tiles that cross block boundaries in small tests
TILE = (128, 256, 64, 8, 3, 8)
INTERPRET_TILE = (16, 32, 32, 1, 1, 2)
ELEMENTS = 4096  # per program of the activation's backward


def forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, save_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, z) for x (M, K) and weight (N, K); z only with save_pre (None otherwise)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pre = torch.empty((m, n), dtype=x.dtype, device=x.device) if save_pre else None
    if y.numel() == 0:
        return y, pre
    backend = kp_core.choose_backend(OP, x)
    if backend == kp_core.REFERENCE or k == 0:
        if backend == kp_core.REFERENCE:
            kp_core.reference(OP)
        z = x.float() @ weight.float().t() + (0 if bias is None else bias.float())
        y.copy_(_reference_activation(activation)(z))
        if save_pre:
            pre.copy_(z)
        return y, pre
    bm, bn, bk, warps, stages, group = INTERPRET_TILE if backend == kp_core.INTERPRET else TILE
    s = kp_core.settings("_linear_activation", block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    one = torch.ones((), device=x.device)
    grid = -(-m // s["block_m"]) * -(-n // s["block_n"])
    kp_core.check_index_fits(OP, "the launch grid (programs)", grid)
    args = (x, x.stride(0), weight, weight.stride(0), one, 0, 0, one, 0, 0)
    args += (y if bias is None else bias, y, y.stride(0), y if pre is None else pre, m, n, k)
    consts = dict(SA_ROWS=1, SA_K=False, SB_COLS=1, SB_K=False, SCALE_K=128, HAS_BIAS=bias is not None)
    consts.update(ACT=ACTIVATIONS.index(activation), STORE_PRE=save_pre, A_E5M2=False, B_E5M2=False, SOFT=False)
    consts.update(PROMOTE_K=0, BLOCK_M=s["block_m"], BLOCK_N=s["block_n"], BLOCK_K=s["block_k"], GROUP_M=group)
    kp_core.launch(OP, backend, kernels._scaled_mm, (grid,), args, consts, s["num_warps"], s["num_stages"])
    return y, pre


def _activation_grad(dy: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    dz = torch.empty_like(pre)
    backend = kp_core.choose_backend(OP, pre)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP)
        z = pre.float().detach().requires_grad_()
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(_reference_activation(activation)(z), z, dy.float())
        return dz.copy_(grad)
    n = pre.numel()
    block = ELEMENTS * (16 if backend == kp_core.INTERPRET else 1)
    grid = -(-n // block)
    args = (dy.contiguous(), pre, dz, n)
    consts = dict(ACT=ACTIVATIONS.index(activation), BLOCK=block)
    kp_core.launch(OP, backend, kernels._activation_grad, (grid,), args, consts, 8)
    return dz


def backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, pre: torch.Tensor, activation: str, save_pre: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) from dy and the saved x, weight and z."""
    dz = _activation_grad(dy, pre, activation) if activation != "none" else dy.contiguous()
    return dz @ weight, dz.t() @ x, dz.sum(0, dtype=torch.float32).to(x.dtype)


def _fake(x, weight, bias, activation, save_pre):
    shape = (x.shape[0], weight.shape[0])
    return x.new_empty(shape), (x.new_empty(shape) if save_pre else None)


LINEAR_ACTIVATION = kp_core.op(
    OP,
    forward,
    _fake,
    backward=backward,
    backward_fake=lambda dy, x, weight, pre, activation, save_pre: (
        torch.empty_like(x),
        torch.empty_like(weight),
        x.new_empty((weight.shape[0],)),
    ),
    save=lambda args, outputs: (args[0], args[1], outputs[1]),
    grad_inputs=("x", "weight", "bias"),
    differentiable_outputs=1,
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)
