"""What kp-precision's linear layers share, below all of them: casts and matmuls without user-facing checks, the
float8 alignment, the input check.

kp_precision.functional checks a user's arguments, then calls the declared ops (kp_precision.ops). A layer's
arguments are its own: its input (and weight dtype) is checked once per call, its shapes and recipe when it is
built, and every tensor it casts or multiplies inside a step is one it made. So the layers (training and
inference, through kp_precision.recipes) call the ops through this module, which checks nothing: the casts and
matmuls inside a step are not checked again as user input.
"""

import torch
from torch import nn

from kp_precision.float8 import Float8Tensor
from kp_precision.ops.quantize import QUANTIZE, TRANSPOSE
from kp_precision.ops.quantize import reference as reference_cast
from kp_precision.ops.scaled_mm import SCALED_MM

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
# K and N of a float8 matmul are multiples of this (float8 tensor cores, as torch._scaled_mm requires); M too
# where it is the contraction (a linear's weight gradient), so a layer's in_features and out_features are.
ALIGN = 16
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype torch.autocast gives a linear's operands on x's device here (None outside autocast): kp's layers
    run their ops outside autocast's reach, so they cast as nn.Linear is cast."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) and x.is_floating_point() else None


def check_input(layer: str, x, in_features: int) -> None:
    """A linear's input: a float16 / bfloat16 / float32 tensor whose last dim is in_features."""
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{layer}: input must be a float16, bfloat16 or float32 tensor, got {got}")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"{layer}: input's last dim must be in_features = {in_features}, got shape {tuple(x.shape)}")


def check_weight(layer: str, weight: torch.Tensor) -> None:
    """A weight the casts take (float16, bfloat16 or float32): they check nothing themselves."""
    if weight.dtype not in INPUT_DTYPES:
        raise TypeError(f"{layer}: weight must be float16, bfloat16 or float32, got {weight.dtype}")


def check_aligned(layer: str, in_features: int, out_features: int) -> None:
    """A float8 layer's dimensions: multiples of ALIGN."""
    if in_features % ALIGN or out_features % ALIGN:
        raise ValueError(
            f"{layer}: in_features and out_features must be multiples of {ALIGN}, got {in_features}, {out_features}"
        )


def unaligned(linear: nn.Linear) -> str | None:
    """Why a float8 matmul cannot take this layer (None: it can)."""
    if linear.in_features % ALIGN or linear.out_features % ALIGN:
        return f"float8 matmuls need in_features and out_features that are multiples of {ALIGN}"
    return None


def cast(t: torch.Tensor, fp8: torch.dtype, block: tuple[int, int], power_of_2: bool, scale=None) -> Float8Tensor:
    """kp_precision.quantize(t, fp8, ...) for a (block_m, block_k) block ((0, 0) tensorwise, (1, 0) rowwise) and,
    tensorwise, a given scale.

    Under torch.compile a 2-D tensorwise cast is the op's PyTorch maths (the same bits as its kernels, tested),
    which inductor fuses into the kernels that make and read t: kp's amax and cast kernels are opaque to it, and
    cost the float8 demo model 1.4 ms per step more than inductor's fused casts (H100, benchmarks/results)."""
    if block == (0, 0) and t.dim() == 2 and t.numel() and torch.compiler.is_compiling():
        data, s, amax = reference_cast(t, scale, fp8, 0, 0, power_of_2)
        return Float8Tensor(data, s.reshape(()), amax.reshape(()), block)
    data, s, amax = QUANTIZE(t, scale, fp8, block[0], block[1], power_of_2)
    return Float8Tensor(data, s, amax, block)


def matmul(a, b, scale_a, scale_b, out_dtype, *, bias=None, activation="none", fast_accum=False) -> torch.Tensor:
    """kp_precision.scaled_mm(a, b, scale_a, scale_b, ...); activation is an op name ('none' for None)."""
    return SCALED_MM(a, b, scale_a, scale_b, bias, activation, out_dtype, fast_accum)


def transpose(t: torch.Tensor) -> torch.Tensor:
    """t.t().contiguous() in one tiled pass (kp::transpose); under torch.compile inductor's own copy, which it
    fuses with the kernel that made t."""
    return t.t().contiguous() if torch.compiler.is_compiling() else TRANSPOSE(t)


def column_major(data: torch.Tensor) -> torch.Tensor:
    """float8 (R, C) row-major data as the same matrix laid out column-major (one tiled transposing copy)."""
    return transpose(data).t()


def scale_t(scale: torch.Tensor) -> torch.Tensor:
    """A weight's scale as scaled_mm's scale_b for weight.t()."""
    return scale.t() if scale.dim() else scale
