"""Where the suite runs: the device, its architecture label, versions, and known interpreter gaps."""

from __future__ import annotations

import functools
import os
import platform

import torch


def device() -> torch.device:
    name = os.environ.get("KP_DEVICE")
    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def arch() -> str:
    """sm90, gfx942, ... for GPUs; cpu-interpret or cpu-reference off-GPU."""
    dev = device()
    if dev.type == "cuda" and not interpreting():
        props = torch.cuda.get_device_properties(dev)
        if torch.version.hip:
            return getattr(props, "gcnArchName", "rocm").split(":")[0]
        return f"sm{props.major}{props.minor}"
    return "cpu-interpret" if interpreting() else "cpu-reference"


def device_name() -> str:
    dev = device()
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return {"torch": torch.__version__, "triton": triton_version, "python": platform.python_version()}


@functools.lru_cache(maxsize=1)
def interpreter_truncates_bf16() -> bool:
    """Triton's interpreter converts fp32 -> bf16 by truncation, not round-to-nearest-even (seen with
    triton 3.9). Kernels that store bf16 are then off by up to one ulp, so bf16 cells are not covered on
    interpret. Probed, not assumed: a fixed interpreter turns these cells back on."""
    if not interpreting():
        return False
    import triton
    import triton.language as tl

    @triton.jit
    def _copy(X, Y):
        tl.store(Y + tl.arange(0, 2), tl.load(X + tl.arange(0, 2)))

    x = torch.tensor([1.0 + 3 * 2.0**-9, -(1.0 + 3 * 2.0**-9)], dtype=torch.float32)
    y = torch.empty(2, dtype=torch.bfloat16)
    _copy[(1,)](x, y)
    return not torch.equal(y, x.to(torch.bfloat16))


def not_covered_reason(dtype: torch.dtype, uses_dot: bool = False) -> str | None:
    """Why a (backend, dtype) cell cannot be checked here, or None if it can."""
    if dtype == torch.bfloat16 and interpreting():
        if uses_dot:
            return "not covered on interpret: the interpreter computes bf16 tl.dot wrongly"
        if interpreter_truncates_bf16():
            return "not covered on interpret: the interpreter truncates fp32->bf16 stores (no round-to-nearest)"
    dev = device()
    if dtype == torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        return f"not covered: {device_name()} has no bf16"
    return None


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
