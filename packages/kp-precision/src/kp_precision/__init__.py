"""kp-precision: float8 quantisation and scaled matmul kernels in Triton (float8 training, MX and QAT to come)."""

from kp_precision.float8 import Float8Tensor
from kp_precision.functional import dequantize, quantize, scaled_mm

__version__ = "0.1.0"

__all__ = ["Float8Tensor", "dequantize", "quantize", "scaled_mm"]
