"""kp-precision: float8 and MX quantisation, scaled matmul, float8 training and inference linears, QAT,
fused linear + activation in Triton.

The public API is this module's __all__. The modules, each importing only from those below it:

    public      functional      functions on tensors: user-facing checks, then the ops
                float8, mx      Float8Tensor, MXTensor (what quantize / mx_quantize return), attach_float8
    layers      training        Float8Linear: float8 forward and backward, per recipe
                inference       Float8InferenceLinear
                qat             QATLinear, QuantizedLinear
                fused           FusedLinearActivation
                fsdp            FSDP2's float8 all-gather of a Float8Linear's weight
    model       convert         convert_to_float8_training / _inference, prepare_qat, convert (swap nn.Linear)
                auto            auto_filter: the layers measured faster in float8
    shared      recipes         Float8Config, one object per recipe: its casts, saved tensors and backward
                shared          casts and matmuls without user-facing checks, ALIGN (16), input checks
    ops/        <op>.py         launchers, reference path, the op's declaration (kp_core.op)
                <op>_kernels.py Triton kernels; kernel_helpers.py: Triton helpers they share
"""

from kp_precision.auto import auto_filter
from kp_precision.convert import convert, convert_to_float8_inference, convert_to_float8_training, prepare_qat
from kp_precision.float8 import Float8Tensor, attach_float8
from kp_precision.fsdp import Float8AllGatherWeight, Float8GatheredWeight, precompute_float8_scales
from kp_precision.functional import (
    dequantize,
    fake_quantize,
    linear_activation,
    mx_dequantize,
    mx_matmul,
    mx_quantize,
    quantize,
    scaled_mm,
)
from kp_precision.fused import FusedLinearActivation
from kp_precision.inference import Float8InferenceLinear
from kp_precision.mx import MXTensor
from kp_precision.qat import QATLinear, QuantizedLinear
from kp_precision.recipes import Float8Config
from kp_precision.training import Float8Linear

__version__ = "0.2.0"

__all__ = [
    "Float8AllGatherWeight",
    "Float8Config",
    "Float8GatheredWeight",
    "Float8InferenceLinear",
    "Float8Linear",
    "Float8Tensor",
    "FusedLinearActivation",
    "MXTensor",
    "QATLinear",
    "QuantizedLinear",
    "attach_float8",
    "auto_filter",
    "convert",
    "convert_to_float8_inference",
    "convert_to_float8_training",
    "dequantize",
    "fake_quantize",
    "linear_activation",
    "mx_dequantize",
    "mx_matmul",
    "mx_quantize",
    "precompute_float8_scales",
    "prepare_qat",
    "quantize",
    "scaled_mm",
]
