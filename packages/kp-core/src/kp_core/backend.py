"""Which implementation runs a call: compiled Triton, Triton's interpreter, or the PyTorch reference."""

from __future__ import annotations

import functools
import os

import torch

TRITON = "triton"
"""The backend name of compiled Triton kernels on a GPU (what `choose_backend` returns for CUDA tensors)."""
INTERPRET = "interpret"
"""The backend name of Triton kernels run by Triton's interpreter (TRITON_INTERPRET=1, any device)."""
REFERENCE = "reference"
"""The backend name of the PyTorch reference path: no kernel runs."""
_FORCE_CHOICES = ("auto", REFERENCE, TRITON)


@functools.lru_cache(maxsize=1)
def has_triton() -> bool:
    """Whether Triton imports here (cached).

    Examples:
        >>> import kp_core
        >>> kp_core.has_triton()  # with Triton installed
        True
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """Whether TRITON_INTERPRET=1 is set now.

    Examples:
        >>> import kp_core
        >>> kp_core.interpreter_enabled()  # TRITON_INTERPRET unset
        False
    """
    # Triton reads this when a kernel is decorated, so it must be set before the kernel modules import.
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def interpreter_problem() -> str | None:
    """Why Triton's interpreter cannot run kp's kernels here, or None when it can (cached).

    Triton before 3.7 converts one-element arrays to Python ints (a loop over a runtime bound, `range(0, K, BLOCK)`)
    in a way NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars", Triton issue 9171,
    fixed in 3.7). Interpreted launches raise this message instead of Triton's.

    Examples:
        >>> import kp_core
        >>> kp_core.interpreter_problem()  # Triton 3.9 with NumPy 2.4, or Triton 3.6 with NumPy 2.3
    """
    if not has_triton():
        return None
    import numpy
    import triton

    def version(text: str) -> tuple[int, int]:
        major, minor = text.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)

    if version(triton.__version__) < (3, 7) and version(numpy.__version__) >= (2, 4):
        return (
            f"Triton {triton.__version__}'s interpreter does not run with NumPy {numpy.__version__} (it needs "
            "NumPy < 2.4 before Triton 3.7): pip install 'numpy<2.4' or 'triton>=3.7'"
        )
    return None


def forced_backend() -> str:
    """KP_BACKEND's value ("auto", "reference" or "triton"); any other value is a ValueError.

    Examples:
        >>> import kp_core
        >>> kp_core.forced_backend()  # KP_BACKEND unset
        'auto'
    """
    value = os.environ.get("KP_BACKEND", "auto").strip().lower() or "auto"
    if value not in _FORCE_CHOICES:
        raise ValueError(f"KP_BACKEND must be one of {_FORCE_CHOICES}, got {value!r}")
    return value


# os.environ's own dict (encoded keys), where CPython keeps it: `"X" in os.environ` raises and catches a KeyError
# inside when X is unset, a microsecond or two per call; a dict lookup is a tenth of that.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEYS = tuple(os.environ.encodekey(k) for k in ("KP_BACKEND", "TRITON_INTERPRET")) if _ENV_DATA else ()


def _env_set() -> bool:
    """Whether KP_BACKEND or TRITON_INTERPRET is set (at all)."""
    if _ENV_DATA is None:
        return "KP_BACKEND" in os.environ or "TRITON_INTERPRET" in os.environ
    return _ENV_KEYS[0] in _ENV_DATA or _ENV_KEYS[1] in _ENV_DATA


def choose_backend(op: str, *tensors: torch.Tensor) -> str:
    """Pick the path for one call from the first tensor's device and the environment (read on every call, so
    tests and debugging sessions may change it; two dictionary lookups when neither variable is set).

    Returns TRITON for CUDA tensors where Triton is installed, INTERPRET under TRITON_INTERPRET=1 (any device),
    REFERENCE otherwise or under KP_BACKEND=reference; KP_BACKEND=triton makes the REFERENCE case a
    RuntimeError naming `op`.

    Args:
        op: the op's name, for the error message.
        *tensors: the call's tensors (any shape and dtype); the first one's device decides.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> kp_core.choose_backend("my_op", torch.ones(4))  # a CPU tensor, KP_BACKEND and TRITON_INTERPRET unset
        'reference'
    """
    if not _env_set():
        return TRITON if tensors[0].is_cuda and has_triton() else REFERENCE
    env = os.environ
    forced = forced_backend() if "KP_BACKEND" in env else "auto"
    if forced == REFERENCE:
        return REFERENCE
    if env.get("TRITON_INTERPRET") == "1" and has_triton():
        return INTERPRET
    if tensors[0].is_cuda and has_triton():  # ROCm devices are "cuda" in torch too
        return TRITON
    device = tensors[0].device
    if forced == TRITON:
        why = (
            "Triton is not installed"
            if not has_triton()
            else (f"the tensors are on {device} and TRITON_INTERPRET is not 1")
        )
        raise RuntimeError(f"{op}: KP_BACKEND=triton but {why}")
    return REFERENCE
