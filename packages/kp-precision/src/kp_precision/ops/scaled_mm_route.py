"""Which float8 scaled matmuls kp hands to cuBLASLt, and the call (kp_precision.ops.scaled_mm's docstring says why).

Precise (use_fast_accum=False) tensorwise and per-row / per-column calls go to torch._scaled_mm, whose
accumulation matches the kernel's promotion every 128 and which runs it about 3x faster on the H100. DeepSeek's
blockwise recipe (1 x 128 blocks of a with 128 x 128 blocks of b) goes to torch.nn.functional.scaled_mm where the
installed torch has it (cuBLASLt promotes every 128 either way; measured 3.8x the kernel). Whether a torch takes
the dtypes and scale kinds on a device is tried once on a small case and cached; a call it then refuses falls
back to the kernel. kp_core.settings("scaled_mm_route", cublas=False) turns the route off (the conformance
specs check the kernel that way, and the route on its own).
"""

import torch
import torch.nn.functional as F

import kp_core

# The launch record's backend for a call that ran on cuBLASLt.
LIBRARY = "library"
_TAKES: dict[tuple, bool] = {}


def _kind(scale: torch.Tensor, along_k: bool, per_rows: int) -> str:
    if scale.numel() == 1:
        return "tensor"
    if not along_k:
        return "row"
    return "block" if per_rows == 1 else "square"


def _call(a, b, scale_a, scale_b, kinds, out_dtype, use_fast_accum):
    if kinds[0] != "block":  # tensorwise / per row and column
        sa = scale_a.reshape(()) if scale_a.numel() == 1 else scale_a
        sb = scale_b.reshape(()) if scale_b.numel() == 1 else scale_b
        return torch._scaled_mm(a, b, sa, sb, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    recipe = F.ScalingType
    return F.scaled_mm(  # cuBLASLt wants both scales outer-dim major
        a,
        b,
        scale_a.t().contiguous().t(),
        recipe.BlockWise1x128,
        scale_b.t().contiguous().t(),
        recipe.BlockWise128x128,
        output_dtype=out_dtype,
        use_fast_accum=use_fast_accum,
    )


def _takes(a, b, kinds, use_fast_accum) -> bool:
    key = (a.dtype, b.dtype, kinds, use_fast_accum, a.device)
    if key not in _TAKES:
        m, k, n = (128, 256, 256) if kinds[0] == "block" else (16, 32, 16)
        z = torch.zeros(max(m, n), k, device=a.device)
        shapes = {"tensor": (), "row": (m, 1), "column": (1, n), "block": (m, k // 128), "square": (k // 128, n // 128)}
        sa = torch.ones(shapes[kinds[0]], device=a.device)
        sb = torch.ones(shapes["column" if kinds[1] == "row" else kinds[1]], device=a.device)
        try:
            _call(z[:m].to(a.dtype), z[:n].to(b.dtype).t(), sa, sb, kinds, torch.float32, use_fast_accum)
            _TAKES[key] = True
        except (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError):
            _TAKES[key] = False
    return _TAKES[key]


def routes(a, b, scale_a, scale_b, layouts, use_fast_accum) -> bool:
    """Whether this call goes to cuBLASLt. layouts: scale_layout() of scale_a and scale_b."""
    if not kp_core.settings("scaled_mm_route", cublas=True)["cublas"]:
        return False
    kinds = (_kind(scale_a, layouts[0][1], layouts[0][0]), _kind(scale_b, layouts[1][1], layouts[1][0]))
    if kinds == ("block", "square"):
        if a.shape[1] % 128 or b.shape[1] % 128:
            return False
    elif "block" in kinds or "square" in kinds or use_fast_accum:
        return False  # the kernel's fast accumulation runs at torch._scaled_mm's speed, with the epilogue fused
    return _takes(a, b, kinds, use_fast_accum)


def run(a, b, scale_a, scale_b, bias, activation, out_dtype, use_fast_accum, layouts, act_fn):
    """cuBLASLt's product, then bias and the activation in float32 and one cast (the kernel's epilogue rounding);
    None if cuBLASLt refuses the call."""
    kinds = (_kind(scale_a, layouts[0][1], layouts[0][0]), _kind(scale_b, layouts[1][1], layouts[1][0]))
    plain = bias is None and activation == "none"
    try:
        y = _call(a, b, scale_a, scale_b, kinds, out_dtype if plain else torch.float32, use_fast_accum)
    except RuntimeError:
        return None
    kp_core.note_launch("kp::scaled_mm", "cublaslt", LIBRARY)
    if plain:
        return y
    if bias is not None:
        y += bias
    return act_fn(y).to(out_dtype)
