"""Cross-entropy of a linear head's logits without the full logits: the launcher and the op declaration.

    logits = input @ weight.T + bias          (rows, V), made and consumed `chunk` rows at a time
    loss   = cross_entropy(logits, target, ...)  (kp_losses.ops.cross_entropy's maths and kernels)

Per chunk of rows: one GEMM makes its logits (input's dtype, cuBLAS through torch), _ce_fwd gives the rows' loss
and statistics, _ce_bwd writes the rows' gradient over the logits (the chunk buffer is this op's own), and two GEMMs
turn it into d(input) for those rows and d(weight) (+ d(bias)) for all of them:

    dinput[rows] = dlogits @ weight      dweight += dlogits.T @ input[rows]      dbias += dlogits.sum(0)

d(weight) and d(bias) sum over chunks in fp32 (cuBLAS' mixed GEMM writes into the fp32 sum: one rounding per chunk
into fp32, none into bf16), cast to the weight's dtype once at the end. With reduction "mean" or "sum" the
gradients are made in the forward, for a loss gradient of 1 (each row scaled by 1 / the mean's divisor), and the
backward scales them by the loss's actual gradient (a scalar): three GEMMs in all, as Liger-Kernel's. With "none"
the rows' gradients differ, so the forward keeps only the losses and the backward recomputes each chunk's logits
with them (four GEMMs). What is not needed (input, weight or bias without requires_grad) is not computed.

With `float8` (the op's last argument: 0, or a recipe of kp_losses.ops.linear_cross_entropy_float8) the GEMMs
run on float8 operands (kp-precision's quantize and scaled_mm), rows padded to a multiple of 16; tensorwise,
d(weight) is one float8 GEMM over every chunk's float8 gradient after the last chunk (no fp32 sum).

The peak memory is one chunk of logits (plus the fp32 sum of d(bias), and over several chunks that of d(weight))
instead of (rows, V) logits, their gradient and torch's fp32 softmax. Spec: conformance/specs/test_cross_entropy.py
(kernel "linear_cross_entropy").
"""

import functools
from typing import Optional

import torch
import torch.nn.functional as F

import kp_core
from kp_losses.ops import cross_entropy as ce
from kp_losses.ops import linear_cross_entropy_float8 as f8

OP = "kp::linear_cross_entropy"
OP_BWD = f"{OP}_backward"
DTYPES = kp_core.FLOAT_DTYPES
MEAN, SUM, NONE = 0, 1, 2  # the op's `reduction` (kp_losses.functional.REDUCTIONS' order)
# A chunk's logits: CHUNK_BYTES, at most a quarter of the free memory; rows a multiple of ROW_MULTIPLE (the GEMMs'
# tiles). H200, 8192 x 4096 x 128256 bf16, forward + backward: chunks of 512 / 1024 / 2048 / 4096 rows (125 MiB to
# 1 GiB of logits) took 51.5 / 43.2 / 39.1 / 39.0 ms (the three GEMMs alone: 38.0 ms), the peak growing with the
# chunk: 512 MiB (2048 rows there) is where the time stops falling. Every chunk adds its d(weight) product into an
# fp32 sum (read and written whole each time: 4 GiB a chunk there), so where all the logits take no more memory
# than that sum plus one chunk, one chunk of every row is taken and d(weight) is one GEMM.
CHUNK_BYTES = 512 << 20
ROW_MULTIPLE = 128


def chunk_rows(n: int, v: int, element_size: int, device: torch.device, requested: int, sum_bytes: int = 0) -> int:
    """Rows per chunk: `requested` (> 0); else every row where their logits take at most CHUNK_BYTES more than
    the fp32 sum of d(weight) that chunks need (`sum_bytes`; one chunk needs none: d(weight) is one GEMM), else
    CHUNK_BYTES of logits; at most a quarter of the free memory, in multiples of ROW_MULTIPLE; at least one row,
    at most n."""
    if requested > 0:
        return max(1, min(requested, n))
    whole, budget = CHUNK_BYTES + sum_bytes, CHUNK_BYTES
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] // 4
        whole, budget = min(whole, free), min(budget, free)
    if n * v * element_size <= whole:
        return max(1, n)
    rows = budget // max(1, v * element_size)
    rows = rows // ROW_MULTIPLE * ROW_MULTIPLE or max(1, min(rows, ROW_MULTIPLE))
    return max(1, min(rows, n))


@functools.cache
def _mixed_gemm(device_type: str) -> bool:
    """Whether torch has cuBLAS' bf16/fp16 x bf16/fp16 -> fp32 GEMM into an fp32 output here (addmm's out_dtype)."""
    if device_type != "cuda":
        return False
    try:
        a = torch.zeros(16, 16, dtype=torch.bfloat16, device="cuda")
        acc = torch.zeros(16, 16, device="cuda")
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        return True
    except (RuntimeError, TypeError):
        return False


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc fp32 or a's dtype: the products summed in fp32 and added to acc unrounded to a's dtype."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif _mixed_gemm(a.device.type):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # the operands widened (exact): fp32 GEMM, slower, the same sum
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _run(op, x, weight, target, bias, ce_weight, options, scale, needs, requested, float8):
    """(loss per row, dinput, dweight, dbias) over chunks of rows; scale (rows,): each row's loss gradient, or None
    for the losses alone. The gradients needed (`needs`) come back, the others None. float8: 0, or the float8
    recipe's number (linear_cross_entropy_float8)."""
    ignore_index, smoothing, z_loss, softcap = options
    n, h = x.shape
    v = weight.shape[0]
    need_x, need_w, need_b = needs if scale is not None else (False, False, False)
    head, pad = None, 0
    if float8:  # rows padded to the float8 GEMMs' multiple: zeros, their targets ignored, their gradients 0
        pad = -n % f8.ALIGN
        x, target = F.pad(x, (0, 0, 0, pad)), F.pad(target, (0, pad), value=ignore_index)
        scale = None if scale is None else F.pad(scale, (0, pad))
        g_scale = None
        if need_w and f8.RECIPES[float8 - 1] == "tensorwise":
            g_scale = f8.grad_scale(x, weight, bias, ce_weight, scale, z_loss, softcap, v)
        head = f8.Head(x, weight, float8, need_x, need_w, g_scale)
    rows = torch.empty(n + pad, dtype=ce.row_dtype(x.dtype), device=x.device)
    stats = torch.empty((n + pad, 2), dtype=rows.dtype, device=x.device)
    acc = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    dx = x.new_empty(x.shape) if need_x else None
    fp8_dw = head is not None and head.gt is not None  # d(weight) one float8 GEMM after the chunks
    sum_bytes = v * h * 4 if need_w and acc != weight.dtype and not fp8_dw else 0
    step = chunk_rows(n, v, x.element_size(), x.device, requested, sum_bytes)
    step = -(-step // f8.ALIGN) * f8.ALIGN if float8 else step
    one = step >= n + pad > 0  # one chunk: d(weight) one GEMM into the weight's dtype, no fp32 sum
    dw = torch.zeros(v, h, dtype=acc, device=x.device) if need_w and not (fp8_dw or one) else None
    db = torch.zeros(v, dtype=acc, device=x.device) if need_b else None
    for start in range(0, n + pad, step):
        end = min(start + step, n + pad)
        xc, tc = x[start:end], target[start:end]
        if head is not None:
            logits = head.logits(start, end, bias, x.dtype)
        else:
            logits = torch.mm(xc, weight.t()) if bias is None else torch.addmm(bias, xc, weight.t())
        ce.launch_forward(op, logits, tc, ce_weight, rows[start:end], stats[start:end], *options)
        if scale is None or not any(needs):
            continue
        ce.launch_backward(op, scale[start:end], logits, logits, tc, ce_weight, stats[start:end], *options)
        if head is not None:
            head.grads(logits, start, end, dx[start:end] if need_x else None, x.dtype)
        elif need_x:
            torch.mm(logits, weight, out=dx[start:end])
        if dw is not None:
            _accumulate(dw, logits.t(), xc)
        elif need_w and not fp8_dw:
            dw = torch.mm(logits.t(), xc)
        if need_b:
            db += logits.sum(0, dtype=acc)
    if fp8_dw:
        dw = head.weight_grad(weight.dtype)
    dx = None if dx is None else dx[:n]
    return rows[:n], dx, None if dw is None else dw.to(weight.dtype), None if db is None else db.to(bias.dtype)


def forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ce_weight: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    reduction: int,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
    chunk_size: int,
    float8: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, dinput, dweight, dbias): the loss reduced (a 0-d tensor) or per row ("none"), fp32 for fp16/bf16; the
    gradients for a loss gradient of 1 where the reduction is "mean" or "sum" and they are needed, else None."""
    options = (ignore_index, label_smoothing, z_loss, softcap)
    needs = (need_input, need_weight, need_bias and bias is not None)
    dtype = ce.row_dtype(input.dtype)
    denom = ce.mean_denominator(target, ce_weight, ignore_index, dtype) if reduction == MEAN else None
    scale = None
    if reduction != NONE and any(needs):
        scale = torch.ones((), dtype=dtype, device=input.device)
        scale = (scale if denom is None else scale / denom).expand(input.shape[0])
    rows, dx, dw, db = _run(OP, input, weight, target, bias, ce_weight, options, scale, needs, chunk_size, float8)
    if reduction == NONE:
        return rows, None, None, None
    loss = rows.sum()
    return (loss if denom is None else loss / denom), dx, dw, db


def backward(
    grad_loss: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ce_weight: Optional[torch.Tensor],
    dinput: Optional[torch.Tensor],
    dweight: Optional[torch.Tensor],
    dbias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
    reduction: int,
    need_input: bool,
    need_weight: bool,
    need_bias: bool,
    chunk_size: int,
    float8: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dinput, dweight, dbias): the forward's scaled by the loss's gradient, or ("none") recomputed per chunk with
    each row's."""
    needs = (need_input, need_weight, need_bias and bias is not None)
    if reduction == NONE:
        options = (ignore_index, label_smoothing, z_loss, softcap)
        return _run(OP_BWD, input, weight, target, bias, ce_weight, options, grad_loss, needs, chunk_size, float8)[1:]
    return tuple(None if g is None else g * grad_loss.to(g.dtype) for g in (dinput, dweight, dbias))


# ---- declaration ----


def _fake(input, weight, target, bias, ce_weight, ignore_index, smoothing, z_loss, softcap, reduction, *needs_etc):
    need_x, need_w, need_b = needs_etc[:3]  # then chunk_size, float8
    dtype = ce.row_dtype(input.dtype)
    loss = input.new_empty(input.shape[0] if reduction == NONE else (), dtype=dtype)
    if reduction == NONE:
        return loss, None, None, None
    return (loss, *_grads_like(input, weight, bias, need_x, need_w, need_b))


def _grads_like(input, weight, bias, need_x, need_w, need_b) -> tuple:
    grads = (need_x, input), (need_w, weight), (need_b and bias is not None, bias)
    return tuple(t.new_empty(t.shape) if need else None for need, t in grads)


def _backward_fake(grad_loss, input, weight, target, bias, ce_weight, dinput, dweight, dbias, *constants):
    need_x, need_w, need_b = constants[-5:-2]  # then chunk_size, float8
    return _grads_like(input, weight, bias, need_x, need_w, need_b)


LINEAR_CROSS_ENTROPY = kp_core.op(
    OP,
    forward,
    _fake,
    backward=backward,
    backward_fake=_backward_fake,
    save=lambda args, outputs: (*args[:5], *outputs[1:]),  # input, weight, target, bias, ce_weight, the gradients
    grad_inputs=("input", "weight", "bias"),
    differentiable_outputs=1,  # the loss; the gradients made in the forward are not outputs anyone differentiates
    package=ce.PACKAGE,
    spec=ce.SPEC,
    dtypes=DTYPES,
)
