"""The norms' functional API: torch.nn.functional's signatures, argument checks, and the eager/compiled split.

Every function runs one kernel family (kp_norms.ops.norm). Eager calls go through an autograd.Function
(less CPU time per call); under torch.compile the custom ops run, so fullgraph=True works.
"""

import math
from typing import Optional

import torch

import kp_core
from kp_norms.ops.activation import activation_id
from kp_norms.ops.norm import DTYPES, NormFunction, Variant, acc_dtype, add_norm_inplace_op, forward_impl, norm_op

CASTINGS = {"torch": False, "gemma": False, "llama": True}  # name -> whether n is rounded before the weight


def _check_shape_arg(name, input, normalized_shape):
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        normalized_shape = (normalized_shape,)
    if isinstance(normalized_shape, torch.Size):
        normalized_shape = tuple(normalized_shape)
    if (
        not isinstance(normalized_shape, (list, tuple))
        or len(normalized_shape) == 0
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in normalized_shape)
    ):
        raise ValueError(f"{name}: normalized_shape must be a non-empty sequence of sizes, got {normalized_shape!r}")
    normalized_shape = tuple(normalized_shape)
    k = len(normalized_shape)
    if input.dim() < k or tuple(input.shape[-k:]) != normalized_shape:
        raise ValueError(
            f"{name}: normalized_shape {normalized_shape} must match the trailing dims of input, "
            f"got input shape {tuple(input.shape)}"
        )
    return normalized_shape


def _check(name, input, normalized_shape, weight, bias, eps, residual=None):
    """Validate the common arguments; return normalized_shape as a tuple."""
    kp_core.check_tensor(name, "input", input, dtypes=DTYPES)
    if residual is not None:
        kp_core.check_tensor(name, "residual", residual, dtypes=DTYPES)
        kp_core.check_same_dtype(name, "residual", residual, input, "input")
        kp_core.check_same_device(name, input=input, residual=residual)
        kp_core.check_shape(name, "residual", residual, input.shape)
    if normalized_shape is None:  # the fused add + norm ops normalise the last dim
        kp_core.check_tensor(name, "input", input, min_ndim=1)
        normalized_shape = (input.shape[-1],)
    normalized_shape = _check_shape_arg(name, input, normalized_shape)
    # Weight and bias may have another float dtype than the input, as in torch (e.g. fp32 weights, bf16 input).
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            kp_core.check_tensor(name, arg, t, dtypes=DTYPES)
            kp_core.check_same_device(name, input=input, **{arg: t})
            kp_core.check_shape(name, arg, t, normalized_shape)
    if eps is not None and not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0):
        raise ValueError(f"{name}: eps must be a non-negative number or None, got {eps!r}")
    return normalized_shape


def _rms_variant(name, weight, offset, casting, act) -> Variant:
    if casting not in CASTINGS:
        raise ValueError(f"{name}: casting must be one of {tuple(CASTINGS)}, got {casting!r}")
    if not isinstance(offset, (int, float)) or isinstance(offset, bool) or not math.isfinite(offset):
        raise ValueError(f"{name}: offset must be a finite number, got {offset!r}")
    if offset != 0 and weight is None:
        raise ValueError(f"{name}: offset={offset} scales a weight, but weight is None")
    return Variant(rms=True, offset=float(offset), round_n=CASTINGS[casting], act=activation_id(name, act))


def _layer_eps(name, eps):
    if eps is None:
        raise ValueError(f"{name}: eps must be a non-negative number, got None")
    return float(eps)


def _rms_eps(eps, dtype):
    # PyTorch's rms_norm takes the compute dtype's epsilon (fp32, or fp64 for fp64 input) when eps is None.
    return float(eps) if eps is not None else torch.finfo(acc_dtype(dtype)).eps


def _norm(input, residual, n_shape, weight, bias, eps, v: Variant, in_place=False):
    """Flatten to (rows, N), run, restore shapes. Returns (y, s) with s None without a residual."""
    n = math.prod(n_shape)
    rows = math.prod(input.shape[: input.dim() - len(n_shape)])  # explicit, so zero-size inputs reshape too
    x2 = input.reshape(rows, n)
    r2 = residual.reshape(rows, n) if residual is not None else None
    w = weight.reshape(n) if weight is not None else None
    b = bias.reshape(n) if bias is not None else None
    compiling = torch.compiler.is_compiling()
    if in_place:
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (input, residual, weight, bias)
        )
        target = residual.view(rows, n) if _viewable(residual, rows, n) else None
        if not needs_grad and target is not None:  # inference: the sum goes straight into residual
            if compiling:
                y = add_norm_inplace_op(x2, target, w, b, eps, v.rms, v.offset, v.round_n, v.act)
            else:
                y = forward_impl(x2, target, w, b, eps, v, s_out=target)[0]
            return y.view(input.shape), residual
    if compiling:
        y, s, _, _ = norm_op(x2, r2, w, b, eps, v.rms, v.offset, v.round_n, v.act)
    else:
        y, s, _, _ = NormFunction.apply(x2, r2, w, b, eps, v)
    if residual is None:
        return y.view(input.shape), None
    s = s.view(input.shape)
    if in_place:  # autograd (or a layout the kernel cannot write) needs the out-of-place sum, then a copy
        residual.copy_(s)
        s = residual
    return y.view(input.shape), s


def _viewable(t: torch.Tensor, rows: int, n: int) -> bool:
    """Whether t.view(rows, n) exists with unit column stride: the kernel can then write the sum into t.
    Decided from strides (not by trying view), so torch.compile traces it."""
    if n != 1 and t.stride(-1) != 1:
        return False
    lead = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size != 1]
    return all(lead[i][1] == lead[i + 1][1] * lead[i + 1][0] for i in range(len(lead) - 1))


def rms_norm(
    input: torch.Tensor,
    normalized_shape: "int | list[int] | tuple[int, ...] | torch.Size",
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    *,
    offset: float = 0.0,
    casting: str = "torch",
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.rms_norm`, plus the variants model families use.

    offset: y = n * (offset + weight); Gemma stores w and multiplies by 1 + w (offset=1.0).
    casting: "torch" (also "gemma"): everything in fp32, one rounding at the end, output in the input's
        dtype -- F.rms_norm and Gemma. "llama": n is rounded to the input dtype before the weight multiplies
        it, and the output has the promoted dtype of input and weight -- LlamaRMSNorm (Mistral, Qwen2/3).
    activation: None, "silu", "gelu" or "gelu_tanh", applied to the normalised output in the same kernel.
    eps=None takes the epsilon of the compute dtype (fp32, or fp64 for fp64 input), which is what PyTorch's
    implementation does (its docs say `torch.finfo(input.dtype).eps`; for fp16/bf16 the code differs).
    """
    name = "kp_norms.rms_norm"
    n_shape = _check(name, input, normalized_shape, weight, None, eps)
    v = _rms_variant(name, weight, offset, casting, activation)
    return _norm(input, None, n_shape, weight, None, _rms_eps(eps, input.dtype), v)[0]


def layer_norm(
    input: torch.Tensor,
    normalized_shape: "int | list[int] | tuple[int, ...] | torch.Size",
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    activation: Optional[str] = None,
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.layer_norm` (biased variance, fp32 math, one rounding), with an
    optional activation ("silu", "gelu", "gelu_tanh") applied in the same kernel."""
    name = "kp_norms.layer_norm"
    n_shape = _check(name, input, normalized_shape, weight, bias, eps)
    v = Variant(rms=False, act=activation_id(name, activation))
    return _norm(input, None, n_shape, weight, bias, _layer_eps(name, eps), v)[0]


def add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    *,
    offset: float = 0.0,
    casting: str = "torch",
    activation: Optional[str] = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(input + residual), input + residual)` in one pass over the last dim: the pre-norm block's
    `h = x + residual; y = norm(h)`. The sum is rounded to the input dtype, as torch's add is.

    in_place=True writes the sum into `residual` and returns it. Without autograd that saves the sum's
    allocation; when a gradient is needed the sum is computed out of place and copied in (autograd needs
    the saved sum intact, so a later in-place update of that buffer makes backward raise, as torch does).
    """
    name = "kp_norms.add_rms_norm"
    n_shape = _check(name, input, None, weight, None, eps, residual)
    v = _rms_variant(name, weight, offset, casting, activation)
    return _norm(input, residual, n_shape, weight, None, _rms_eps(eps, input.dtype), v, bool(in_place))


def add_layer_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
    *,
    activation: Optional[str] = None,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(layer_norm(input + residual), input + residual)` in one pass over the last dim; see add_rms_norm."""
    name = "kp_norms.add_layer_norm"
    n_shape = _check(name, input, None, weight, bias, eps, residual)
    v = Variant(rms=False, act=activation_id(name, activation))
    return _norm(input, residual, n_shape, weight, bias, _layer_eps(name, eps), v, bool(in_place))
