"""Which float8 scaled matmuls kp hands to cuBLASLt, and the call (kp_precision.ops.scaled_mm's docstring says why).

Precise (use_fast_accum=False) tensorwise and per-row / per-column calls go to torch._scaled_mm, whose
accumulation matches the kernel's promotion every 128 and which runs it about 3x faster on the H100. Whether the
installed torch takes the dtypes and scale kinds on a device is tried once on a small case and cached; a call it
then refuses falls back to the kernel. kp_core.settings("scaled_mm_route", cublas=False) turns the route off (the
conformance specs check the kernel that way, and the route on its own).
"""

import torch

import kp_core

# The launch record's backend for a call that ran on cuBLASLt.
LIBRARY = "library"
_TAKES: dict[tuple, bool] = {}


def _call(a, b, scale_a, scale_b, out_dtype):
    sa = scale_a.reshape(()) if scale_a.numel() == 1 else scale_a
    sb = scale_b.reshape(()) if scale_b.numel() == 1 else scale_b
    return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype)


def _takes(a, b, scale_a, scale_b) -> bool:
    key = (a.dtype, b.dtype, scale_a.numel() == 1, scale_b.numel() == 1, a.device)
    if key not in _TAKES:
        z = torch.zeros(16, 32, device=a.device)
        sa = torch.ones(() if key[2] else (16, 1), device=a.device)
        sb = torch.ones(() if key[3] else (1, 16), device=a.device)
        try:
            _call(z.to(a.dtype), z.to(b.dtype).t(), sa, sb, torch.float32)
            _TAKES[key] = True
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            _TAKES[key] = False
    return _TAKES[key]


def routes(a, b, scale_a, scale_b, layouts, use_fast_accum) -> bool:
    """Whether this call goes to cuBLASLt. layouts: scale_layout() of scale_a and scale_b (rows, along K)."""
    if use_fast_accum or layouts[0][1] or layouts[1][1]:
        return False  # fast: the kernel runs at torch._scaled_mm's speed with the epilogue fused; blockwise: kernel
    if not kp_core.settings("scaled_mm_route", cublas=True)["cublas"]:
        return False
    return _takes(a, b, scale_a, scale_b)


def run(a, b, scale_a, scale_b, bias, activation, out_dtype, act_fn):
    """torch._scaled_mm's product, then bias and the activation in float32 and one cast (the kernel's epilogue
    rounding); None if it refuses the call."""
    plain = bias is None and activation == "none"
    try:
        y = _call(a, b, scale_a, scale_b, out_dtype if plain else torch.float32)
    except RuntimeError:
        return None
    kp_core.note_launch("kp::scaled_mm", "torch._scaled_mm", LIBRARY)
    if plain:
        return y
    if bias is not None:
        y += bias
    return act_fn(y).to(out_dtype)
