"""Quantisation-aware training: prepare_qat swaps nn.Linear for QATLinear (fake-quantised weights, and optionally
activations, with straight-through gradients); convert swaps QATLinear for QuantizedLinear (integer or float8
weights stored with their scales). A converted layer computes exactly what the prepared one did: its weights
dequantise to the very values the QAT layer trained with, and its activations go through the same fake quant.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kp_precision.functional import QAT_FORMATS, fake_quantize, quantize
from kp_precision.ops.fake_quantize import int_quantize
from kp_precision.swap import swap_linears
from kp_precision.training import check_input

DEFAULT_GROUP = {"int8": None, "int4": 32, "fp8": None}


def _check_formats(caller, weight, activation, group_size):
    if weight not in QAT_FORMATS:
        raise ValueError(f"{caller}: weight must be one of {tuple(QAT_FORMATS)}, got {weight!r}")
    if activation not in (None, "int8", "fp8"):
        raise ValueError(f"{caller}: activation must be None, 'int8' or 'fp8', got {activation!r}")
    if weight == "fp8" and group_size is not None:
        raise ValueError(f"{caller}: group_size is for integer weights; fp8 weights scale per row")


class QATLinear(nn.Linear):
    """nn.Linear that trains through fake quantisation: the weight as `weight_dtype` ('int8', 'int4' per group
    of `group_size`, 'fp8' per row) and, with `activation` ('int8' or 'fp8'), the input per row (per token).
    Parameters and state_dict are nn.Linear's."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, weight_dtype="int4",
                 group_size=32, activation=None):  # fmt: skip
        super().__init__(in_features, out_features, bias, device, dtype)
        _check_formats("QATLinear", weight_dtype, activation, group_size)
        self.weight_dtype, self.group_size, self.activation = weight_dtype, group_size, activation

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "QATLinear":
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, **kw)
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input("QATLinear", x, self.in_features)
        if self.activation is not None:
            x = fake_quantize(x, self.activation)
        w = fake_quantize(self.weight, self.weight_dtype, group_size=self.group_size)
        return F.linear(x, w.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        act = f", activation={self.activation}" if self.activation else ""
        return f"{super().extra_repr()}, weight_dtype={self.weight_dtype}{group}{act}"


class QuantizedLinear(nn.Module):
    """A converted QATLinear: `qweight` (int8 (N, K); int4 two per uint8 (N, K/2), the first in the low nibble;
    or float8 e4m3fn (N, K)), `weight_scale` (float32, one per group or row), `bias`. The forward dequantises the
    weight to the input's dtype (what QATLinear's fake quant gave) and fake-quantises activations as it did."""

    def __init__(self, qat: QATLinear):
        super().__init__()
        self.in_features, self.out_features = qat.in_features, qat.out_features
        self.weight_dtype, self.group_size, self.activation = qat.weight_dtype, qat.group_size, qat.activation
        w = qat.weight.detach()
        if self.weight_dtype == "fp8":
            t = quantize(w, granularity="rowwise")
            q, scale = t.data, t.scale
        else:
            q, scale = int_quantize(w, QAT_FORMATS[self.weight_dtype], self.group_size or 0)
            q = q.to(torch.int8)
            if self.weight_dtype == "int4":
                nib = q.to(torch.uint8) & 0xF
                q = nib[:, 0::2] | (nib[:, 1::2] << 4)
        self.register_buffer("qweight", q)
        self.register_buffer("weight_scale", scale)
        self.bias = None if qat.bias is None else nn.Parameter(qat.bias.detach().clone(), requires_grad=False)

    def dequantized_weight(self) -> torch.Tensor:
        """The weight as float32: q * scale per group."""
        q = self.qweight
        if self.weight_dtype == "int4":
            nib = torch.stack([q & 0xF, q >> 4], dim=-1).flatten(-2).to(torch.int8)
            q = torch.where(nib >= 8, nib - 16, nib)
        q = q.float()
        g = self.weight_scale.shape[-1]
        return (q.view(q.shape[0], g, -1) * self.weight_scale.unsqueeze(-1)).view(q.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input("QuantizedLinear", x, self.in_features)
        if self.activation is not None:
            x = fake_quantize(x, self.activation)
        w = self.dequantized_weight().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        act = f", activation={self.activation}" if self.activation else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.weight_dtype}{group}{act}"


def prepare_qat(model: nn.Module, *, weight="int4", group_size="default", activation=None, module_filter_fn=None,
                verbose=False) -> nn.Module:  # fmt: skip
    """Swap model's nn.Linear layers for QATLinear in place (sharing their parameters) and return model.
    `weight`: 'int4' (groups of 32 by default), 'int8' (per row by default) or 'fp8' (per row); `group_size`:
    a power of two dividing in_features, or None for per-row scales; `activation`: None, 'int8' or 'fp8'."""
    group = DEFAULT_GROUP.get(weight) if group_size == "default" else group_size
    _check_formats("prepare_qat", weight, activation, group)
    make = lambda lin: QATLinear.from_linear(lin, weight_dtype=weight, group_size=group, activation=activation)  # noqa: E731

    def unfit(lin):
        if group and lin.in_features % group:
            return f"in_features is not a multiple of group_size {group}"
        return None

    label = f"{weight}, activation {activation}"
    return swap_linears(model, "prepare_qat", module_filter_fn, make, verbose, label, unfit)


def convert(model: nn.Module, *, verbose=False) -> nn.Module:
    """Swap model's QATLinear layers for QuantizedLinear in place and return model (the weights quantised once,
    to exactly the values the QAT model trained with)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, got {type(model).__name__}")
    converted = []
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QATLinear):
                setattr(module, name, QuantizedLinear(child))
                converted.append(f"{fqn}.{name}" if fqn else name)
    if verbose:
        print(f"convert: {len(converted)} layers")
        for path in converted:
            print(f"  {path}")
    return model
