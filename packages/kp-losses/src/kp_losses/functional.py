"""kp-losses' public functions: torch.nn.functional.cross_entropy's signature and results (class-index targets),
with PaLM's z-loss and Gemma 2's final-logit softcap, and the same loss from a head's hidden states and weight
without the full logits (fused_linear_cross_entropy).

Targets outside [0, C) (other than ignore_index) raise ValueError. The kernels never read out of bounds for them:
such a row's loss and gradient are NaN. VALIDATE_TARGETS says when the error comes:
    True (default)  on a CPU at the call; on a GPU the call's check runs on the device and a later call raises
                    (no synchronisation: the step that had the bad target returns NaN, the next one raises), as
                    kp-attention's decode reports its cache's bad values
    "sync"          at the call everywhere (on a GPU one flag read back a call: a synchronisation)
    False           never (NaN rows only)
Under torch.compile and CUDA-graph capture the check is skipped (NaN rows).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

import kp_core
from kp_losses.ops import cross_entropy as ce_ops
from kp_losses.ops import linear_cross_entropy as lce_ops
from kp_losses.ops import linear_cross_entropy_float8 as f8_ops

VALIDATE_TARGETS: bool | str = True
REDUCTIONS = ("mean", "sum", "none")
TARGET_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _check_options(op: str, reduction, label_smoothing, z_loss, softcap, ignore_index) -> float:
    """The options' values; softcap as the kernels take it (0.0: none)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{op}: ignore_index must be an int, got {type(ignore_index).__name__}")
    for name, value in (("label_smoothing", label_smoothing), ("z_loss", z_loss)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{op}: {name} must be a float, got {type(value).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing}")
    if not (math.isfinite(z_loss) and z_loss >= 0.0):
        raise ValueError(f"{op}: z_loss must be finite and >= 0, got {z_loss}")
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"{op}: softcap must be a float or None, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap > 0.0):
        raise ValueError(f"{op}: softcap must be finite and > 0 (or None), got {softcap}")
    return float(softcap)


def _check_chunk_size(op: str, chunk_size) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"{op}: chunk_size must be a positive int or None, got {chunk_size!r}")


def _check_target(op: str, target, shape: tuple, c: int, ignore_index: int, device) -> torch.Tensor:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{op}: target must be a torch.Tensor, got {type(target).__name__}")
    if target.is_floating_point():
        raise TypeError(
            f"{op}: target must hold class indices ({', '.join(str(d)[6:] for d in TARGET_DTYPES)}), got "
            f"{str(target.dtype)[6:]} (class-probability targets are not supported)"
        )
    kp_core.check_tensor(op, "target", target, dtypes=TARGET_DTYPES, device=device)
    if tuple(target.shape) != shape:
        raise ValueError(f"{op}: target must have shape {shape}, got {tuple(target.shape)}")
    checking = VALIDATE_TARGETS and target.numel() and not torch.compiler.is_compiling()
    if checking and not (target.is_cuda and torch.cuda.is_current_stream_capturing()):
        t = target.long()
        bad = (t != ignore_index) & ((t < 0) | (t >= c))
        if _reports_later(target):
            _later(op, bad)
        elif bool(bad.any()):
            first = t[bad][0].item()
            raise ValueError(f"{op}: target holds {first}, outside [0, {c}) and not ignore_index ({ignore_index})")
    return target.reshape(-1).contiguous()  # the kernels read targets at unit stride


def _reports_later(target: torch.Tensor) -> bool:
    """Whether this call's bad targets are reported by a later call (VALIDATE_TARGETS True, on a GPU)."""
    return VALIDATE_TARGETS is True and target.is_cuda


class _Flag:
    """A device's bad-target flag (set on the device by each checked call), its host copy (pinned on a GPU) and
    the copy's event."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.device = torch.zeros(1, dtype=torch.bool, device=device)
        self.host = torch.zeros(1, dtype=torch.bool, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False


_FLAGS: dict = {}


def _later(op: str, bad: torch.Tensor) -> None:
    """Raise if an earlier call's landed flag says it had bad targets (and clear it); then this call's bad rows
    into the device's flag and its copy back started. Never blocks."""
    index = bad.device.index
    key = (bad.device.type, torch.cuda.current_device() if bad.is_cuda and index is None else index)
    flag = _FLAGS.get(key) or _FLAGS.setdefault(key, _Flag(bad.device))
    if flag.pending and (flag.event is None or flag.event.query()):
        flag.pending = False
        if bool(flag.host[0]):
            flag.host.zero_()
            flag.device.zero_()
            raise ValueError(
                f"{op}: an earlier call's target held class indices outside [0, C) that are not ignore_index (its "
                "loss and gradient rows came out NaN); kp_losses.functional.VALIDATE_TARGETS = 'sync' raises at "
                "the call itself, at one synchronisation a call"
            )
    flag.device |= bad.any()
    flag.host.copy_(flag.device, non_blocking=flag.event is not None)
    if flag.event is not None:
        flag.event.record()
    flag.pending = True


def _check_recipe(op: str, float8) -> None:
    """float8 is None or a recipe name (the float8 option of the function, the module and patch)."""
    if float8 is not None and float8 not in f8_ops.RECIPES:
        raise ValueError(f"{op}: float8 must be None or one of {f8_ops.RECIPES}, got {float8!r}")


def _check_float8(op: str, float8, dtype: torch.dtype, v: int, h: int) -> int:
    """The op's float8 argument: 0, or 1 + the recipe's index (kp-precision imported, or ImportError)."""
    if float8 is None:
        return 0
    _check_recipe(op, float8)
    if dtype not in f8_ops.DTYPES:
        raise TypeError(f"{op}: float8 takes float16, bfloat16 or float32 inputs, got {str(dtype)[6:]}")
    if v % f8_ops.ALIGN or h % f8_ops.ALIGN:
        raise ValueError(
            f"{op}: float8 needs weight's dims to be multiples of {f8_ops.ALIGN} (float8 tensor cores), got ({v}, {h})"
        )
    f8_ops.kp_precision()
    return 1 + f8_ops.RECIPES.index(float8)


def _check_class_weight(op: str, name: str, weight, c: int, device) -> Optional[torch.Tensor]:
    if weight is None:
        return None
    kp_core.check_tensor(op, name, weight, dtypes=kp_core.FLOAT_DTYPES, device=device, ndim=1)
    if weight.shape[0] != c:
        raise ValueError(f"{op}: {name} must have one entry per class ({c}), got shape {tuple(weight.shape)}")
    return weight.contiguous()


def _reduce(rows: torch.Tensor, target: torch.Tensor, weight, ignore_index: int, reduction: str, shape, dtype):
    """torch's reductions of the per-row losses: "mean" divides by the counted rows' class weights (their count
    without weights), NaN where no row counts, as torch."""
    if reduction == "none":
        return rows.reshape(shape).to(dtype)
    total = rows.sum()
    if reduction == "sum":
        return total.to(dtype)
    return (total / ce_ops.mean_denominator(target, weight, ignore_index, rows.dtype)).to(dtype)


def cross_entropy(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """torch.nn.functional.cross_entropy for class-index targets, in one pass over the logits forward and one
    backward, plus z_loss * logsumexp^2 per counted row (PaLM) and logits capped as softcap * tanh(x / softcap)
    first (Gemma 2).

    Args:
        input: logits (C,), (N, C) or (N, C, d1, ...); float16, bfloat16, float32 or float64.
        target: class indices () , (N,) or (N, d1, ...), int64 / int32 / int16 / uint8.
        weight: per-class weights (C,), or None.
        ignore_index: a target value whose rows count for nothing.
        reduction: "mean" (over the counted rows' weights), "sum" or "none".
        label_smoothing: torch's, in [0, 1].
        z_loss: the z-loss coefficient (0: none), weighted like the row's loss.
        softcap: the final-logit cap (None: none).

    Returns:
        The loss in input's dtype: a scalar, or target's shape with reduction="none".

    Examples:
        >>> import torch
        >>> import kp_losses
        >>> logits, target = torch.randn(4, 10), torch.tensor([1, 0, -100, 9])
        >>> loss = kp_losses.cross_entropy(logits, target)
        >>> torch.allclose(loss, torch.nn.functional.cross_entropy(logits, target), atol=1e-5)
        True
    """
    op = "kp_losses.cross_entropy"
    kp_core.check_tensor(op, "input", input, dtypes=kp_core.FLOAT_DTYPES, min_ndim=1)
    cap = _check_options(op, reduction, label_smoothing, z_loss, softcap, ignore_index)
    c = input.shape[1] if input.dim() > 1 else input.shape[0]
    if c == 0:
        raise ValueError(f"{op}: input has no classes (shape {tuple(input.shape)})")
    shape = (input.shape[0], *input.shape[2:]) if input.dim() > 1 else ()
    flat = _check_target(op, target, shape, c, ignore_index, input.device)
    weight = _check_class_weight(op, "weight", weight, c, input.device)
    if input.dim() == 1:
        x = input[None]
    elif input.dim() == 2:
        x = input if input.stride(1) == 1 or c == 1 else input.contiguous()
    else:  # classes last, as rows: torch's layout puts them in dim 1
        x = input.movedim(1, -1).reshape(-1, c)
    rows, _ = ce_ops.CROSS_ENTROPY(x, flat, weight, ignore_index, float(label_smoothing), float(z_loss), cap)
    return _reduce(rows, flat, weight, ignore_index, reduction, shape, input.dtype)


def fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ce_weight: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    *,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    chunk_size: Optional[int] = None,
    out_dtype: Optional[torch.dtype] = None,
    float8: Optional[str] = None,
) -> torch.Tensor:
    """cross_entropy(input @ weight.T + bias, target, ...) without the full logits: they are made and consumed in
    chunks of rows (tokens), each chunk's gradient written over its logits and turned into the hidden states' and
    the weight's gradients at once, so the peak memory holds one chunk of logits, not (tokens, vocabulary).

    Args:
        input: hidden states (..., H); float16, bfloat16, float32 or float64.
        weight: the head's weight (V, H), input's dtype.
        target: class indices (...), as input's leading dims.
        bias: the head's bias (V,) or None.
        ce_weight: per-class weights of the loss (V,) or None (cross_entropy's `weight`).
        ignore_index: as cross_entropy's.
        reduction: as cross_entropy's.
        label_smoothing: as cross_entropy's.
        z_loss: as cross_entropy's.
        softcap: as cross_entropy's.
        chunk_size: rows per chunk (None: chosen from the vocabulary, the hidden size and the free memory).
        out_dtype: the loss's dtype (None: input's). The loss is computed in fp32 for fp16/bf16 inputs (fp64 for
            fp32 / fp64) and rounded once to it: torch.float32 gives what transformers computes on `logits.float()`.
        float8: None, or "tensorwise" / "rowwise": the head's three GEMMs on float8 operands, cast as kp-precision's
            float8 training recipes cast them (kp_losses.ops.linear_cross_entropy_float8; the `kp-losses[float8]`
            extra): faster, and a float8 linear's error in the loss and gradients. input float16, bfloat16 or
            float32; H and V multiples of 16.

    Returns:
        The loss in out_dtype: a scalar, or target's shape with reduction="none".

    Examples:
        >>> import torch
        >>> import kp_losses
        >>> h, w, t = torch.randn(6, 8), torch.randn(20, 8), torch.tensor([1, 2, 3, -100, 5, 19])
        >>> loss = kp_losses.fused_linear_cross_entropy(h, w, t)
        >>> torch.allclose(loss, torch.nn.functional.cross_entropy(h @ w.T, t), atol=1e-5)
        True
    """
    op = "kp_losses.fused_linear_cross_entropy"
    dtypes = lce_ops.DTYPES
    kp_core.check_tensor(op, "input", input, dtypes=dtypes, min_ndim=1)
    kp_core.check_tensor(op, "weight", weight, dtypes=dtypes, device=input.device, ndim=2)
    kp_core.check_same_dtype(op, "weight", weight, input, "input")
    cap = _check_options(op, reduction, label_smoothing, z_loss, softcap, ignore_index)
    v, h = weight.shape
    if input.shape[-1] != h:
        raise ValueError(f"{op}: input's last dim ({input.shape[-1]}) must be weight's dim 1 ({h})")
    if v == 0:
        raise ValueError(f"{op}: weight has no classes (shape {tuple(weight.shape)})")
    if bias is not None:
        kp_core.check_tensor(op, "bias", bias, device=input.device, ndim=1)
        kp_core.check_same_dtype(op, "bias", bias, input, "input")
        if bias.shape[0] != v:
            raise ValueError(f"{op}: bias must have shape ({v},) (weight's rows), got {tuple(bias.shape)}")
    shape = tuple(input.shape[:-1])
    flat = _check_target(op, target, shape, v, ignore_index, input.device)
    ce_weight = _check_class_weight(op, "ce_weight", ce_weight, v, input.device)
    _check_chunk_size(op, chunk_size)
    # GEMM operands cuBLAS reads as they are (row- or column-major); anything else is copied, so that a strided
    # view gives the contiguous call's result bit for bit
    x = input.reshape(-1, h)
    x = x if x.stride(1) == 1 or h == 1 else x.contiguous()
    weight = weight if 1 in weight.stride() else weight.contiguous()
    bias = bias if bias is None or bias.stride(0) == 1 else bias.contiguous()
    needs = [t is not None and t.requires_grad and torch.is_grad_enabled() for t in (x, weight, bias)]
    options = (ignore_index, float(label_smoothing), float(z_loss), cap, REDUCTIONS.index(reduction))
    if out_dtype is not None and out_dtype not in kp_core.FLOAT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be a floating dtype or None, got {out_dtype}")
    recipe = _check_float8(op, float8, input.dtype, v, h)
    loss = lce_ops.LINEAR_CROSS_ENTROPY(x, weight, flat, bias, ce_weight, *options, *needs, chunk_size or 0, recipe)[0]
    loss = loss.reshape(shape) if reduction == "none" else loss
    return loss.to(out_dtype or input.dtype)
