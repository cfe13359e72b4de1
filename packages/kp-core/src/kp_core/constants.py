"""Math constants shared by every package, in Python and (through kp_core.kernel_constants) in Triton kernels."""

import math

LOG2E = math.log2(math.e)
"""log2(e), a Python float: exp(x) = exp2(x * LOG2E)."""
LN2 = math.log(2.0)
"""ln(2), a Python float: log(x) = log2(x) * LN2."""
SQRT1_2 = math.sqrt(0.5)
"""sqrt(1/2), a Python float: the erf GELU is 0.5 x (1 + erf(x * SQRT1_2))."""
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
"""1 / sqrt(2 pi), a Python float: the standard normal density at 0 (the erf GELU's derivative)."""
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
"""sqrt(2 / pi), a Python float: the tanh GELU's inner factor."""
GELU_TANH_CUBIC = 0.044715
"""The tanh GELU's cubic coefficient (Hendrycks and Gimpel 2016), a Python float."""
