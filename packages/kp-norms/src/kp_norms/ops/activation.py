"""Activations shared by the norm and gated-activation kernels: ids, Triton forms and their derivatives.

The Triton forms use only exp/erf so they run the same on every backend and under the interpreter, and are
written to avoid cancellation (sigmoid's complement, tanh through sigmoid).
"""

import torch
import torch.nn.functional as F

import kp_core

NONE, SILU, GELU, GELU_TANH = 0, 1, 2, 3
# Names a user passes; "gelu" is the exact (erf) form, as in F.gelu(approximate="none").
IDS = {None: NONE, "silu": SILU, "gelu": GELU, "gelu_tanh": GELU_TANH}


def activation_id(op: str, activation) -> int:
    if activation not in IDS:
        names = ", ".join(repr(k) for k in IDS)
        raise ValueError(f"{op}: activation must be one of {names}, got {activation!r}")
    return IDS[activation]


def reference(z: torch.Tensor, act: int) -> torch.Tensor:
    """The activation by PyTorch's own functions (the reference path and the fallback)."""
    if act == SILU:
        return F.silu(z)
    if act == GELU:
        return F.gelu(z)
    if act == GELU_TANH:
        return F.gelu(z, approximate="tanh")
    return z


if kp_core.has_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _sigmoid(x):
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
        if ACT == 1:
            s, s_c = _sigmoid(g)
            a = g * s
            da = a
            if WANT_GRAD:
                da = s * (1.0 + g * s_c)
        elif ACT == 2:
            cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
            a = g * cdf
            da = a
            if WANT_GRAD:
                da = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327
        elif ACT == 3:
            g2 = g * g
            s, s_c = _sigmoid(1.5957691216057308 * (g + 0.044715 * g2 * g))
            a = g * s
            da = a
            if WANT_GRAD:
                da = s * (1.0 + 1.5957691216057308 * g * s_c * (1.0 + 0.134145 * g2))
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
