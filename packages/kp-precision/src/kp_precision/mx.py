"""MXTensor: MX-format data (OCP Microscaling v1.0) with its E8M0 block scales, as a NamedTuple (torch.compile
traces it like any tuple of tensors)."""

from typing import NamedTuple

import torch

from kp_precision.ops.mx import MX_DEQUANTIZE


class MXTensor(NamedTuple):
    """`data`: the elements, (..., K) float8 for 'fp8_e4m3' / 'fp8_e5m2', or (..., K/2) uint8 for 'fp4_e2m1'
    (two per byte, the first in the low nibble); `scale`: (..., K/32) uint8 E8M0 bytes (2**(s - 127), 255 NaN);
    `elem`: the element format's name.

    What kp_precision.mx_quantize returns; `shape` is the quantised input's (..., K), `dequantize(dtype)` gives
    the values back (kp_precision.mx_dequantize with its checks).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> m = kp_precision.mx_quantize(torch.randn(8, 64), "fp8_e5m2")
        >>> m.data.dtype, m.scale.shape, m.elem, m.shape
        (torch.float8_e5m2, torch.Size([8, 2]), 'fp8_e5m2', torch.Size([8, 64]))
        >>> m.dequantize(torch.bfloat16).shape
        torch.Size([8, 64])
    """

    data: torch.Tensor
    scale: torch.Tensor
    elem: str

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.scale.shape[:-1], self.scale.shape[-1] * 32))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values as `dtype` (float16, bfloat16 or float32), shape `self.shape`."""
        return MX_DEQUANTIZE(self.data, self.scale, self.elem, dtype)
