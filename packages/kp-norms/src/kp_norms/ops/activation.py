"""Activations fused into the norm and gated-activation kernels: one enum for Python and the kernels.

The kernels switch on `Activation` values (kp_norms.ops.activation_kernels); the reference path uses
PyTorch's own functions.
"""

import enum

import torch
import torch.nn.functional as F


class Activation(enum.IntEnum):
    NONE = 0
    SILU = 1
    GELU = 2  # the exact (erf) form, F.gelu(approximate="none")
    GELU_TANH = 3


# Names a user passes.
BY_NAME = {None: Activation.NONE, "silu": Activation.SILU, "gelu": Activation.GELU, "gelu_tanh": Activation.GELU_TANH}


def by_name(op: str, name) -> Activation:
    if name not in BY_NAME:
        names = ", ".join(repr(k) for k in BY_NAME)
        raise ValueError(f"{op}: activation must be one of {names}, got {name!r}")
    return BY_NAME[name]


def reference(z: torch.Tensor, act: int) -> torch.Tensor:
    """The activation by PyTorch's own functions (the reference path)."""
    if act == Activation.SILU:
        return F.silu(z)
    if act == Activation.GELU:
        return F.gelu(z)
    if act == Activation.GELU_TANH:
        return F.gelu(z, approximate="tanh")
    return z
