"""Float8Tensor: float8 data with the float32 scales that dequantise it, as a NamedTuple, so torch.compile traces
it like any tuple of tensors (no tensor subclass, no graph break) and it crosses custom ops and pytrees as is.

attach_float8(x, cast) hands a float8 copy of an activation, made where x was made (kp_norms.norm_float8 casts a
norm's output in the norm's kernel), to the float8 layers that read x next: they take it instead of casting x again.
"""

from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kp_precision.ops.quantize import DEQUANTIZE

GRANULARITIES = {(0, 0): "tensorwise", (1, 0): "rowwise"}


class Float8Tensor(NamedTuple):
    """`data` (float8, the input's shape), `scale` (float32: x ~ data * scale over each block), `amax` (float32,
    the scale's shape: max |x| per block, for amax histories) and `block` = (block_m, block_k) over the (M, K)
    view of the input (K the last dim), 0 meaning the whole dimension: (0, 0) tensorwise, (1, 0) rowwise,
    (1, 128) / (128, 128) blockwise.

    What kp_precision.quantize returns; `granularity`, `shape` and `dtype` are data's, `dequantize(dtype)` gives
    data * scale (kp_precision.dequantize with its checks).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> t = kp_precision.quantize(torch.randn(32, 64), granularity="rowwise")
        >>> t.block, t.granularity, t.shape, t.dtype
        ((1, 0), 'rowwise', torch.Size([32, 64]), torch.float8_e4m3fn)
        >>> data, scale, amax, block = t  # a NamedTuple
        >>> t.dequantize(torch.bfloat16).dtype
        torch.bfloat16
    """

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


# x -> [its float8 copy, power_of_2, x._version when attached, takes left (None: any)]: entries go when x does.
_ATTACHED = WeakIdKeyDictionary()


def attach_float8(x: torch.Tensor, cast: Float8Tensor, *, power_of_2: bool = False, uses: int | None = None):
    """Record `cast` (tensorwise or rowwise, with scales floored to powers of two when power_of_2) as x's float8
    copy and return x. A Float8Linear or Float8InferenceLinear whose recipe casts its input the same way (the
    granularity, float8_e4m3fn, power_of_2; dynamic scaling) then uses it instead of casting x. It must be what
    kp_precision.quantize(x, ...) gives, bit for bit: the layer does not check the values. The record lapses when x
    is modified in place or freed, or after `uses` layers took it (the copy is then freed with the last of them,
    not kept as long as x is: a training step keeps x for the backward); eager mode only (under torch.compile the
    layers cast, and inductor fuses the cast).

    Args:
        x: the activation, any shape (*, K).
        cast: a tensorwise or rowwise Float8Tensor whose data has x's shape.
        power_of_2: whether cast's scales were floored to powers of two.
        uses: how many layers may take it (None: any number while x lives unchanged).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> layer = kp_precision.Float8Linear(64, 32, config=kp_precision.Float8Config(recipe="rowwise"))
        >>> x = torch.randn(16, 64)
        >>> cast = kp_precision.quantize(x, granularity="rowwise", power_of_2=True)  # the rowwise recipe's cast
        >>> x = kp_precision.attach_float8(x, cast, power_of_2=True, uses=1)
        >>> layer(x).shape  # the layer takes the copy instead of casting x
        torch.Size([16, 32])
    """
    name = "kp_precision.attach_float8"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a tensor, got {type(x).__name__}")
    if not isinstance(cast, Float8Tensor) or tuple(cast.block) not in GRANULARITIES:
        raise TypeError(f"{name}: cast must be a tensorwise or rowwise Float8Tensor, got {cast!r:.80}")
    if cast.data.shape != x.shape:
        raise ValueError(f"{name}: cast's data must have x's shape {tuple(x.shape)}, got {tuple(cast.data.shape)}")
    if uses is not None and (not isinstance(uses, int) or isinstance(uses, bool) or uses < 1):
        raise ValueError(f"{name}: uses must be a positive int or None, got {uses!r}")
    _ATTACHED[x] = [cast, bool(power_of_2), x._version, uses]
    return x


def attached_float8(x: torch.Tensor, block: tuple, dtype: torch.dtype, power_of_2: bool) -> Float8Tensor | None:
    """x's attached float8 copy as (M, K) rows (scale (M, 1) rowwise) if it was cast as asked, else None; taking
    it counts as one of its uses."""
    # is_compiling first: dynamo refuses to trace the weak dictionary's len (a graph break, an error with
    # fullgraph=True)
    if torch.compiler.is_compiling() or not _ATTACHED:  # on every float8 layer's call: nothing attached, no lookup
        return None
    entry = _ATTACHED.get(x)
    if entry is None:
        return None
    cast, pow2, version, uses = entry
    if x._version != version or tuple(cast.block) != block or cast.data.dtype != dtype or pow2 != power_of_2:
        return None
    if uses is not None:
        entry[3] = uses - 1
        if uses == 1:
            del _ATTACHED[x]
    k = x.shape[-1]
    scale = cast.scale if block == (0, 0) else cast.scale.reshape(-1, 1)
    amax = cast.amax if block == (0, 0) else cast.amax.reshape(-1, 1)
    return Float8Tensor(cast.data.reshape(-1, k), scale, amax, cast.block)
