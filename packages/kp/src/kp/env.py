"""What this machine is, for the decision cache's key and for `kp env`."""

from __future__ import annotations

import importlib
import importlib.util

import torch

PACKAGES = (
    "kp_core",
    "kp_norms",
    "kp_attention",
    "kp_precision",
    "kp_sparsity",
    "kp_graphs",
    "kp_distributed",
    "kp_losses",
)


def environment() -> dict:
    """The device and every version a measured decision depends on.

    Keys: torch, triton and each kp package's version (None where not installed); on a GPU device, capability
    and cuda; elsewhere device "cpu" and the backend kp's ops take there ("interpret" or "reference").

    Examples:
        >>> import torch
        >>> import kp
        >>> env = kp.environment()
        >>> env["torch"] == torch.__version__, "kp_norms" in env
        (True, True)
    """
    import kp_core

    out = {"torch": torch.__version__, "triton": _version("triton")}
    out.update({name: _version(name) for name in PACKAGES})
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        out.update(device=torch.cuda.get_device_name(), capability=f"sm{major}{minor}", cuda=torch.version.cuda)
    else:
        out.update(device="cpu", backend=kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.REFERENCE)
    return out


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    return getattr(importlib.import_module(module), "__version__", "unknown")


def usable() -> dict[str, str]:
    """Per capability, whether it can run here and why not."""
    cuda = torch.cuda.is_available()
    cap = torch.cuda.get_device_capability() if cuda else (0, 0)
    triton = _version("triton")
    return {
        "triton kernels": (
            ("compiled on the GPU" if cuda else "Triton's interpreter (TRITON_INTERPRET=1): correct, not fast")
            if triton
            else "no: triton is not installed (kernels fall back to PyTorch)"
        ),
        "float8 matmul": "yes" if cap >= (8, 9) else "no: needs sm89 or later (Ada, Hopper)",
        "2:4 sparse matmul": "yes" if cap >= (8, 0) else "no: needs sm80 or later",
        "CUDA graphs": "yes" if cuda else "no: needs a GPU",
        "transformers patching": f"yes ({_version('transformers')})" if _version("transformers") else "no",
    }


def describe() -> str:
    """What `kp env` prints: kp.environment(), the GPU count, and per capability (Triton kernels, float8 and 2:4
    matmuls, CUDA graphs, transformers patching) whether it can run here and why not.

    Examples:
        >>> import kp
        >>> print(kp.describe())  # doctest: +ELLIPSIS
        torch: ...
        triton: ...
        kp_core: ...
        ...
        CUDA graphs: ...
        transformers patching: ...
    """
    lines = [f"{k}: {v}" for k, v in environment().items()]
    if torch.cuda.is_available():
        lines.append(f"GPUs: {torch.cuda.device_count()}")
    lines += [f"{k}: {v}" for k, v in usable().items()]
    return "\n".join(lines)
