"""kp-norms' public functions: torch.nn.functional's signatures, argument checks, then the declared ops.

Norms run kp::norm (kp_norms.ops.norm), and kp::norm_float8 when their output is also wanted in float8; gated
activations run kp::glu / kp::glu_packed (kp_norms.ops.glu).
"""

import math
from typing import NamedTuple, Optional

import torch

import kp_core
from kp_core.activation import Activation, by_name
from kp_core.float8 import FP8_DTYPES
from kp_norms.ops.glu import GLU, GLU_FLOAT8, GLU_PACKED
from kp_norms.ops.norm import ADD_NORM_, DTYPES, NORM, NORM_FLOAT8
from kp_norms.ops.norm import FP8_DTYPES as FP8_INPUT_DTYPES

CASTINGS = {"torch": False, "gemma": False, "llama": True}  # name -> whether n is rounded before the weight
ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh")  # the names a norm's `activation` takes


def _is_size(d) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and d >= 0  # isinstance: a SymInt under torch.compile


def sizes(name: str, normalized_shape) -> tuple:
    """normalized_shape (an int or a sequence of sizes) as a non-empty tuple."""
    if _is_size(normalized_shape):
        shape = (normalized_shape,)
    elif isinstance(normalized_shape, (list, tuple)):  # torch.Size is a tuple
        shape = tuple(normalized_shape)
    else:
        shape = ()
    if not shape or not all(_is_size(d) for d in shape):
        raise ValueError(f"{name}: normalized_shape must be a non-empty sequence of sizes, got {normalized_shape!r}")
    return shape


def check_eps(name: str, eps) -> None:
    # Any real number, as torch takes it (a negative eps can make a row's rsqrt NaN there, as in torch).
    if eps is not None and not (isinstance(eps, (int, float)) and not isinstance(eps, bool)):
        raise TypeError(f"{name}: eps must be a number or None, got {eps!r}")


def check_casting(name: str, casting) -> None:
    if casting not in CASTINGS:
        raise ValueError(f"{name}: casting must be one of {tuple(CASTINGS)}, got {casting!r}")


def _check_shape_arg(name, input, normalized_shape) -> tuple:
    # The usual call, one trailing dim as an int or a 1-tuple that matches, costs a few comparisons.
    c = normalized_shape.__class__
    if c is int or ((c is tuple or c is torch.Size) and len(normalized_shape) == 1):
        n = normalized_shape if c is int else normalized_shape[0]
        if n.__class__ is int and n >= 0 and input.dim() >= 1 and input.shape[-1] == n:
            return (n,)
    normalized_shape = sizes(name, normalized_shape)
    k = len(normalized_shape)
    if input.dim() < k or tuple(input.shape[-k:]) != normalized_shape:
        raise ValueError(
            f"{name}: normalized_shape {normalized_shape} must match the trailing dims of input, "
            f"got input shape {tuple(input.shape)}"
        )
    return normalized_shape


def _check(name, input, normalized_shape, weight, bias, eps, residual=None) -> tuple:
    """Validate the common arguments; return normalized_shape as a tuple."""
    kp_core.check_tensor(name, "input", input, dtypes=DTYPES)
    if residual is not None:
        kp_core.check_tensor(name, "residual", residual, dtypes=DTYPES)
        kp_core.check_same_dtype(name, "residual", residual, input, "input")
        kp_core.check_same_device(name, input=input, residual=residual)
        kp_core.check_shape(name, "residual", residual, input.shape)
    if normalized_shape is ...:  # the fused add + norm ops normalise the last dim
        kp_core.check_tensor(name, "input", input, min_ndim=1)
        normalized_shape = (input.shape[-1],)
    normalized_shape = _check_shape_arg(name, input, normalized_shape)
    # Weight and bias may have another float dtype than the input, as in torch (e.g. fp32 weights, bf16 input).
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            kp_core.check_tensor(name, arg, t, dtypes=DTYPES)
            if t.device != input.device:
                kp_core.check_same_device(name, input=input, **{arg: t})
            if t.shape != normalized_shape:
                kp_core.check_shape(name, arg, t, normalized_shape)
    check_eps(name, eps)
    return normalized_shape


def _rms_variant(name, weight, offset, casting, act) -> tuple[float, bool, int]:
    """(offset, round_n, activation) of an RMSNorm call."""
    if offset.__class__ is float and offset == 0.0 and casting == "torch" and act is None:  # the usual call
        return 0.0, False, 0
    check_casting(name, casting)
    if not isinstance(offset, (int, float)) or isinstance(offset, bool) or not math.isfinite(offset):
        raise ValueError(f"{name}: offset must be a finite number, got {offset!r}")
    if offset != 0 and weight is None:
        raise ValueError(f"{name}: offset={offset} scales a weight, but weight is None")
    return float(offset), CASTINGS[casting], int(by_name(name, act, ACTIVATIONS))


def _layer_eps(name, eps) -> float:
    if eps is None:
        raise ValueError(f"{name}: eps must be a number, got None")
    return float(eps)


def _rms_eps(eps, dtype) -> float:
    # PyTorch's rms_norm takes its compute dtype's epsilon (fp32, or fp64 for fp64 input) when eps is None.
    return (
        float(eps) if eps is not None else torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    )


def _needs_grad(*tensors) -> bool:
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def _norm(input, residual, n_shape, weight, bias, eps, rms, offset, round_n, act, in_place=False):
    """Flatten to (rows, N), run, restore shapes. Returns (y, s) with s None without a residual."""
    flat = input.dim() == 2 and len(n_shape) == 1  # already (rows, N): no reshapes (each costs microseconds)
    if flat:
        rows, n = input.shape
        x2, w, b = input, weight, bias
    else:
        n = math.prod(n_shape)
        rows = math.prod(input.shape[: input.dim() - len(n_shape)])  # explicit, so zero-size inputs reshape too
        x2 = input.reshape(rows, n)
        w = None if weight is None else weight.reshape(n)
        b = None if bias is None else bias.reshape(n)
    grad = _needs_grad(input, residual, weight, bias)
    if in_place and not grad and _viewable(residual, rows, n):  # inference: the sum goes straight into residual
        y = ADD_NORM_(x2, residual if flat else residual.view(rows, n), w, b, eps, rms, offset, round_n, act)
        return (y if flat else y.view(input.shape)), residual
    r2 = None if residual is None or flat else residual.reshape(rows, n)
    y, s, _, _ = NORM(x2, residual if flat else r2, w, b, eps, rms, offset, round_n, act, grad)
    if not flat:
        y = y.view(input.shape)
    if residual is None:
        return y, None
    s = s if flat else s.view(input.shape)
    if in_place:  # autograd (or a layout the kernel cannot write) needs the out-of-place sum, then a copy
        residual.copy_(s)
        s = residual
    return y, s


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

    Args:
        input: (*, *normalized_shape), float16, bfloat16, float32 or float64.
        normalized_shape: the trailing dims normalised: an int or a sequence matching input's last dims.
        weight: normalized_shape, any of those dtypes (it may differ from input's, as in torch), input's device.

    Returns:
        input's shape and dtype ("llama" casting: the promoted dtype of input and weight).

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
        >>> w = torch.ones(64, dtype=torch.bfloat16)
        >>> y = kp_norms.rms_norm(x, (64,), w, eps=1e-6)
        >>> torch.allclose(y.float(), torch.nn.functional.rms_norm(x, (64,), w, eps=1e-6).float(), atol=1e-2)
        True
        >>> kp_norms.rms_norm(x, 64, w.float(), casting="llama").dtype  # Llama's: promoted with the weight
        torch.float32
    """
    name = "kp_norms.rms_norm"
    n_shape = _check(name, input, normalized_shape, weight, None, eps)
    offset, round_n, act = _rms_variant(name, weight, offset, casting, activation)
    return _norm(input, None, n_shape, weight, None, _rms_eps(eps, input.dtype), True, offset, round_n, act)[0]


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
    optional activation ("silu", "gelu", "gelu_tanh") applied in the same kernel.

    Args:
        input: (*, *normalized_shape), float16, bfloat16, float32 or float64.
        normalized_shape: the trailing dims normalised: an int or a sequence matching input's last dims.
        weight: normalized_shape, any of those dtypes, input's device.
        bias: normalized_shape, any of those dtypes, input's device.
        eps: a number (None is a ValueError).

    Returns:
        input's shape and dtype.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> x = torch.randn(8, 32)
        >>> w, b = torch.rand(32), torch.randn(32)
        >>> y = kp_norms.layer_norm(x, (32,), w, b)
        >>> torch.allclose(y, torch.nn.functional.layer_norm(x, (32,), w, b), atol=1e-5)
        True
        >>> kp_norms.layer_norm(x, 32, activation="gelu").shape
        torch.Size([8, 32])
    """
    name = "kp_norms.layer_norm"
    n_shape = _check(name, input, normalized_shape, weight, bias, eps)
    act = int(by_name(name, activation, ACTIVATIONS))
    return _norm(input, None, n_shape, weight, bias, _layer_eps(name, eps), False, 0.0, False, act)[0]


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
    offset, casting and activation are rms_norm's.

    Args:
        input: (*, N), float16, bfloat16, float32 or float64.
        residual: input's shape, dtype and device.
        weight: (N,), any of those dtypes, input's device.

    Returns:
        (the norm's output, input + residual), both input's shape; the output's dtype as rms_norm's, the sum's
        input's.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> x, residual = torch.randn(4, 64), torch.randn(4, 64)
        >>> y, h = kp_norms.add_rms_norm(x, residual, torch.ones(64), eps=1e-6)
        >>> torch.equal(h, x + residual), torch.allclose(y, kp_norms.rms_norm(h, 64, torch.ones(64), 1e-6))
        (True, True)
    """
    name = "kp_norms.add_rms_norm"
    n_shape = _check(name, input, ..., weight, None, eps, residual)
    offset, round_n, act = _rms_variant(name, weight, offset, casting, activation)
    eps = _rms_eps(eps, input.dtype)
    in_place = kp_core.check_bool(name, "in_place", in_place)  # in_place=1 would overwrite residual unasked
    return _norm(input, residual, n_shape, weight, None, eps, True, offset, round_n, act, in_place)


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
    """`(layer_norm(input + residual), input + residual)` in one pass over the last dim; see add_rms_norm.

    Args:
        input: (*, N), float16, bfloat16, float32 or float64.
        residual: input's shape, dtype and device.
        weight: (N,), any of those dtypes, input's device.
        bias: (N,), any of those dtypes, input's device.

    Returns:
        (layer_norm's output, input + residual), both with input's shape and dtype.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> x, residual = torch.randn(4, 64), torch.randn(4, 64)
        >>> y, h = kp_norms.add_layer_norm(x, residual, in_place=True)  # the sum is written into residual
        >>> h is residual, y.shape
        (True, torch.Size([4, 64]))
    """
    name = "kp_norms.add_layer_norm"
    n_shape = _check(name, input, ..., weight, bias, eps, residual)
    act = int(by_name(name, activation, ACTIVATIONS))
    eps = _layer_eps(name, eps)
    in_place = kp_core.check_bool(name, "in_place", in_place)
    return _norm(input, residual, n_shape, weight, bias, eps, False, 0.0, False, act, in_place)


class NormFloat8(NamedTuple):
    """norm_float8's result: `output` (the norm's, as the norm functions return it), `sum` (input + residual, None
    without a residual), and the output cast to float8: `data` (the output's shape), `scale` and `amax` (float32;
    rowwise: (*lead, 1), one per row; tensorwise: 0-d), with output ~ data * scale.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> out = kp_norms.norm_float8(torch.randn(4, 64), granularity="rowwise")
        >>> out.data.dtype, out.scale.shape, out.sum is None
        (torch.float8_e4m3fn, torch.Size([4, 1]), True)
    """

    output: torch.Tensor
    sum: Optional[torch.Tensor]
    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor


GRANULARITIES = ("tensorwise", "rowwise")


def _check_float8(name, float8_dtype, granularity, power_of_2) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"{name}: granularity must be 'tensorwise' or 'rowwise', got {granularity!r}")
    if float8_dtype not in FP8_DTYPES:
        raise TypeError(f"{name}: float8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {float8_dtype}")
    kp_core.check_bool(name, "power_of_2", power_of_2)


def norm_float8(
    input: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    *,
    kind: str = "rms",
    residual: Optional[torch.Tensor] = None,
    offset: float = 0.0,
    casting: str = "torch",
    activation: Optional[str] = None,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensorwise",
    power_of_2: bool = False,
) -> NormFloat8:
    """A norm over the last dim (kind 'rms': rms_norm, or add_rms_norm with a residual; 'layer': layer_norm /
    add_layer_norm, with their arguments) whose output also comes cast to float8, for a float8 matmul that reads
    it next: per row or per tensor (`granularity`), as kp_precision.quantize casts (the scale from the amax,
    floored to a power of two with power_of_2; saturating, round to nearest-even), bit for bit. The cast is
    made from the rounded output inside the norm's kernel (rowwise: in the same launch); the output is never
    read back for its amax. Gradients flow through `output` and `sum` as through the norm functions; the float8
    copy has none. float16, bfloat16 and float32 inputs.

    Args:
        input: (*, N), float16, bfloat16 or float32.
        weight: (N,), a float dtype, input's device.
        bias: (N,), kind="layer" only.
        residual: input's shape, dtype and device, or None.
        float8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        granularity: "tensorwise" (one scale) or "rowwise" (one per row).

    Returns:
        A NormFloat8: output (and sum) as the norm functions return them, data (input's shape, float8_dtype),
        scale and amax (float32; rowwise (*, 1), tensorwise 0-d).

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> x = torch.randn(4, 64, dtype=torch.bfloat16)
        >>> out = kp_norms.norm_float8(x, torch.ones(64, dtype=torch.bfloat16), eps=1e-6)
        >>> out.data.dtype, out.data.shape, out.scale.shape
        (torch.float8_e4m3fn, torch.Size([4, 64]), torch.Size([]))
        >>> back = out.data.float() * out.scale  # output ~ data * scale
        >>> bool((back - out.output.float()).abs().max() < 0.1 * out.output.float().abs().max())
        True
    """
    name = "kp_norms.norm_float8"
    if kind not in ("rms", "layer"):
        raise ValueError(f"{name}: kind must be 'rms' or 'layer', got {kind!r}")
    _check_float8(name, float8_dtype, granularity, power_of_2)
    kp_core.check_tensor(name, "input", input, dtypes=FP8_INPUT_DTYPES, min_ndim=1)
    n_shape = _check(name, input, ..., weight, bias, eps, residual)
    rms = kind == "rms"
    if rms:
        if bias is not None:
            raise ValueError(f"{name}: bias is for kind='layer', got a bias with kind='rms'")
        offset, round_n, act = _rms_variant(name, weight, offset, casting, activation)
        eps = _rms_eps(eps, input.dtype)
    else:
        if offset != 0.0 or casting != "torch":
            raise ValueError(
                f"{name}: offset and casting are for kind='rms', got offset={offset!r}, casting={casting!r}"
            )
        round_n, act, eps = False, int(by_name(name, activation, ACTIVATIONS)), _layer_eps(name, eps)
    n = n_shape[0]
    rows = math.prod(input.shape[:-1])
    r2 = None if residual is None else residual.reshape(rows, n)
    rowwise = granularity == "rowwise"
    grad = _needs_grad(input, residual, weight, bias)
    y, s, _, _, data, scale, amax = NORM_FLOAT8(
        input.reshape(rows, n),
        r2,
        weight,
        bias,
        eps,
        rms,
        offset,
        round_n,
        act,
        grad,
        float8_dtype,
        rowwise,
        power_of_2,
    )
    shape = (*input.shape[:-1], 1) if rowwise else ()
    return NormFloat8(
        y.view(input.shape),
        None if residual is None else s.view(input.shape),
        data.view(float8_dtype).view(input.shape),
        scale.view(shape),
        amax.view(shape),
    )


# ---- gated activations ----


def _glu(name: str, gate, up, act: Activation) -> torch.Tensor:
    kp_core.check_tensor(name, "gate", gate, dtypes=DTYPES)
    kp_core.check_tensor(name, "up", up, dtypes=DTYPES)
    kp_core.check_same_dtype(name, "up", up, gate, "gate")
    kp_core.check_same_device(name, gate=gate, up=up)
    kp_core.check_shape(name, "up", up, gate.shape)
    return GLU(gate, up, int(act))


def _glu_packed(name: str, input, act: Activation) -> torch.Tensor:
    kp_core.check_tensor(name, "input", input, dtypes=DTYPES, min_ndim=1)
    if input.shape[-1] % 2:
        raise ValueError(f"{name}: input's last dimension must be even (gate and up halves), got {input.shape[-1]}")
    return GLU_PACKED(input, int(act))


def _gelu(name: str, approximate: str) -> Activation:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return Activation.GELU if approximate == "none" else Activation.GELU_TANH


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up`, fused; gate and up have the same shape, dtype and device.

    Args:
        gate: any shape, float16, bfloat16, float32 or float64.
        up: gate's shape, dtype and device.

    Returns:
        gate's shape and dtype.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> gate, up = torch.randn(4, 128), torch.randn(4, 128)
        >>> torch.allclose(kp_norms.swiglu(gate, up), torch.nn.functional.silu(gate) * up, atol=1e-6)
        True
    """
    return _glu("kp_norms.swiglu", gate, up, Activation.SILU)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """`F.gelu(gate, approximate=approximate) * up`, fused.

    Args:
        gate: any shape, float16, bfloat16, float32 or float64.
        up: gate's shape, dtype and device.
        approximate: "none" (erf GELU) or "tanh".

    Returns:
        gate's shape and dtype.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> gate, up = torch.randn(4, 128), torch.randn(4, 128)
        >>> y = kp_norms.geglu(gate, up, approximate="tanh")
        >>> torch.allclose(y, torch.nn.functional.gelu(gate, approximate="tanh") * up, atol=1e-6)
        True
    """
    return _glu("kp_norms.geglu", gate, up, _gelu("kp_norms.geglu", approximate))


def swiglu_packed(input: torch.Tensor) -> torch.Tensor:
    """`swiglu(*input.chunk(2, -1))` without copying the halves: input is [..., 2H], the result [..., H].

    Args:
        input: (*, 2H) (the last dim even), float16, bfloat16, float32 or float64.

    Returns:
        (*, H), input's dtype.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> x = torch.randn(4, 256)
        >>> torch.allclose(kp_norms.swiglu_packed(x), kp_norms.swiglu(*x.chunk(2, -1)))
        True
    """
    return _glu_packed("kp_norms.swiglu_packed", input, Activation.SILU)


def geglu_packed(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """`geglu(*input.chunk(2, -1), approximate)` without copying the halves.

    Args:
        input: (*, 2H) (the last dim even), float16, bfloat16, float32 or float64.
        approximate: "none" (erf GELU) or "tanh".

    Returns:
        (*, H), input's dtype.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> kp_norms.geglu_packed(torch.randn(4, 256)).shape
        torch.Size([4, 128])
    """
    name = "kp_norms.geglu_packed"
    return _glu_packed(name, input, _gelu(name, approximate))


class GLUFloat8(NamedTuple):
    """glu_float8's result: `output` (act(gate) * up) and its float8 copy: `data` (the output's shape), `scale` and
    `amax` (float32; rowwise: (*lead, 1), tensorwise: 0-d), with output ~ data * scale.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> out = kp_norms.glu_float8(torch.randn(4, 128), torch.randn(4, 128), granularity="rowwise")
        >>> out.output.shape, out.data.dtype, out.amax.shape
        (torch.Size([4, 128]), torch.float8_e4m3fn, torch.Size([4, 1]))
    """

    output: torch.Tensor
    data: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor


GLU_ACTIVATIONS = {"silu": Activation.SILU, "gelu": Activation.GELU, "gelu_tanh": Activation.GELU_TANH}


def glu_float8(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str = "silu",
    *,
    float8_dtype: torch.dtype = torch.float8_e4m3fn,
    granularity: str = "tensorwise",
    power_of_2: bool = False,
) -> GLUFloat8:
    """`act(gate) * up` (swiglu for "silu", geglu for "gelu" / "gelu_tanh"), its output also cast to float8 for
    the float8 matmul that reads it next (an MLP's down projection): per row or per tensor, bit for bit
    kp_precision.quantize of the output. The forward kernel leaves the output's amax and one more pass casts it
    (the output is never read back for its amax). Gradients flow through `output` as through swiglu / geglu;
    the float8 copy has none. float16, bfloat16 and float32 inputs.

    Args:
        gate: (*, N), float16, bfloat16 or float32.
        up: gate's shape, dtype and device.
        activation: "silu", "gelu" or "gelu_tanh".
        float8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        granularity: "tensorwise" (one scale) or "rowwise" (one per row).

    Returns:
        A GLUFloat8: output (gate's shape and dtype), data (gate's shape, float8_dtype), scale and amax
        (float32; rowwise (*, 1), tensorwise 0-d).

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> gate, up = torch.randn(4, 128, dtype=torch.bfloat16), torch.randn(4, 128, dtype=torch.bfloat16)
        >>> out = kp_norms.glu_float8(gate, up, "silu", float8_dtype=torch.float8_e5m2)
        >>> out.data.dtype, out.scale.dtype, torch.equal(out.output, kp_norms.swiglu(gate, up))
        (torch.float8_e5m2, torch.float32, True)
    """
    name = "kp_norms.glu_float8"
    if activation not in GLU_ACTIVATIONS:
        raise ValueError(f"{name}: activation must be one of {tuple(GLU_ACTIVATIONS)}, got {activation!r}")
    _check_float8(name, float8_dtype, granularity, power_of_2)
    kp_core.check_tensor(name, "gate", gate, dtypes=FP8_INPUT_DTYPES, min_ndim=1)
    kp_core.check_tensor(name, "up", up, dtypes=FP8_INPUT_DTYPES)
    kp_core.check_same_dtype(name, "up", up, gate, "gate")
    kp_core.check_same_device(name, gate=gate, up=up)
    kp_core.check_shape(name, "up", up, gate.shape)
    rowwise = granularity == "rowwise"
    act = int(GLU_ACTIVATIONS[activation])
    y, data, scale, amax = GLU_FLOAT8(gate, up, act, float8_dtype, rowwise, power_of_2)
    shape = (*gate.shape[:-1], 1) if rowwise else ()
    return GLUFloat8(y, data.view(float8_dtype), scale.view(shape), amax.view(shape))
