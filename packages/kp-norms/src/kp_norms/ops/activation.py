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
    def _sigmoid_pair(a):
        """(sigmoid(a), 1 - sigmoid(a)), both to full relative precision: 1 - sigmoid(a) = exp(-a) * sigmoid(a)
        has no cancellation where sigmoid(a) -> 1 (1 - s would lose every digit there)."""
        e = tl.exp(-a)
        s = 1.0 / (1.0 + e)
        return s, tl.where(s > 0, e * s, 1.0)  # e = inf gives s = 0, and then 1 - s = 1

    @triton.jit
    def act_fwd(z, ACT: tl.constexpr):
        """act(z) for z in the accumulation dtype. GELU's tanh form uses 0.5 * (1 + tanh(u)) = sigmoid(2u),
        which keeps full precision where tanh(u) -> -1."""
        if ACT == 1:
            out = z / (1.0 + tl.exp(-z))
        elif ACT == 2:
            out = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
        elif ACT == 3:
            out = z / (1.0 + tl.exp(-1.5957691216057308 * (z + 0.044715 * z * z * z)))
        else:
            out = z
        return out

    @triton.jit
    def act_grad(z, ACT: tl.constexpr):
        """d act(z) / dz."""
        if ACT == 1:
            s, one_minus_s = _sigmoid_pair(z)
            out = s * (1.0 + z * one_minus_s)
        elif ACT == 2:
            out = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476)) + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
        elif ACT == 3:
            s, one_minus_s = _sigmoid_pair(1.5957691216057308 * (z + 0.044715 * z * z * z))
            out = s + z * s * one_minus_s * 1.5957691216057308 * (1.0 + 0.134145 * z * z)
        else:
            out = z * 0.0 + 1.0
        return out
