"""kp_core.constants as Triton compile-time constants (kernels may read module globals only as constexprs).

Imported by kernel modules only, so kp-core itself runs where Triton is not installed."""

import triton.language as tl

from kp_core import constants

LOG2E = tl.constexpr(constants.LOG2E)
LN2 = tl.constexpr(constants.LN2)
SQRT1_2 = tl.constexpr(constants.SQRT1_2)
INV_SQRT_2PI = tl.constexpr(constants.INV_SQRT_2PI)
SQRT_2_OVER_PI = tl.constexpr(constants.SQRT_2_OVER_PI)
GELU_TANH_CUBIC = tl.constexpr(constants.GELU_TANH_CUBIC)
