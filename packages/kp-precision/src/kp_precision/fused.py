"""FusedLinearActivation: nn.Linear followed by an activation, as one GEMM with the bias and activation fused."""

from torch import nn

from kp_core.activation import by_name
from kp_precision.functional import linear_activation
from kp_precision.ops.scaled_mm import ACTIVATIONS
from kp_precision.shared import autocast_dtype


class FusedLinearActivation(nn.Linear):
    """act(x @ weight.T + bias) with kp_precision.linear_activation (float16 / bfloat16). Parameters and state_dict
    are nn.Linear's; `from_linear(linear, activation)` shares a layer's parameters.

    Args:
        in_features: as nn.Linear's.
        out_features: as nn.Linear's.
        bias: as nn.Linear's.
        device: as nn.Linear's.
        dtype: float16 or bfloat16 (or any dtype, used under autocast to one of them).
        activation: "relu", "gelu", "gelu_tanh", "silu" or None.

    The forward takes (*, in_features) in the parameters' dtype and returns (*, out_features).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> layer = kp_precision.FusedLinearActivation(64, 32, dtype=torch.bfloat16, activation="silu")
        >>> layer(torch.randn(4, 64, dtype=torch.bfloat16)).shape
        torch.Size([4, 32])
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, activation="gelu"):
        by_name("FusedLinearActivation", activation, (None, *ACTIVATIONS))  # checked here, not at the first call
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = activation

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str = "gelu") -> "FusedLinearActivation":
        new = cls(
            linear.in_features, linear.out_features, linear.bias is not None, device="meta", activation=activation
        )
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x):
        cast = autocast_dtype(x)
        if cast is None:
            return linear_activation(x, self.weight, self.bias, self.activation)
        # under autocast, as nn.Linear: input, weight and bias in the autocast dtype
        bias = None if self.bias is None else self.bias.to(cast)
        return linear_activation(x.to(cast), self.weight.to(cast), bias, self.activation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation}"
