"""Math constants shared by every package, in Python and (through kp_core.kernel_constants) in Triton kernels."""

import math

LOG2E = math.log2(math.e)  # exp(x) = exp2(x * LOG2E)
LN2 = math.log(2.0)  # log(x) = log2(x) * LN2
SQRT1_2 = math.sqrt(0.5)  # erf-GELU: 0.5 x (1 + erf(x * SQRT1_2))
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)  # the standard normal density at 0
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)  # tanh-GELU's inner factor
GELU_TANH_CUBIC = 0.044715  # tanh-GELU's cubic coefficient (Hendrycks & Gimpel 2016)
