"""Fused linear + activation in float16 / bfloat16: launchers, PyTorch path and the op declaration.

    forward     z = x @ w.T + b (float32 sum),  y = act(z)        one GEMM, bias and activation in its epilogue
    backward    dz = dy * act'(z)                                  one elementwise pass (z saved in x's dtype)
                dx = dz @ w,  dw = dz.T @ x,  db = sum(dz)         cuBLAS (torch.mm), the bias sum in float32

The forward GEMM is a persistent TMA kernel (kp_precision.ops.linear_activation_kernels) where the installed
Triton has host tensor descriptors and the rows are 16-byte aligned, else the float8 scaled-matmul kernel
(kp_precision.ops.scaled_mm_kernels) with 16-bit operands and unit scales (on the H100, in a standalone run of
the same kernel, 580-640 TFLOP/s where the pointer kernel ran at 490-510: docs/ops/linear_activation.md). Either
stores z beside y only when a backward will need it. The activation and its derivative are kp_core's
(kp_core.activation_kernels; the reference path: kp_core.activation).

Kernels: kp_precision.ops.linear_activation_kernels (the TMA forward, the activation's backward) and
kp_precision.ops.scaled_mm_kernels (the pointer forward). Declaration: LINEAR_ACTIVATION
(kp::linear_activation). Spec: conformance/specs/test_linear_activation.py.
"""

import torch

import kp_core
from kp_core.activation import NAMES, reference

if kp_core.has_triton():
    from kp_precision.ops import linear_activation_kernels as kernels
    from kp_precision.ops import scaled_mm_kernels as mm_kernels

    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # Triton < 3.4: the pointer kernel
        TensorDescriptor = None

OP = "kp::linear_activation"
PACKAGE = "kp-precision"
SPEC = "linear_activation"
DTYPES = (torch.float16, torch.bfloat16)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M): Triton's Hopper matmul tutorial shape for 16-bit
# operands; the interpreter gets small tiles that cross block boundaries in small tests
TILE = (128, 256, 64, 8, 3, 8)
INTERPRET_TILE = (16, 32, 32, 1, 1, 2)
# The TMA kernel's tile (measured on the H100; 4 stages need more shared memory than an SM has) and, under the
# interpreter, how many persistent programs walk the tiles (two: the loop over tiles runs more than once).
TMA_TILE = (128, 256, 64, 8, 3, 8)
INTERPRET_PROGRAMS = 2
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
        y.copy_(reference(z, NAMES[activation]))
        if save_pre:
            pre.copy_(z)
        return y, pre
    interpret = backend == kp_core.INTERPRET
    bias = None if bias is None else bias.contiguous()  # the epilogue reads bias[col]
    if kp_core.settings("_linear_activation", tma=True)["tma"] and _tma_fits(x, weight, y):
        _launch_tma(backend, x, weight, bias, y, pre, activation, interpret)
        return y, pre
    bm, bn, bk, warps, stages, group = INTERPRET_TILE if interpret else TILE
    s = kp_core.settings("_linear_activation", block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    one = torch.ones((), device=x.device)
    grid = kp_core.cdiv(m, s["block_m"]) * kp_core.cdiv(n, s["block_n"])
    kp_core.check_index_fits("kp_precision.linear_activation", "the launch grid (programs)", grid)
    args = (x, x.stride(0), weight, weight.stride(0), one, 0, 0, one, 0, 0)
    args += (y if bias is None else bias, y, y.stride(0), y if pre is None else pre, m, n, k)
    consts = dict(SA_ROWS=1, SA_K=False, SB_COLS=1, SB_K=False, SCALE_K=128, HAS_BIAS=bias is not None)
    consts.update(ACT=int(NAMES[activation]), STORE_PRE=save_pre, A_E5M2=False, B_E5M2=False, SOFT=False)
    consts.update(PROMOTE_K=0, BLOCK_M=s["block_m"], BLOCK_N=s["block_n"], BLOCK_K=s["block_k"], GROUP_M=group)
    kp_core.launch(OP, backend, mm_kernels._scaled_mm, (grid,), args, consts, s["num_warps"], s["num_stages"])
    return y, pre


def _tma_fits(*tensors: torch.Tensor) -> bool:
    """Whether TMA can address the tensors: unit column stride, 16-byte aligned rows and start."""
    return TensorDescriptor is not None and all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors
    )


def _launch_tma(backend, x, weight, bias, y, pre, activation, interpret) -> None:
    (m, k), n = x.shape, weight.shape[0]
    bm, bn, bk, warps, stages, group = INTERPRET_TILE if interpret else TMA_TILE
    s = kp_core.settings("_linear_activation", block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    bm, bn, bk = s["block_m"], s["block_n"], s["block_k"]
    tiles = kp_core.cdiv(m, bm) * kp_core.cdiv(n, bn)
    programs = INTERPRET_PROGRAMS if interpret else kp_core.sm_count(x.device.index)
    desc = TensorDescriptor.from_tensor
    out = desc(y, [bm, bn])
    args = (desc(x, [bm, bk]), desc(weight, [bn, bk]), out, out if pre is None else desc(pre, [bm, bn]))
    args += (y if bias is None else bias, m, n, k)
    consts = dict(HAS_BIAS=bias is not None, ACT=int(NAMES[activation]), STORE_PRE=pre is not None)
    consts.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, PROGRAMS=programs)
    kernel = kernels._linear_activation
    grid = (min(programs, tiles),)  # fewer tiles than programs: one program each (PROGRAMS stays a constant)
    kp_core.launch(OP, backend, kernel, grid, args, consts, s["num_warps"], s["num_stages"], plain=True)


def _activation_grad(dy: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    dz = torch.empty_like(pre)
    backend = kp_core.choose_backend(OP, pre)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP)
        (grad,) = kp_core.vjp(lambda z: reference(z, NAMES[activation]), (pre.float(),), dy.float())
        return dz.copy_(grad)
    n = pre.numel()
    block = ELEMENTS * (16 if backend == kp_core.INTERPRET else 1)
    grid = kp_core.cdiv(n, block)
    args = (dy.contiguous(), pre, dz, n)
    consts = dict(ACT=int(NAMES[activation]), BLOCK=block)
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
