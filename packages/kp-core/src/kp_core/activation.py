"""Activations fused into kp kernels: one enum for Python and the kernels, the names users pass, the PyTorch
reference.

Every package numbers its activations with `Activation` (the kernels switch on its values through
kp_core.activation_kernels: kp-norms' norm and gated-activation kernels, kp-precision's scaled-matmul epilogue
and linear + activation). Each op accepts the names it lists (`by_name(op, name, accepted)`), so a package
takes exactly the activations its kernels are tested with.
"""

import enum

import torch
import torch.nn.functional as F

from kp_core import constants


class Activation(enum.IntEnum):
    """The activations kp's kernels fuse, as the int constexpr a kernel takes (`int(Activation.SILU)`).

    NONE (0), SILU (1), GELU (2, the erf form: `F.gelu(approximate="none")`), GELU_TANH (3,
    `F.gelu(approximate="tanh")`), RELU (4).

    Examples:
        >>> import kp_core
        >>> int(kp_core.Activation.SILU)
        1
        >>> kp_core.Activation(3).name
        'GELU_TANH'
    """

    NONE = 0
    SILU = 1
    GELU = 2  # the exact (erf) form, F.gelu(approximate="none")
    GELU_TANH = 3  # F.gelu(approximate="tanh")
    RELU = 4


# The name of each activation, as users pass it (None is NONE too).
NAMES = {a.name.lower(): a for a in Activation}


def by_name(op: str, name, accepted: tuple = (None, *NAMES)) -> Activation:
    """The Activation called `name`; ValueError naming `op` and its `accepted` names otherwise.

    Args:
        op: the op's name, for the error message.
        name: None (NONE), "silu", "gelu", "gelu_tanh" or "relu".
        accepted: the names this op takes (all of them by default).

    Examples:
        >>> from kp_core.activation import by_name
        >>> by_name("my_op", "silu")
        <Activation.SILU: 1>
        >>> by_name("my_op", "relu", accepted=(None, "silu"))
        Traceback (most recent call last):
            ...
        ValueError: my_op: activation must be one of None, 'silu', got 'relu'
    """
    if name not in accepted:
        names = ", ".join(repr(k) for k in accepted)
        raise ValueError(f"{op}: activation must be one of {names}, got {name!r}")
    return Activation.NONE if name is None else NAMES[name]


def reference(z: torch.Tensor, act: int) -> torch.Tensor:
    """The activation by PyTorch's own functions (F.silu, F.gelu, torch.relu; `z` itself for NONE).

    Args:
        z: a floating-point tensor of any shape; the result has its shape and dtype.
        act: an Activation (or its int value).

    Examples:
        >>> import torch
        >>> from kp_core import Activation
        >>> from kp_core.activation import reference
        >>> reference(torch.tensor([-1.0, 2.0]), Activation.RELU)
        tensor([0., 2.])
    """
    if act == Activation.SILU:
        return F.silu(z)
    if act == Activation.GELU:
        return F.gelu(z)
    if act == Activation.GELU_TANH:
        return F.gelu(z, approximate="tanh")
    if act == Activation.RELU:
        return torch.relu(z)
    return z


def reference_with_grad(g: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), act'(g)) with torch ops in g's dtype, by the formulas of kp_core.activation_kernels.act (1 -
    sigmoid(x) as sigmoid(-x), as the kernels' product form).

    Args:
        g: a floating-point tensor of any shape; both results have its shape and dtype.
        act: an Activation (or its int value).

    Examples:
        >>> import torch
        >>> from kp_core import Activation
        >>> from kp_core.activation import reference_with_grad
        >>> value, slope = reference_with_grad(torch.tensor([0.0, 3.0]), Activation.RELU)
        >>> value, slope
        (tensor([0., 3.]), tensor([0., 1.]))
    """
    if act == Activation.GELU:
        cdf = 0.5 * (1 + torch.erf(g * constants.SQRT1_2))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) * constants.INV_SQRT_2PI
    if act == Activation.SILU:
        s, s_c = torch.sigmoid(g), torch.sigmoid(-g)
        return g * s, s * (1 + g * s_c)
    if act == Activation.GELU_TANH:
        c = 2 * constants.SQRT_2_OVER_PI
        z2 = c * (g + constants.GELU_TANH_CUBIC * g**3)
        s, s_c = torch.sigmoid(z2), torch.sigmoid(-z2)
        return g * s, s * (1 + c * g * s_c * (1 + 3 * constants.GELU_TANH_CUBIC * g * g))
    if act == Activation.RELU:
        return torch.relu(g), (g > 0).to(g.dtype)
    return g, torch.ones_like(g)
