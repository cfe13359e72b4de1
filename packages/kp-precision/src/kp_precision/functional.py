"""kp-precision's public functions: argument checks, then the declared ops (kp_precision.ops.*)."""

import torch

import kp_core
from kp_precision.float8 import Float8Tensor
from kp_precision.ops.quantize import DTYPES, FP8_DTYPES, QUANTIZE, scale_shape

_NAME = "kp_precision.quantize"
_BLOCKS = {"tensorwise": (0, 0), "rowwise": (1, 0)}


def _block(granularity: str, block: tuple[int, int] | None, x: torch.Tensor) -> tuple[int, int]:
    if granularity in _BLOCKS:
        if block is not None:
            raise ValueError(f"{_NAME}: block is for granularity='blockwise', got block={block!r} with {granularity!r}")
        return _BLOCKS[granularity]
    if granularity != "blockwise":
        raise ValueError(f"{_NAME}: granularity must be 'tensorwise', 'rowwise' or 'blockwise', got {granularity!r}")
    block = (1, 128) if block is None else block
    ok = (
        isinstance(block, (tuple, list))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 and b & (b - 1) == 0 for b in block)
    )
    if not ok or block[1] < 16 or block[0] * block[1] > 16384:
        raise ValueError(
            f"{_NAME}: block must be (block_m, block_k), powers of two with block_k >= 16 and "
            f"block_m * block_k <= 16384 (e.g. (1, 128) or (128, 128)), got {block!r}"
        )
    if block[0] > 1 and x.dim() != 2:
        raise ValueError(f"{_NAME}: blocks of several rows {tuple(block)} need a 2-D input, got shape {tuple(x.shape)}")
    return tuple(block)


def quantize(
    input: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    granularity: str = "tensorwise",
    block: tuple[int, int] | None = None,
    scale: torch.Tensor | None = None,
    power_of_2: bool = False,
) -> Float8Tensor:
    """Quantise `input` (float16, bfloat16 or float32) to float8 with scales per `granularity`:
    'tensorwise' (one scale), 'rowwise' (one per row of the last dim) or 'blockwise' (`block` = (block_m,
    block_k) over the (rows, last dim) view: (1, 128) for activations, the default, or (128, 128) for weights).

    Scales come from the amax of each block (max |x| -> the format's largest value), as float32, floored to a
    power of two with `power_of_2=True`. `scale` (tensorwise only) is a given dequantisation scale, as in
    delayed scaling: the data is x / scale, saturated, and the returned amax is the input's. Values beyond the
    format's range saturate, NaN stays NaN, rounding is to nearest-even: bit for bit torch's own cast of the
    scaled values. Returns a Float8Tensor (data, scale, amax, block)."""
    kp_core.check_tensor(_NAME, "input", input, dtypes=DTYPES, min_ndim=1)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{_NAME}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    block_m, block_k = _block(granularity, block, input)
    if scale is not None:
        if granularity != "tensorwise":
            raise ValueError(f"{_NAME}: a given scale is for granularity='tensorwise', got {granularity!r}")
        kp_core.check_tensor(_NAME, "scale", scale, dtypes=(torch.float32,), device=input.device)
        if scale.numel() != 1:
            raise ValueError(f"{_NAME}: scale must hold one value, got shape {tuple(scale.shape)}")
    data, s, amax = QUANTIZE(input, scale, dtype, block_m, block_k, bool(power_of_2))
    return Float8Tensor(data, s, amax, (block_m, block_k))


def dequantize(tensor: Float8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale over each block, rounded once to `dtype`."""
    if not isinstance(tensor, Float8Tensor):
        raise TypeError(f"kp_precision.dequantize: tensor must be a Float8Tensor, got {type(tensor).__name__}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"kp_precision.dequantize: dtype must be float16, bfloat16 or float32, got {dtype}")
    expected = scale_shape(tuple(tensor.data.shape), *tensor.block)
    if tensor.data.dtype not in FP8_DTYPES or tuple(tensor.scale.shape) != expected:
        raise ValueError(
            f"kp_precision.dequantize: expected float8 data and a scale of shape {expected}, got "
            f"{tensor.data.dtype} and {tuple(tensor.scale.shape)}"
        )
    return tensor.dequantize(dtype)
