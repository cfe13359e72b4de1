"""Float8 inference: a linear with its weight stored in float8 and activations cast per call.

    y = act(scaled_mm(cast(x), w_fp8.T) * scales + bias)

The weight is cast once (when converted or loaded) and kept as float8 data + float32 scale: half the memory of
bf16. Each call casts the activations dynamically with the same recipe's activation granularity (tensorwise,
per row, 1 x 128 blocks) and runs one float8 matmul with bias and the optional activation in its epilogue.
"""

import torch
from torch import nn

from kp_precision.functional import scaled_mm
from kp_precision.ops.scaled_mm import ACTIVATIONS
from kp_precision.swap import swap_linears
from kp_precision.training import RECIPES, Float8Config, _cast, _scale_t, check_input

E4M3 = torch.float8_e4m3fn


def _weight_cast(w, config):
    """(float8 data (N, K), the scale as scaled_mm's scale_b for data.t())."""
    q = _cast(w, E4M3, config, weight=True)
    return q.data, _scale_t(q.scale)


class Float8InferenceLinear(nn.Module):
    """A linear layer for inference with a float8 (e4m3fn) weight and dynamically cast activations.

    State: `weight` (float8, (out_features, in_features)), `weight_scale` (float32, scale_b of scaled_mm for
    weight.t()) and `bias` (the original dtype). An nn.Linear's state_dict loads into it (the weight is cast on
    load); `from_linear` converts one layer. `activation` ('relu', 'gelu', 'gelu_tanh', 'silu') is fused into the
    matmul's epilogue."""

    def __init__(
        self, in_features, out_features, bias=True, device=None, dtype=None, *, recipe="rowwise", activation=None
    ):
        super().__init__()
        if recipe not in RECIPES:
            raise ValueError(f"Float8InferenceLinear: recipe must be one of {RECIPES}, got {recipe!r}")
        if in_features % 16 or out_features % 16:
            raise ValueError(
                "Float8InferenceLinear: in_features and out_features must be multiples of 16, got "
                f"{in_features}, {out_features}"
            )
        if activation is not None and activation not in ACTIVATIONS[1:]:
            raise ValueError(
                f"Float8InferenceLinear: activation must be None or one of {ACTIVATIONS[1:]}, got {activation!r}"
            )
        self.in_features, self.out_features, self.recipe, self.activation = (
            in_features,
            out_features,
            recipe,
            activation,
        )
        self._cast_config = Float8Config(recipe, power_of_2=False)  # the training recipe's casts, exact scales
        data, scale = _weight_cast(torch.zeros(out_features, in_features, device=device), self._cast_config)
        self.register_buffer("weight", data)
        self.register_buffer("weight_scale", scale.contiguous())
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False) if bias else None
        )
        self._register_load_state_dict_pre_hook(self._cast_float_weight)

    def set_weight(self, weight: torch.Tensor) -> None:
        """Cast a floating-point (out_features, in_features) weight into this layer."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            expected = (self.out_features, self.in_features)
            raise ValueError(f"Float8InferenceLinear: weight must have shape {expected}, got {tuple(weight.shape)}")
        data, scale = _weight_cast(weight.detach().to(self.weight.device), self._cast_config)
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
            data, scale = _weight_cast(w.to(self.weight.device), self._cast_config)
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
        x2 = x.reshape(-1, self.in_features)
        qx = _cast(x2, E4M3, self._cast_config)
        bias = self.bias
        if bias is not None and bias.dtype not in (torch.float32, x.dtype):
            bias = bias.float()
        y = scaled_mm(
            qx.data,
            self.weight.t(),
            qx.scale,
            self.weight_scale,
            bias=bias,
            activation=self.activation,
            out_dtype=x.dtype,
            use_fast_accum=True,  # as torchao's float8 inference: the tensor cores' own accumulator
        )
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        act = f", activation={self.activation}" if self.activation else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe}{act}"


def convert_to_float8_inference(
    model: nn.Module, *, module_filter_fn=None, recipe="rowwise", verbose=False
) -> nn.Module:
    """Swap model's nn.Linear layers for Float8InferenceLinear in place (weights cast once) and return model.

    `module_filter_fn(module, fqn) -> bool` picks layers (all by default); layers whose in_features or
    out_features is not a multiple of 16 stay nn.Linear (one warning names them); `verbose=True` prints each
    converted layer."""
    if recipe not in RECIPES:
        raise ValueError(f"convert_to_float8_inference: recipe must be one of {RECIPES}, got {recipe!r}")
    make = lambda linear: Float8InferenceLinear.from_linear(linear, recipe=recipe)  # noqa: E731
    return swap_linears(model, "convert_to_float8_inference", module_filter_fn, make, verbose, recipe)
