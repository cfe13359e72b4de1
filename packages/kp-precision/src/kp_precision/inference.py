"""Float8 inference: Float8InferenceLinear, a linear with its weight stored in float8 and activations cast per
call (kp_precision.convert.convert_to_float8_inference swaps a model's layers for it).

    y = act(scaled_mm(cast(x), w_fp8.T) * scales + bias)

The weight is cast once (when converted or loaded) and kept as float8 data + float32 scale: half the memory of
bf16. Each call casts the activations dynamically with the same recipe's activation granularity (tensorwise,
per row, 1 x 128 blocks: the recipe object's casts, kp_precision.recipes) and runs one float8 matmul with bias
and the optional activation in its epilogue. Inside a call nothing but the input is checked (kp_precision.shared).
"""

import torch
from torch import nn

from kp_core.activation import by_name
from kp_precision.ops.scaled_mm import ACTIVATIONS
from kp_precision.recipes import RECIPES, Float8Config, recipe_for
from kp_precision.shared import E4M3, autocast_dtype, check_aligned, check_input, check_weight, matmul, scale_t


class Float8InferenceLinear(nn.Module):
    """A linear layer for inference with a float8 (e4m3fn) weight and dynamically cast activations.

    State: `weight` (float8, (out_features, in_features)), `weight_scale` (float32, scale_b of scaled_mm for
    weight.t()) and `bias` (the original dtype). An nn.Linear's state_dict loads into it (the weight is cast on
    load); `from_linear` converts one layer. `activation` ('relu', 'gelu', 'gelu_tanh', 'silu') is fused into the
    matmul's epilogue.

    Args:
        in_features: a multiple of 16.
        out_features: a multiple of 16.
        bias: whether it has a bias (frozen).
        device: where the weight and bias live.
        dtype: the bias's dtype.
        recipe: the activations' cast: "tensorwise", "rowwise" or "blockwise" (and the weight's scales to match).
        activation: None, "relu", "gelu", "gelu_tanh" or "silu".

    The forward takes (*, in_features) in float16, bfloat16 or float32 and returns (*, out_features) in its dtype.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> layer = kp_precision.Float8InferenceLinear.from_linear(torch.nn.Linear(64, 32), activation="relu")
        >>> layer.weight.dtype, layer.weight_scale.shape
        (torch.float8_e4m3fn, torch.Size([1, 32]))
        >>> layer(torch.randn(4, 64, dtype=torch.bfloat16)).dtype
        torch.bfloat16
    """

    def __init__(
        self, in_features, out_features, bias=True, device=None, dtype=None, *, recipe="rowwise", activation=None
    ):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"Float8InferenceLinear: recipe must be one of {RECIPES}, got {recipe!r}")
        check_aligned("Float8InferenceLinear", in_features, out_features)
        # the op's name of the activation ('none' for None): 'none' itself is not a layer's name for it
        self._act = by_name("Float8InferenceLinear", activation, (None, *ACTIVATIONS[1:])).name.lower()
        self.in_features, self.out_features, self.recipe, self.activation = (
            in_features,
            out_features,
            recipe,
            activation,
        )
        self._recipe = recipe_for(Float8Config(recipe, power_of_2=False))  # the training recipe's casts, exact scales
        data, scale = self._weight_cast(torch.zeros(out_features, in_features, device=device))
        self.register_buffer("weight", data)
        self.register_buffer("weight_scale", scale.contiguous())
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )
        self._register_load_state_dict_pre_hook(self._cast_float_weight)

    def _weight_cast(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8 data (N, K), the scale as scaled_mm's scale_b for data.t())."""
        check_weight("Float8InferenceLinear", w)
        q = self._recipe.cast(w, E4M3, weight=True)
        return q.data, scale_t(q.scale)

    def set_weight(self, weight: torch.Tensor) -> None:
        """Cast a floating-point (out_features, in_features) weight into this layer."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            expected = (self.out_features, self.in_features)
            raise ValueError(f"Float8InferenceLinear: weight must have shape {expected}, got {tuple(weight.shape)}")
        data, scale = self._weight_cast(weight.detach().to(self.weight.device))
        self.weight = data
        self.weight_scale = scale.contiguous()

    def _cast_float_weight(self, state_dict, prefix, *args, **kwargs):
        """An nn.Linear's floating-point weight (no weight_scale beside it) is cast on load."""
        key = prefix + "weight"
        w = state_dict.get(key)
        if (
            w is not None
            and w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2)
            and prefix + "weight_scale" not in state_dict
        ):
            data, scale = self._weight_cast(w.to(self.weight.device))
            state_dict[key], state_dict[prefix + "weight_scale"] = data, scale.contiguous()

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, recipe="rowwise", activation=None) -> "Float8InferenceLinear":
        new = cls(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            device=linear.weight.device,
            dtype=linear.weight.dtype,
            recipe=recipe,
            activation=activation,
        )
        new.set_weight(linear.weight)
        if linear.bias is not None:
            new.bias.data.copy_(linear.bias.detach())
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input("Float8InferenceLinear", x, self.in_features)
        x = x if (cast := autocast_dtype(x)) is None else x.to(cast)  # under autocast, as nn.Linear
        x2 = x.reshape(-1, self.in_features)
        qx = self._recipe.attached(x) or self._recipe.cast(x2, E4M3)  # a float8 copy made with x, or a cast
        bias = self.bias
        if bias is not None and bias.dtype not in (torch.float32, x.dtype):
            bias = bias.float()
        y = matmul(
            qx.data,
            self.weight.t(),
            qx.scale,
            self.weight_scale,
            x.dtype,
            bias=bias,
            activation=self._act,
            fast_accum=True,  # as torchao's float8 inference: the tensor cores' own accumulator
        )
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}{act}"
