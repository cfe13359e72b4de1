"""Which float8 scaled matmuls kp hands to cuBLASLt, and the call (kp_precision.ops.scaled_mm's docstring says why):
part of kp::scaled_mm, which imports this module (this module imports nothing of it).

Precise (use_fast_accum=False) tensorwise and per-row / per-column calls go to torch._scaled_mm, whose
accumulation matches the kernel's promotion every 128 and which runs it about 3x faster on the H100; fast ones
go there too when they have no bias and no activation (else the kernel, which fuses them). Whether the
installed torch takes the dtypes and scale kinds on a device is tried once on a small case and cached; a call it
then refuses falls back to the kernel. Blockwise calls with 1 x 128 blocks of A and 128 x 128 or 1 x 128 blocks of
B go to torch.nn.functional.scaled_mm's blockwise recipes where the installed torch has it (it promotes every 128 like
the kernel, fast or not); a call it refuses (its dtypes, shapes or this GPU) runs the kernel.
kp_core.settings("scaled_mm_route", cublas=False) turns the route off (the conformance specs check the kernel
that way, and the route on its own). The epilogue after cuBLASLt's product is scaled_mm_kernels._epilogue.
"""

import torch
from torch.utils._python_dispatch import _disable_current_modes

import kp_core
from kp_core.activation import NAMES, reference

if kp_core.has_triton():
    from kp_precision.ops import scaled_mm_kernels as kernels

OP = "kp::scaled_mm"  # the op this module is part of (kp_precision.ops.scaled_mm.OP)
# The launch record's backend for a call that ran on cuBLASLt.
LIBRARY = "library"
ELEMENTS = 4096  # per program of the epilogue
INTERPRET_ELEMENTS = 512  # under the interpreter: small tests still span several programs
_TAKES: dict[tuple, bool] = {}


def _call(a, b, scale_a, scale_b, out_dtype, use_fast_accum=False):
    sa = scale_a.reshape(()) if scale_a.numel() == 1 else scale_a
    sb = scale_b.reshape(()) if scale_b.numel() == 1 else scale_b
    return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype, use_fast_accum=use_fast_accum)


def _takes(a, b, scale_a, scale_b) -> bool:
    key = (a.dtype, b.dtype, scale_a.numel() == 1, scale_b.numel() == 1, a.device)
    if key not in _TAKES:
        # The probe runs on real tensors even while torch.compile traces the op (its tensors are fake then, and a
        # fake call takes anything): the route chosen at tracing is baked into the compiled graph, so a model
        # compiled before any eager call must not be left on the 3x slower kernel.
        with _disable_current_modes():
            z = torch.zeros(16, 32, device=a.device)
            sa = torch.ones(() if key[2] else (16, 1), device=a.device)
            sb = torch.ones(() if key[3] else (1, 16), device=a.device)
            try:
                _call(z.to(a.dtype), z.to(b.dtype).t(), sa, sb, torch.float32)
                _TAKES[key] = True
            except (RuntimeError, NotImplementedError, TypeError, ValueError):
                _TAKES[key] = False
    return _TAKES[key]


def _blockwise_kinds(layouts) -> tuple | None:
    """torch.nn.functional.scaled_mm's ScalingType names of a blockwise pair kp routes, else None."""
    if not hasattr(torch.nn.functional, "ScalingType"):
        return None
    pair = (tuple(layouts[0]), tuple(layouts[1]))
    if pair == ((1, True), (128, True)):
        return ("BlockWise1x128", "BlockWise128x128")
    if pair == ((1, True), (1, True)):  # the weight gradient's operands, both cast along M
        return ("BlockWise1x128", "BlockWise1x128")
    return None


def routes(a, b, scale_a, scale_b, layouts, use_fast_accum, plain=False) -> bool:
    """Whether this call goes to cuBLASLt. layouts: scale_layout() of scale_a and scale_b (rows, along K); plain:
    no bias and no activation."""
    if not kp_core.settings("scaled_mm_route", cublas=True)["cublas"]:
        return False
    if layouts[0][1] or layouts[1][1]:
        # M a multiple of 8: the row counts its results were checked at on the H100 (64 to 8192)
        return _blockwise_kinds(layouts) is not None and a.shape[0] % 8 == 0
    if use_fast_accum and not plain:
        # the kernel fuses the epilogue, where cuBLASLt's product would need a pass of its own; a plain fast call
        # goes to cuBLASLt, about 12 % faster than the kernel on the H100 (float8 demo model's forward GEMMs)
        return False
    return _takes(a, b, scale_a, scale_b)


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """A (rows, K-blocks) scale stored rows fastest (strides (1, rows)), as cuBLASLt's 1 x 128 recipe reads it."""
    rows, kb = scale.shape
    if scale.stride() == (1, rows):
        return scale  # already so: kp's (K/128, N) scale of b, transposed, is
    return torch.empty_strided((rows, kb), (1, rows), device=scale.device).copy_(scale)


def _blockwise_call(a, b, scale_a, scale_b, kinds, out_dtype):
    sa = _outer_major(scale_a)  # (M, K/128)
    if kinds[1] == "BlockWise1x128":
        sb = _outer_major(scale_b.t())  # (N, K/128), N fastest
    else:
        # B's 128 x 128 scale: (K/128, N/128), K-blocks fastest and padded to a multiple of 4 (never read)
        kb, nb = scale_b.shape
        sb = torch.ones((nb, kp_core.cdiv(kb, 4) * 4), device=scale_b.device)
        sb[:, :kb] = scale_b.t()
        sb = sb.t()
    kind = torch.nn.functional.ScalingType
    return torch.nn.functional.scaled_mm(
        a, b, sa, getattr(kind, kinds[0]), sb, getattr(kind, kinds[1]), output_dtype=out_dtype
    )


def run(a, b, scale_a, scale_b, layouts, bias, activation, out_dtype, use_fast_accum=False):
    """cuBLASLt's product, then bias, the activation and one cast to out_dtype (epilogue()); None if it refuses
    the call."""
    plain = bias is None and activation == "none"
    kinds = _blockwise_kinds(layouts) if layouts[0][1] or layouts[1][1] else None
    try:
        if kinds:
            y = _blockwise_call(a, b, scale_a.float(), scale_b.float(), kinds, out_dtype if plain else torch.float32)
        else:
            y = _call(a, b, scale_a, scale_b, out_dtype if plain else torch.float32, use_fast_accum)
    except (RuntimeError, ValueError, NotImplementedError):
        return None
    name = "torch.nn.functional.scaled_mm" if kinds else "torch._scaled_mm"
    kp_core.note_launch(OP, name, LIBRARY)
    return y if plain else epilogue(y, bias, activation, out_dtype)


def epilogue(y: torch.Tensor, bias: torch.Tensor | None, activation: str, out_dtype: torch.dtype) -> torch.Tensor:
    """act(y + bias) cast to out_dtype for a contiguous float32 (M, N) product, in one pass (the kernel's epilogue
    rounding: the float32 sum, bias and activation rounded once); in place when out_dtype is float32."""
    out = y if out_dtype == torch.float32 else torch.empty(y.shape, dtype=out_dtype, device=y.device)
    if y.numel() == 0:
        return out
    backend = kp_core.choose_backend(OP, y)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP)
        return out.copy_(reference(y if bias is None else y + bias.float(), NAMES[activation]))
    n = y.numel()
    block = INTERPRET_ELEMENTS if backend == kp_core.INTERPRET else ELEMENTS
    grid = kp_core.cdiv(n, block)
    args = (y, y if bias is None else bias, out, n, y.shape[1])
    consts = dict(HAS_BIAS=bias is not None, ACT=int(NAMES[activation]), BLOCK=block)
    kp_core.launch(OP, backend, kernels._epilogue, (grid,), args, consts, 8)
    return out
