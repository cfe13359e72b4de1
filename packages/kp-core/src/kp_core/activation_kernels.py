"""Triton forms of kp_core.activation, with their derivatives: helpers kernels call, not launchable kernels.

They use only exp and erf, so they run the same on every backend and under the interpreter, and are written to
avoid cancellation: sigmoid's complement as a product, tanh through sigmoid. Imported by kernel modules only, so
kp-core itself runs where Triton is not installed.
"""

import triton
import triton.language as tl

from kp_core.activation import Activation
from kp_core.kernel_constants import GELU_TANH_CUBIC, INV_SQRT_2PI, SQRT1_2, SQRT_2_OVER_PI

NONE = tl.constexpr(Activation.NONE.value)
SILU = tl.constexpr(Activation.SILU.value)
GELU = tl.constexpr(Activation.GELU.value)
GELU_TANH = tl.constexpr(Activation.GELU_TANH.value)
RELU = tl.constexpr(Activation.RELU.value)


@triton.jit
def sigmoid(x):
    """(sigmoid(x), 1 - sigmoid(x)), both accurate: exp(-|x|) never overflows, and the complement is a
    product, not 1 - s (that cancels for large x and costs ~1e-6 relative in the gradients)."""
    e = tl.exp(-tl.abs(x))
    p = 1.0 / (1.0 + e)
    q = e * p
    return tl.where(x >= 0, p, q), tl.where(x >= 0, q, p)


@triton.jit
def act(g, ACT: tl.constexpr, WANT_GRAD: tl.constexpr):
    """(act(g), act'(g)) in g's dtype (act'(g) = act(g) when not WANT_GRAD; identity for NONE). GELU's
    tanh form is g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3): no tanh, full precision where
    tanh(z) -> -1. Python float constants take g's dtype: exact in fp64 too."""
    if ACT == SILU:
        s, s_c = sigmoid(g)
        a = g * s
        da = a
        if WANT_GRAD:
            da = s * (1.0 + g * s_c)
    elif ACT == GELU:
        cdf = 0.5 * (1.0 + tl.math.erf(g * SQRT1_2))
        a = g * cdf
        da = a
        if WANT_GRAD:
            da = cdf + g * tl.exp(-0.5 * g * g) * INV_SQRT_2PI
    elif ACT == GELU_TANH:
        g2 = g * g
        # Constants on the right: under the interpreter a constexpr on the left of a tensor breaks.
        s, s_c = sigmoid((g + g2 * GELU_TANH_CUBIC * g) * (2.0 * SQRT_2_OVER_PI))
        a = g * s
        da = a
        if WANT_GRAD:
            da = s * (1.0 + g * (2.0 * SQRT_2_OVER_PI) * s_c * (1.0 + g2 * (3.0 * GELU_TANH_CUBIC)))
    elif ACT == RELU:
        a = tl.maximum(g, 0.0)
        da = a
        if WANT_GRAD:
            da = tl.where(g > 0, 1.0, 0.0).to(g.dtype)
    else:
        a = g
        da = g * 0.0 + 1.0
    return a, da


@triton.jit
def act_fwd(z, ACT: tl.constexpr):
    return act(z, ACT, False)[0]


@triton.jit
def act_grad(z, ACT: tl.constexpr):
    return act(z, ACT, True)[1]
