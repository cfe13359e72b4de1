"""Integer fake quantisation (quantise then dequantise, for QAT): launcher, PyTorch path and op declaration.

Symmetric, per group of `group` consecutive elements of the last dim (a whole row when group is 0):

    scale = max(amax, EPS) / QMAX                       QMAX 127 (int8) or 7 (int4), EPS 1e-12; IEEE division
    q     = clamp(round_half_even(x / scale), -QMAX - 1, QMAX)
    y     = q * scale in float32, rounded once to x's dtype

`int_quantize` gives (q, scale) by the same arithmetic in PyTorch, so a converted model's weights dequantise to
exactly the fake-quantised values the QAT model trained with.

Kernel: kp_precision.ops.fake_quantize_kernels. Declaration: FAKE_QUANTIZE (kp::fake_quantize). Spec:
conformance/specs/test_fake_quantize.py.
"""

import torch

import kp_core

if kp_core.has_triton():
    from kp_precision.ops import fake_quantize_kernels as kernels

OP = "kp::fake_quantize"
PACKAGE = "kp-precision"
SPEC = "fake_quantize"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
EPS = 1e-12
MAX_ROW = 65536  # a whole-row group is one tile
# elements per program on a GPU (the interpreter: x16, see quantize.INTERPRET_SCALE), num_warps; a test or a
# benchmark may pin others (kp_core.pin("_fake_quantize", ...))
TILE = (4096, 8)


def int_quantize(x2: torch.Tensor, qmax: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q as float32 integers (M, K), scale float32 (M, K / group)) by the module docstring's arithmetic."""
    m, k = x2.shape
    g = group or k
    xg = x2.float().reshape(m, k // g, g)
    scale = xg.abs().amax(-1, keepdim=True).clamp(min=EPS) / torch.full((), float(qmax), device=x2.device)
    q = torch.round(xg / scale).clamp(-qmax - 1, qmax)
    return q.reshape(m, k), scale.reshape(m, k // g)


def forward(x: torch.Tensor, qmax: int, group: int) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    m = x2.shape[0]
    y2 = y.view(m, k)
    backend = kp_core.choose_backend(OP, x2)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP)
        q, s = int_quantize(x2, qmax, group)
        g = group or k
        y2.copy_((q.view(m, -1, g) * s.unsqueeze(-1)).view(m, k))
        return y
    s = kp_core.settings("_fake_quantize", elements=TILE[0], num_warps=TILE[1])
    elements, warps = s["elements"], s["num_warps"]
    if backend == kp_core.INTERPRET:
        elements *= 16
    bk = kp_core.next_power_of_2(k) if group == 0 else max(group, min(1024, kp_core.next_power_of_2(k)))
    bm = max(1, elements // bk)
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
    kp_core.check_index_fits("kp_precision.fake_quantize", "the launch grid (programs)", grid)
    consts = dict(QMAX=float(qmax), EPS=EPS, GROUP=group or bk, BLOCK_M=bm, BLOCK_K=bk)
    args = (x2, x2.stride(0), y2, y2.stride(0), m, k)
    kp_core.launch(OP, backend, kernels._fake_quantize, (grid,), args, consts, warps)
    return y


FAKE_QUANTIZE = kp_core.op(
    OP, forward, lambda x, qmax, group: torch.empty_like(x), package=PACKAGE, spec=SPEC, dtypes=DTYPES
)
