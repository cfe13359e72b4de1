"""Thin nn.Module wrappers: same constructor arguments and state_dict keys as torch.nn."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from kp_norms.functional import check_casting, check_eps, geglu, layer_norm, rms_norm, sizes, swiglu


def _sizes(name: str, normalized_shape) -> tuple:
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        normalized_shape = int(normalized_shape)  # a numpy int, as torch.nn takes
    return sizes(name, normalized_shape)


class RMSNorm(nn.Module):
    """Drop-in for `torch.nn.RMSNorm`, computed by kp's kernel; `offset` and `casting` as in
    `kp_norms.rms_norm` (offset=1.0 is Gemma's norm, whose weight starts at zero).

    Args:
        normalized_shape: the trailing dims normalised (an int or a sequence of them).
        eps: a number, or None for the compute dtype's epsilon (as torch.nn.RMSNorm).
        elementwise_affine: whether it holds a `weight` of shape normalized_shape (ones; zeros with an offset).
        device: the weight's device.
        dtype: the weight's dtype.
        offset: y = n * (offset + weight).
        casting: "torch", "gemma" or "llama" (see kp_norms.rms_norm).

    The forward takes (*, *normalized_shape) in float16, bfloat16, float32 or float64 and returns that shape.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> norm = kp_norms.RMSNorm(64, eps=1e-6)
        >>> norm(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
        >>> kp_norms.RMSNorm(64, offset=1.0).weight.sum().item()  # Gemma's: zeros, scaled by 1 + w
        0.0
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine", "offset", "casting"]

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        offset: float = 0.0,
        casting: str = "torch",
    ) -> None:
        super().__init__()
        # Checked here, not at the first call, so a wrong setting fails where it is written.
        self.normalized_shape = _sizes("kp_norms.RMSNorm", normalized_shape)
        check_eps("kp_norms.RMSNorm", eps)
        check_casting("kp_norms.RMSNorm", casting)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.offset = offset
        self.casting = casting
        if elementwise_affine:
            self.weight = nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight) if self.offset == 0 else nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps, offset=self.offset, casting=self.casting)

    def extra_repr(self) -> str:
        s = "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)
        if self.offset != 0 or self.casting != "torch":
            s += f", offset={self.offset}, casting={self.casting!r}"
        return s


class LayerNorm(nn.Module):
    """Drop-in for `torch.nn.LayerNorm` (same arguments, attributes and state_dict keys).

    Args:
        normalized_shape: the trailing dims normalised (an int or a sequence of them).
        eps: a number.
        elementwise_affine: whether it holds `weight` (ones) and, with bias=True, `bias` (zeros), each of shape
            normalized_shape.
        bias: whether it holds a bias.
        device: the parameters' device.
        dtype: the parameters' dtype.

    The forward takes (*, *normalized_shape) in float16, bfloat16, float32 or float64 and returns that shape.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> norm = kp_norms.LayerNorm(64)
        >>> sorted(norm.state_dict()) == sorted(torch.nn.LayerNorm(64).state_dict())
        True
        >>> norm(torch.randn(8, 64)).shape
        torch.Size([8, 64])
    """

    __constants__ = ["normalized_shape", "eps", "elementwise_affine"]

    def __init__(
        self,
        normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = _sizes("kp_norms.LayerNorm", normalized_shape)
        check_eps("kp_norms.LayerNorm", eps)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        factory = {"device": device, "dtype": dtype}
        for name, wanted in (("weight", elementwise_affine), ("bias", elementwise_affine and bias)):
            param = nn.Parameter(torch.empty(self.normalized_shape, **factory)) if wanted else None
            self.register_parameter(name, param)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return nn.LayerNorm.extra_repr(self)  # the installed torch's own wording (newer releases add "bias=")


class GatedMLP(nn.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))` with `act(g) * u` in one kp kernel: SwiGLU for "silu",
    GeGLU for "gelu" / "gelu_tanh". Children and state_dict keys are those of Hugging Face's LlamaMLP.

    Args:
        hidden_size: the input's and output's last dim.
        intermediate_size: gate_proj's and up_proj's output size.
        activation: "silu", "gelu" or "gelu_tanh".
        bias: whether the three nn.Linear projections have biases.
        device: the projections' device.
        dtype: the projections' dtype.

    The forward takes (*, hidden_size) in the projections' dtype and returns (*, hidden_size).
    `GatedMLP.from_modules(gate_proj, up_proj, down_proj, activation)` wraps existing projections.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> mlp = kp_norms.GatedMLP(64, 128)
        >>> mlp(torch.randn(2, 5, 64)).shape
        torch.Size([2, 5, 64])
        >>> sorted(mlp.state_dict())[:2]
        ['down_proj.weight', 'gate_proj.weight']
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for arg, n in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
                raise ValueError(f"kp_norms.GatedMLP: {arg} must be a non-negative int, got {n!r}")
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self._init(
            nn.Linear(hidden_size, intermediate_size, **factory),
            nn.Linear(hidden_size, intermediate_size, **factory),
            nn.Linear(intermediate_size, hidden_size, **factory),
            activation,
        )

    @classmethod
    def from_modules(
        cls, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, activation: str = "silu"
    ) -> GatedMLP:
        """A GatedMLP around existing projections (any modules: the same objects, not copies)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._init(gate_proj, up_proj, down_proj, activation)
        return new

    def _init(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module, activation: str) -> None:
        if activation not in ("silu", "gelu", "gelu_tanh"):
            raise ValueError(f"kp_norms.GatedMLP: activation must be 'silu', 'gelu' or 'gelu_tanh', got {activation!r}")
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "silu":
            h = swiglu(gate, up)
        else:
            h = geglu(gate, up, approximate="tanh" if self.activation == "gelu_tanh" else "none")
        return self.down_proj(h)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
