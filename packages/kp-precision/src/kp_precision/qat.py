"""Quantisation-aware training's layers: QATLinear (fake-quantised weights, and optionally activations, with
straight-through gradients) and QuantizedLinear (integer or float8 weights stored with their scales).
kp_precision.convert's prepare_qat swaps a model's nn.Linear for QATLinear, and its convert swaps QATLinear for
QuantizedLinear. A converted layer computes exactly what the prepared one did: its weights dequantise to the very
values the QAT layer trained with, and its activations go through the same fake quant.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kp_precision.functional import QAT_FORMATS, fake_quantize, quantize
from kp_precision.ops.fake_quantize import int_quantize
from kp_precision.shared import check_input

DEFAULT_GROUP = {"int8": None, "int4": 32, "fp8": None}


def check_formats(caller, weight, activation, group_size, weight_arg="weight"):
    if weight not in QAT_FORMATS:
        raise ValueError(f"{caller}: {weight_arg} must be one of {tuple(QAT_FORMATS)}, got {weight!r}")
    if activation not in (None, "int8", "fp8"):
        raise ValueError(f"{caller}: activation must be None, 'int8' or 'fp8', got {activation!r}")
    if weight == "fp8" and group_size is not None:
        raise ValueError(f"{caller}: group_size is for integer weights; fp8 weights scale per row")
    if group_size is not None and (group_size.__class__ is not int or group_size < 1):
        raise ValueError(f"{caller}: group_size must be None or an int >= 1, got {group_size!r}")


class QATLinear(nn.Linear):
    """nn.Linear that trains through fake quantisation: the weight as `weight_dtype` ('int8', 'int4' per group
    of `group_size`, 'fp8' per row) and, with `activation` ('int8' or 'fp8'), the input per row (per token).
    Parameters and state_dict are nn.Linear's.

    Args:
        in_features: as nn.Linear's; a multiple of group_size.
        out_features: as nn.Linear's.
        bias: as nn.Linear's.
        device: as nn.Linear's.
        dtype: as nn.Linear's.
        weight_dtype: "int8", "int4" or "fp8".
        group_size: the weight's scale groups along in_features (None: per row); integer formats only.
        activation: None, "int8" or "fp8".

    The forward takes (*, in_features) in float16, bfloat16 or float32 and returns (*, out_features) in its dtype.
    `QATLinear.from_linear(linear, **kwargs)` shares a layer's parameters.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> layer = kp_precision.QATLinear(64, 32, weight_dtype="int4", group_size=32, activation="int8")
        >>> layer(torch.randn(4, 64)).shape
        torch.Size([4, 32])
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, weight_dtype="int4",
                 group_size=32, activation=None):  # fmt: skip
        super().__init__(in_features, out_features, bias, device, dtype)
        check_formats("QATLinear", weight_dtype, activation, group_size, "weight_dtype")
        if group_size and in_features % group_size:
            raise ValueError(f"QATLinear: group_size ({group_size}) must divide in_features ({in_features})")
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
    weight to the input's dtype (what QATLinear's fake quant gave) and fake-quantises activations as it did.

    Args:
        qat: the trained QATLinear.

    The forward takes (*, in_features) in float16, bfloat16 or float32 and returns (*, out_features) in its dtype.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> trained = kp_precision.QATLinear(64, 32)  # int4 weights, groups of 32
        >>> layer = kp_precision.QuantizedLinear(trained)
        >>> layer.qweight.dtype, layer.qweight.shape, layer.weight_scale.shape
        (torch.uint8, torch.Size([32, 32]), torch.Size([32, 2]))
        >>> x = torch.randn(4, 64)
        >>> torch.allclose(layer(x), trained(x))
        True
    """

    def __init__(self, qat: QATLinear):
        if not isinstance(qat, QATLinear):
            raise TypeError(f"QuantizedLinear: qat must be a QATLinear (after training), got {type(qat).__name__}")
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
