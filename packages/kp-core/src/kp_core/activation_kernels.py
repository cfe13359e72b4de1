"""Triton forms of kp_core.activation, with their derivatives: helpers kernels call, not launchable kernels.

They use only exp and erf, so they run the same on every backend and under the interpreter, and are written to
avoid cancellation: sigmoid's complement as a product, tanh through sigmoid. Imported by kernel modules only, so
kp-core itself runs where Triton is not installed.
"""

import triton
import triton.language as tl

from kp_core import jit_keys
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
    product, not 1 - s (that cancels for large x and costs ~1e-6 relative in the gradients).

    A Triton helper: call it inside a `@triton.jit` kernel on a block of floats; both results have x's shape.

    Examples:
        Under TRITON_INTERPRET=1 (set before Python starts) on CPU tensors, or on a GPU:

        >>> import torch
        >>> import triton
        >>> import triton.language as tl
        >>> from kp_core.activation_kernels import sigmoid
        >>> @triton.jit
        ... def complement(x_ptr, out_ptr, BLOCK: tl.constexpr):
        ...     offs = tl.arange(0, BLOCK)
        ...     tl.store(out_ptr + offs, sigmoid(tl.load(x_ptr + offs))[1])
        >>> x, out = torch.tensor([-30.0, 0.0, 30.0, 40.0]), torch.empty(4)
        >>> _ = complement[(1,)](x, out, BLOCK=4)
        >>> out[2].item() > 0  # 1 - sigmoid(30) is about 9.4e-14, not 0
        True
    """
    e = tl.exp(-tl.abs(x))
    p = 1.0 / (1.0 + e)
    q = e * p
    return tl.where(x >= 0, p, q), tl.where(x >= 0, q, p)


@triton.jit
def act(g, ACT: tl.constexpr, WANT_GRAD: tl.constexpr):
    """(act(g), act'(g)) in g's dtype (act'(g) = act(g) when not WANT_GRAD; identity for NONE). GELU's
    tanh form is g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3): no tanh, full precision where
    tanh(z) -> -1. Python float constants take g's dtype: exact in fp64 too.

    A Triton helper: `g` a block of floats, `ACT` an int constexpr (`int(kp_core.Activation.SILU)`, ...),
    `WANT_GRAD` a bool constexpr. kp_core.activation.reference_with_grad computes the same in PyTorch.

    Examples:
        Under TRITON_INTERPRET=1 (set before Python starts) on CPU tensors, or on a GPU:

        >>> import torch
        >>> import triton
        >>> import triton.language as tl
        >>> from kp_core import Activation
        >>> from kp_core.activation_kernels import act
        >>> @triton.jit
        ... def silu_and_grad(x_ptr, y_ptr, dy_ptr, BLOCK: tl.constexpr, ACT: tl.constexpr):
        ...     offs = tl.arange(0, BLOCK)
        ...     y, dy = act(tl.load(x_ptr + offs), ACT, True)
        ...     tl.store(y_ptr + offs, y)
        ...     tl.store(dy_ptr + offs, dy)
        >>> x, y, dy = torch.tensor([0.0, 1.0]), torch.empty(2), torch.empty(2)
        >>> _ = silu_and_grad[(1,)](x, y, dy, BLOCK=2, ACT=int(Activation.SILU))
        >>> torch.allclose(y, torch.nn.functional.silu(x)), dy[0].item()
        (True, 0.5)
    """
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
    """act(z) alone (`act(z, ACT, False)[0]`): a Triton helper for a kernel's forward, z a block of floats.

    Examples:
        Under TRITON_INTERPRET=1 (set before Python starts) on CPU tensors, or on a GPU:

        >>> import torch
        >>> import triton
        >>> import triton.language as tl
        >>> from kp_core import Activation
        >>> from kp_core.activation_kernels import act_fwd
        >>> @triton.jit
        ... def gelu(x_ptr, y_ptr, BLOCK: tl.constexpr, ACT: tl.constexpr):
        ...     offs = tl.arange(0, BLOCK)
        ...     tl.store(y_ptr + offs, act_fwd(tl.load(x_ptr + offs), ACT))
        >>> x, y = torch.tensor([-1.0, 0.0, 0.5, 2.0]), torch.empty(4)
        >>> _ = gelu[(1,)](x, y, BLOCK=4, ACT=int(Activation.GELU))
        >>> torch.allclose(y, torch.nn.functional.gelu(x))
        True
    """
    return act(z, ACT, False)[0]


@triton.jit
def act_grad(z, ACT: tl.constexpr):
    """act'(z) alone (`act(z, ACT, True)[1]`): a Triton helper for a kernel's backward, z a block of floats.

    Examples:
        Under TRITON_INTERPRET=1 (set before Python starts) on CPU tensors, or on a GPU:

        >>> import torch
        >>> import triton
        >>> import triton.language as tl
        >>> from kp_core import Activation
        >>> from kp_core.activation_kernels import act_grad
        >>> @triton.jit
        ... def relu_grad(x_ptr, d_ptr, BLOCK: tl.constexpr, ACT: tl.constexpr):
        ...     offs = tl.arange(0, BLOCK)
        ...     tl.store(d_ptr + offs, act_grad(tl.load(x_ptr + offs), ACT))
        >>> x, d = torch.tensor([-1.0, 2.0]), torch.empty(2)
        >>> _ = relu_grad[(1,)](x, d, BLOCK=2, ACT=int(Activation.RELU))
        >>> d
        tensor([0., 1.])
    """
    return act(z, ACT, True)[1]


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
