"""kp-precision's public functions on tensors: the user-facing argument checks, then the declared ops
(kp_precision.ops.*; the float8 cast through kp_precision.shared, which the layers call without the checks)."""

import math

import torch

import kp_core
from kp_core.activation import by_name
from kp_core.float8 import FP8_DTYPES
from kp_precision.float8 import Float8Tensor
from kp_precision.mx import MXTensor
from kp_precision.ops import fake_quantize as fq
from kp_precision.ops import linear_activation as la
from kp_precision.ops import mx
from kp_precision.ops import scaled_mm as mm
from kp_precision.ops.quantize import DTYPES, scale_shape
from kp_precision.shared import ALIGN, cast

_NAME = "kp_precision.quantize"
_BLOCKS = {"tensorwise": (0, 0), "rowwise": (1, 0)}


def _block(granularity: str, block: tuple[int, int] | None, x: torch.Tensor) -> tuple[int, int]:
    if granularity in _BLOCKS:
        if block is not None:
            raise ValueError(f"{_NAME}: block is for granularity='blockwise', got block={block!r} with {granularity!r}")
        return _BLOCKS[granularity]
    if granularity != "blockwise":
        raise ValueError(f"{_NAME}: granularity must be 'tensorwise', 'rowwise' or 'blockwise', got {granularity!r}")
    block = (1, 128) if block is None else block
    ok = (
        isinstance(block, (tuple, list))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 and b & (b - 1) == 0 for b in block)
    )
    if not ok or block[1] < 16 or block[0] * block[1] > 16384:
        raise ValueError(
            f"{_NAME}: block must be (block_m, block_k), powers of two with block_k >= 16 and "
            f"block_m * block_k <= 16384 (e.g. (1, 128) or (128, 128)), got {block!r}"
        )
    if block[0] > 1 and x.dim() != 2:
        raise ValueError(f"{_NAME}: blocks of several rows {tuple(block)} need a 2-D input, got shape {tuple(x.shape)}")
    return tuple(block)


def quantize(
    input: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    *,
    granularity: str = "tensorwise",
    block: tuple[int, int] | None = None,
    scale: torch.Tensor | None = None,
    power_of_2: bool = False,
) -> Float8Tensor:
    """Quantise `input` (float16, bfloat16 or float32) to float8 with scales per `granularity`:
    'tensorwise' (one scale), 'rowwise' (one per row of the last dim) or 'blockwise' (`block` = (block_m,
    block_k) over the (rows, last dim) view: (1, 128) for activations, the default, or (128, 128) for weights).

    Scales come from the amax of each block (max |x| -> the format's largest value), as float32, floored to a
    power of two with `power_of_2=True`. `scale` (tensorwise only) is a given dequantisation scale, as in
    delayed scaling: the data is x / scale, saturated, and the returned amax is the input's. Values beyond the
    format's range saturate, NaN stays NaN, rounding is to nearest-even: bit for bit torch's own cast of the
    scaled values. Returns a Float8Tensor (data, scale, amax, block).

    Args:
        input: (*, K) (2-D for blocks of several rows), float16, bfloat16 or float32.
        dtype: torch.float8_e4m3fn or torch.float8_e5m2.
        scale: a one-element float32 tensor on input's device, or None.

    Returns:
        data: input's shape, `dtype`. scale and amax: float32; tensorwise 0-d, rowwise (*, 1), blockwise
        (rows / block_m, K / block_k) over the (rows, K) view (divisions rounded up).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> x = torch.randn(64, 256)
        >>> t = kp_precision.quantize(x, torch.float8_e4m3fn, granularity="rowwise")
        >>> t.data.dtype, t.scale.shape, t.granularity
        (torch.float8_e4m3fn, torch.Size([64, 1]), 'rowwise')
        >>> kp_precision.quantize(x, granularity="blockwise", block=(32, 128)).scale.shape
        torch.Size([2, 2])
        >>> delayed = kp_precision.quantize(x, scale=torch.tensor(0.01))  # a given scale: one pass
    """
    kp_core.check_tensor(_NAME, "input", input, dtypes=DTYPES, min_ndim=1)
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{_NAME}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    block_m, block_k = _block(granularity, block, input)
    if scale is not None:
        if granularity != "tensorwise":
            raise ValueError(f"{_NAME}: a given scale is for granularity='tensorwise', got {granularity!r}")
        kp_core.check_tensor(_NAME, "scale", scale, dtypes=(torch.float32,), device=input.device)
        if scale.numel() != 1:
            raise ValueError(f"{_NAME}: scale must hold one value, got shape {tuple(scale.shape)}")
    kp_core.check_bool(_NAME, "power_of_2", power_of_2)
    return cast(input, dtype, (block_m, block_k), power_of_2, scale)


def dequantize(tensor: Float8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale over each block, rounded once to `dtype`.

    Args:
        tensor: a Float8Tensor, as quantize returns it.
        dtype: float16, bfloat16 or float32.

    Returns:
        tensor.data's shape, `dtype`.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> x = torch.randn(64, 256)
        >>> y = kp_precision.dequantize(kp_precision.quantize(x, granularity="rowwise"), torch.bfloat16)
        >>> y.dtype, bool(((y.float() - x).abs() <= 0.07 * x.abs().amax(1, keepdim=True)).all())
        (torch.bfloat16, True)
    """
    if not isinstance(tensor, Float8Tensor):
        raise TypeError(f"kp_precision.dequantize: tensor must be a Float8Tensor, got {type(tensor).__name__}")
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"kp_precision.dequantize: dtype must be float16, bfloat16 or float32, got {dtype}")
    expected = scale_shape(tuple(tensor.data.shape), *tensor.block)
    if tensor.data.dtype not in FP8_DTYPES or tuple(tensor.scale.shape) != expected:
        raise ValueError(
            f"kp_precision.dequantize: expected float8 data and a scale of shape {expected}, got "
            f"{tensor.data.dtype} and {tuple(tensor.scale.shape)}"
        )
    return tensor.dequantize(dtype)


_MM = "kp_precision.scaled_mm"


def _activation(op: str, activation: str | None) -> str:
    """The ops' name of a user's activation ('none' for None), after kp_core's check of the names they take."""
    return by_name(op, activation, (None, *mm.ACTIVATIONS)).name.lower()


def _check_scale(name: str, scale: object, rows: int, k: int, operand: str, device: torch.device) -> None:
    kp_core.check_tensor(_MM, name, scale, dtypes=(torch.float32,), device=device)
    if mm.scale_layout(scale, rows, k, operand) is None:
        kb, rb = kp_core.cdiv(k, mm.SCALE_K), kp_core.cdiv(rows, mm.SCALE_K)
        if operand == "a":
            shapes = f"(), ({rows}, 1), ({rows}, {kb}) or ({rb}, {kb})"
        else:
            shapes = f"(), (1, {rows}), ({kb}, {rows}) or ({kb}, {rb})"
        raise ValueError(
            f"{_MM}: {name} must be tensorwise, per {'row' if operand == 'a' else 'column'} or blockwise (128 along "
            f"K): a shape in {shapes}, got {tuple(scale.shape)}"
        )


def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """act((a * scale_a) @ (b * scale_b) + bias) as `out_dtype`, with a (M, K) and b (K, N) in float8.

    As torch._scaled_mm: a row-major, b column-major (b = w.t() of a row-major (N, K) weight), K and N multiples
    of 16, float32 dequantisation scales. scale_a is () (tensorwise), (M, 1) (per row), (M, K/128) (1 x 128 blocks)
    or (M/128, K/128); scale_b is (), (1, N) (per column), (K/128, N) or (K/128, N/128) (128 x 128 blocks of the
    weight: w's blockwise scale, transposed), divisions rounded up. The sum is float32; bias (N,) (float32 or
    out_dtype), the activation ('relu', 'gelu', 'gelu_tanh', 'silu' or None) and the cast are fused into it.
    use_fast_accum: as torch._scaled_mm's: False adds each 128-deep partial sum of Hopper's float8 tensor cores to
    the float32 sum (their own accumulator is narrower); True lets them sum all of K, faster and less exact. A
    precise call with scales constant along K runs on torch._scaled_mm where it takes the case (it is faster
    there); see kp_precision.ops.scaled_mm. float8_e5m2 x float8_e5m2 is refused, as torch._scaled_mm does.

    Args:
        a: (M, K), float8_e4m3fn or float8_e5m2, row-major.
        b: (K, N), float8_e4m3fn or float8_e5m2, column-major, a's device.
        scale_a: float32, a shape listed above.
        scale_b: float32, a shape listed above.
        bias: (N,), float32 or out_dtype.
        out_dtype: bfloat16, float16 or float32.

    Returns:
        (M, N) in out_dtype.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> x, w = torch.randn(32, 128), torch.randn(64, 128)  # activations (M, K), weight (N, K)
        >>> qx = kp_precision.quantize(x, granularity="rowwise")  # scale (M, 1)
        >>> qw = kp_precision.quantize(w, granularity="rowwise")  # scale (N, 1)
        >>> y = kp_precision.scaled_mm(
        ...     qx.data, qw.data.t(), qx.scale, qw.scale.t(), bias=torch.zeros(64), activation="relu"
        ... )
        >>> y.shape, y.dtype
        (torch.Size([32, 64]), torch.bfloat16)
    """
    kp_core.check_tensor(_MM, "a", a, dtypes=FP8_DTYPES, ndim=2)
    kp_core.check_tensor(_MM, "b", b, dtypes=FP8_DTYPES, ndim=2, device=a.device)
    m, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"{_MM}: b must have a's K = {k} rows (a is {tuple(a.shape)}), got {tuple(b.shape)}")
    n = b.shape[1]
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise TypeError(f"{_MM}: a and b are both float8_e5m2; one must be float8_e4m3fn (as torch._scaled_mm)")
    if k % ALIGN or n % ALIGN:
        raise ValueError(f"{_MM}: K and N must be multiples of {ALIGN} for float8 tensor cores, got K={k}, N={n}")
    if k > 1 and a.stride(1) != 1:
        raise ValueError(f"{_MM}: a must be row-major (stride (K, 1)), got strides {a.stride()}")
    if k > 1 and b.stride(0) != 1:
        raise ValueError(
            f"{_MM}: b must be column-major (stride (1, K)): pass w.t() of a row-major (N, K) weight, "
            f"got strides {b.stride()}"
        )
    _check_scale("scale_a", scale_a, m, k, "a", a.device)
    _check_scale("scale_b", scale_b, n, k, "b", a.device)
    if out_dtype not in mm.OUT_DTYPES:
        raise TypeError(f"{_MM}: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if bias is not None:
        kp_core.check_tensor(_MM, "bias", bias, dtypes=(out_dtype, torch.float32), device=a.device, ndim=1)
        kp_core.check_shape(_MM, "bias", bias, (n,))
    act = _activation(_MM, activation)
    kp_core.check_bool(_MM, "use_fast_accum", use_fast_accum)
    return mm.SCALED_MM(a, b, scale_a, scale_b, bias, act, out_dtype, use_fast_accum)


_MX = "kp_precision.mx_quantize"


def mx_quantize(input: torch.Tensor, elem: str = "fp8_e4m3") -> MXTensor:
    """`input` (..., K) in an MX format (OCP Microscaling v1.0): blocks of 32 along the last dim (K a multiple
    of 32), each with a power-of-two E8M0 scale from its amax (floor(log2 amax) minus the element format's
    largest exponent) and elements rounded to nearest-even with saturation. `elem`: 'fp8_e4m3', 'fp8_e5m2'
    (MXFP8) or 'fp4_e2m1' (MXFP4).

    Args:
        input: (*, K), K a multiple of 32; float16, bfloat16 or float32.

    Returns:
        An MXTensor: data (*, K) float8 (or (*, K / 2) uint8 for fp4_e2m1), scale (*, K / 32) uint8.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> m = kp_precision.mx_quantize(torch.randn(64, 128), "fp4_e2m1")
        >>> m.data.shape, m.data.dtype, m.scale.shape, m.shape
        (torch.Size([64, 64]), torch.uint8, torch.Size([64, 4]), torch.Size([64, 128]))
    """
    kp_core.check_tensor(_MX, "input", input, dtypes=DTYPES, min_ndim=1)
    if elem not in mx.ELEMENTS:
        raise ValueError(f"{_MX}: elem must be one of {tuple(mx.ELEMENTS)}, got {elem!r}")
    if input.shape[-1] % mx.BLOCK:
        raise ValueError(f"{_MX}: the last dim of input must be a multiple of 32 (MX blocks), got {tuple(input.shape)}")
    data, scale = mx.MX_QUANTIZE(input, elem)
    return MXTensor(data, scale, elem)


def mx_dequantize(tensor: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """elements * 2**(scale - 127) per block, rounded once to `dtype`.

    Args:
        tensor: an MXTensor, as mx_quantize returns it.
        dtype: float16, bfloat16 or float32.

    Returns:
        tensor.shape (*, K), `dtype`.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> x = torch.tensor([1.0, -0.5, 2.0, 0.25]).repeat(16).reshape(2, 32)  # representable: exact
        >>> y = kp_precision.mx_dequantize(kp_precision.mx_quantize(x, "fp8_e4m3"))
        >>> y.shape, y.dtype, torch.equal(y, x)
        (torch.Size([2, 32]), torch.float32, True)
    """
    _check_mx("kp_precision.mx_dequantize", "tensor", tensor)
    if dtype not in DTYPES:
        raise TypeError(f"kp_precision.mx_dequantize: dtype must be float16, bfloat16 or float32, got {dtype}")
    return tensor.dequantize(dtype)


def _check_mx(op: str, name: str, t: object) -> None:
    if not isinstance(t, MXTensor):
        raise TypeError(f"{op}: {name} must be an MXTensor (from kp_precision.mx_quantize), got {type(t).__name__}")
    if t.elem not in mx.ELEMENTS or t.scale.dtype != torch.uint8 or t.data.dtype != mx.ELEMENTS[t.elem][3]:
        raise ValueError(f"{op}: {name} is not a valid MXTensor ({t.elem!r}, {t.data.dtype}, scale {t.scale.dtype})")
    if tuple(t.data.shape) != mx.data_shape(tuple(t.shape), t.elem):
        raise ValueError(f"{op}: {name}'s data {tuple(t.data.shape)} does not match its scale {tuple(t.scale.shape)}")


def mx_matmul(a: MXTensor, b: MXTensor, *, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a (M, K) @ b (N, K).T for MX operands blocked along K (b as a weight is stored: (out, in)): per 32-deep
    block, the exact dot product of the elements times both scales, summed in float32. On Hopper this is an
    emulation (elements decoded in registers, TF32 tensor cores, exact for every MX element); hardware with MX
    tensor cores could take the same operands as they are.

    Args:
        a: an MXTensor of shape (M, K), any element format.
        b: an MXTensor of shape (N, K), on a's device.
        out_dtype: bfloat16, float16 or float32.

    Returns:
        (M, N) in out_dtype.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> a = kp_precision.mx_quantize(torch.randn(32, 128))
        >>> w = kp_precision.mx_quantize(torch.randn(64, 128), "fp4_e2m1")  # a weight as stored: (out, in)
        >>> kp_precision.mx_matmul(a, w, out_dtype=torch.float32).shape
        torch.Size([32, 64])
    """
    _check_mx("kp_precision.mx_matmul", "a", a)
    _check_mx("kp_precision.mx_matmul", "b", b)
    if a.scale.dim() != 2 or b.scale.dim() != 2 or a.scale.shape[1] != b.scale.shape[1]:
        raise ValueError(
            f"kp_precision.mx_matmul: a (M, K) and b (N, K) must share K, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    kp_core.check_same_device("kp_precision.mx_matmul", a=a.data, b=b.data)
    if out_dtype not in DTYPES:
        raise TypeError(f"kp_precision.mx_matmul: out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    return mx.MX_MATMUL(a.data, a.scale, b.data, b.scale, a.elem, b.elem, out_dtype)


_FQ = "kp_precision.fake_quantize"
QAT_FORMATS = {"int8": 127, "int4": 7, "fp8": None}


class _StraightThrough(torch.autograd.Function):
    """Forward: fn(x); backward: the gradient as it came (the straight-through estimator of rounding)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize(input: torch.Tensor, dtype: str = "int8", *, group_size: int | None = None) -> torch.Tensor:
    """Quantise and dequantise `input` (for quantisation-aware training), with a straight-through gradient.

    'int8' / 'int4': symmetric integers, scale = amax / 127 (or 7) per group of `group_size` elements of the last
    dim (None: per row), round half to even, clamp to [-128, 127] ([-8, 7]). 'fp8': float8 e4m3fn with a scale
    per row (kp_precision.quantize's rowwise recipe). The result has input's dtype.

    Args:
        input: (*, K), float16, bfloat16 or float32. Per-row integer scales take K up to a limit (set group_size
            beyond it).
        dtype: "int8", "int4" or "fp8".
        group_size: a power of two in [8, 1024] dividing K (integer formats only), or None.

    Returns:
        input's shape and dtype.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> w = torch.randn(64, 128, requires_grad=True)
        >>> q = kp_precision.fake_quantize(w, "int4", group_size=32)
        >>> q.shape, int(torch.unique(q[0, :32]).numel()) <= 16  # 16 levels per group
        (torch.Size([64, 128]), True)
        >>> q.sum().backward()  # straight through: the gradient is passed as it came
        >>> bool((w.grad == 1).all())
        True
    """
    kp_core.check_tensor(_FQ, "input", input, dtypes=DTYPES, min_ndim=1)
    if dtype not in QAT_FORMATS:
        raise ValueError(f"{_FQ}: dtype must be one of {tuple(QAT_FORMATS)}, got {dtype!r}")
    k = input.shape[-1]
    if group_size is not None:
        if dtype == "fp8":
            raise ValueError(f"{_FQ}: group_size is for the integer formats; fp8 scales per row")
        ok = isinstance(group_size, int) and not isinstance(group_size, bool) and 8 <= group_size <= 1024
        if not ok or group_size & (group_size - 1) or k % group_size:
            raise ValueError(
                f"{_FQ}: group_size must be a power of two in [8, 1024] dividing the last dim ({k}), got {group_size!r}"
            )
    elif dtype != "fp8" and k > fq.MAX_ROW:
        raise ValueError(f"{_FQ}: per-row scales take rows of at most {fq.MAX_ROW} elements, got {k}: set group_size")
    if dtype == "fp8":
        fn = lambda x: cast(x, torch.float8_e4m3fn, (1, 0), False).dequantize(x.dtype)  # noqa: E731
    else:
        fn = lambda x: fq.FAKE_QUANTIZE(x, QAT_FORMATS[dtype], group_size or 0)  # noqa: E731
    if input.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(input, fn)
    return fn(input)


_LA = "kp_precision.linear_activation"


def linear_activation(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = "gelu"
) -> torch.Tensor:
    """act(input @ weight.T + bias) for float16 / bfloat16, as F.linear then the activation, with the bias and
    activation ('relu', 'gelu', 'gelu_tanh', 'silu' or None) in the GEMM's epilogue: the sum in float32, one
    rounding. Differentiable: the backward takes act' from the saved pre-activation in one pass, then cuBLAS.

    Args:
        input: (*, K), float16 or bfloat16.
        weight: (N, K), input's dtype and device.
        bias: (N,), input's dtype and device.

    Returns:
        (*, N), input's dtype.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> import kp_precision
        >>> x, w, b = torch.randn(8, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16), None
        >>> y = kp_precision.linear_activation(x, w, b, "silu")
        >>> y.shape, torch.allclose(y.float(), F.silu(F.linear(x, w).float()), rtol=0.02, atol=0.02)
        (torch.Size([8, 32]), True)
    """
    kp_core.check_tensor(_LA, "input", input, dtypes=la.DTYPES, min_ndim=1)
    kp_core.check_tensor(_LA, "weight", weight, ndim=2, device=input.device)
    kp_core.check_same_dtype(_LA, "weight", weight, input, "input")
    k = input.shape[-1]
    if weight.shape[1] != k:
        raise ValueError(
            f"{_LA}: weight must be (out_features, {k}) for input {tuple(input.shape)}, got {tuple(weight.shape)}"
        )
    if bias is not None:
        kp_core.check_tensor(_LA, "bias", bias, device=input.device, ndim=1)
        kp_core.check_same_dtype(_LA, "bias", bias, input, "input")
        kp_core.check_shape(_LA, "bias", bias, (weight.shape[0],))
    act = _activation(_LA, activation)
    x2 = input.reshape(math.prod(input.shape[:-1]), k)
    x2 = x2 if x2.stride(-1) == 1 or k <= 1 else x2.contiguous()
    w = weight if weight.stride(-1) == 1 or k <= 1 else weight.contiguous()
    grads = any(t is not None and t.requires_grad for t in (input, weight, bias))
    y, _ = la.LINEAR_ACTIVATION(x2, w, bias, act, torch.is_grad_enabled() and grads)
    return y.reshape(*input.shape[:-1], weight.shape[0])
