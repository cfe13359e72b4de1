"""kp-precision: float8 and MX quantisation, scaled matmul, float8 training and inference linears, QAT,
fused linear + activation in Triton."""

from kp_precision.auto import auto_filter
from kp_precision.float8 import Float8Tensor
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
from kp_precision.inference import Float8InferenceLinear, convert_to_float8_inference
from kp_precision.mx import MXTensor
from kp_precision.qat import QATLinear, QuantizedLinear, convert, prepare_qat
from kp_precision.training import Float8Config, Float8Linear, convert_to_float8_training

__version__ = "0.1.0"

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
