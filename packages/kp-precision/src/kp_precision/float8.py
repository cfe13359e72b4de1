"""Float8Tensor: float8 data with the float32 scales that dequantise it, as a NamedTuple, so torch.compile traces
it like any tuple of tensors (no tensor subclass, no graph break) and it crosses custom ops and pytrees as is."""

from typing import NamedTuple

import torch

from kp_precision.ops.quantize import DEQUANTIZE

GRANULARITIES = {(0, 0): "tensorwise", (1, 0): "rowwise"}


class Float8Tensor(NamedTuple):
    """`data` (float8, the input's shape), `scale` (float32: x ~ data * scale over each block), `amax` (float32,
    the scale's shape: max |x| per block, for amax histories) and `block` = (block_m, block_k) over the (M, K)
    view of the input (K the last dim), 0 meaning the whole dimension: (0, 0) tensorwise, (1, 0) rowwise,
    (1, 128) / (128, 128) blockwise."""

    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor
    block: tuple[int, int]

    @property
    def granularity(self) -> str:
        return GRANULARITIES.get(tuple(self.block), "blockwise")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """data * scale as `dtype` (one rounding, from float32)."""
        return DEQUANTIZE(self.data, self.scale, self.block[0], self.block[1], dtype)
