"""kp_core.constants as Triton compile-time constants (kernels may read module globals only as constexprs).

Imported by kernel modules only, so kp-core itself runs where Triton is not installed."""

import triton.language as tl

from kp_core import constants

LOG2E = tl.constexpr(constants.LOG2E)
"""kp_core.LOG2E as a `tl.constexpr`."""
LN2 = tl.constexpr(constants.LN2)
"""kp_core.LN2 as a `tl.constexpr`."""
SQRT1_2 = tl.constexpr(constants.SQRT1_2)
"""kp_core.SQRT1_2 as a `tl.constexpr`."""
INV_SQRT_2PI = tl.constexpr(constants.INV_SQRT_2PI)
"""kp_core.INV_SQRT_2PI as a `tl.constexpr`."""
SQRT_2_OVER_PI = tl.constexpr(constants.SQRT_2_OVER_PI)
"""kp_core.SQRT_2_OVER_PI as a `tl.constexpr`."""
GELU_TANH_CUBIC = tl.constexpr(constants.GELU_TANH_CUBIC)
"""kp_core.GELU_TANH_CUBIC as a `tl.constexpr`."""
