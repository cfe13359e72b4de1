"""Cross-entropy over (rows, classes) logits: launchers, the PyTorch reference path and the op declaration.

Per row i with target t (class weights w, W = sum_j w_j; without weights w = 1), logits x, z = softcap *
tanh(x / softcap) with a softcap (Gemma 2) else x, lse = logsumexp_j z_j:

    loss_i = w_t ((1 - eps) (lse - z_t) + z_loss lse^2) + eps / C sum_j w_j (lse - z_j)
    dloss_i / dz_j = w_t ((1 - eps) + 2 z_loss lse) p_j - w_t (1 - eps) [j = t] + eps / C (W p_j - w_j)

with p = exp(z - lse) and dz/dx = 1 - (z / softcap)^2. The kernels keep lse as the row max m and s = sum exp(z - m),
and take differences from m (lse - z_t = (m - z_t) + log s, p = exp(z - m) / s): a row's offset costs no precision.

eps is torch's label_smoothing (its weighted form: the smoothing term is weighted per class, the rest by the
target's weight), z_loss PaLM's auxiliary loss (weighted by the target's weight, like the term it sits beside).
A row whose target is ignore_index has loss 0 and gradient 0; a target outside [0, C) (the public function checks
for one unless told not to) gets NaN, never a read out of bounds. Reductions are torch's, over these rows
(kp_losses.functional): "mean" divides by the counted rows' w_t.

The op kp::cross_entropy returns (loss per row, (m, s) per row) in fp32 for fp16/bf16 logits, fp64 for fp32/fp64;
its backward reads the logits again with the saved (m, s). Kernels: kp_losses.ops.cross_entropy_kernels. Spec:
conformance/specs/test_cross_entropy.py. fused_linear_cross_entropy (ops/linear_cross_entropy.py) runs the same
launchers on chunks of logits it computes.
"""

import functools
import struct
from typing import Optional

import torch

import kp_core

if kp_core.has_triton():
    import triton.language as tl

    from kp_losses.ops import cross_entropy_kernels as kernels

OP = "kp::cross_entropy"
OP_BWD = f"{OP}_backward"
PACKAGE = "kp-losses"
SPEC = "cross_entropy"
DTYPES = kp_core.FLOAT_DTYPES
# Classes per slice of a row and warps. H200, bf16, (m, s) kernels, 8192 x 128256 / 16384 x 32000 / 8192 x 256000
# rows (GB/s; a copy moves 4260-4300): the forward 3700 / 3460 / 3562 with 4 warps (8 warps: 3327 / 3045 / 3264;
# 16: 2364; 8K slices 3592), the backward's read and write 3741 / 3595 / 3720 with 16 (8 warps: 3693 / 3533 / 3674).
# The interpreter's slices are smaller, so that the specs' vocabularies span several of them (the running max and
# sum across slices) at a size it walks quickly.
TILES = {"_ce_fwd": dict(block_c=4096, num_warps=4), "_ce_bwd": dict(block_c=4096, num_warps=16)}
INTERPRET_BLOCK_C = 256


def row_dtype(dtype: torch.dtype) -> torch.dtype:
    """The per-row loss and statistics dtype, the kernels' arithmetic's: fp32 for fp16/bf16 logits, fp64 for fp32
    and fp64 ones. An fp32 row of 256K classes sums its exponentials and weighted logits in fp64 so its loss keeps
    fp32's precision, and its statistics stay fp64 for the backward: an lse rounded to fp32 (30) moved p by 2e-6
    relative, and p - 1 at the target (1e-4 where p is near 1) by 2 % (measured 5e-7 against torch's 2e-8)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64


@functools.lru_cache(maxsize=256)
def _tiles_for(kernel: str, c: int, interpret: bool, _generation: int) -> tuple[int, int]:
    s = kp_core.settings(kernel, **TILES[kernel])
    cap = INTERPRET_BLOCK_C if interpret else s["block_c"]
    return min(kp_core.next_power_of_2(c), cap), s["num_warps"]


def _tiles(kernel: str, c: int, backend: str) -> tuple[int, int]:
    return _tiles_for(kernel, c, backend == kp_core.INTERPRET, kp_core.tuning.generation())


def _bits(value: float) -> int:
    """A float64's bits as an int64 (the kernels' _real reads them back exactly)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _scalars(ignore_index, smoothing, z_loss, softcap) -> tuple:
    """The kernels' arguments after C: ignore_index, then the options as float64 bits."""
    return (ignore_index, _bits(smoothing), _bits(z_loss), _bits(softcap))


def _consts(x: torch.Tensor, weight, smoothing: float, softcap: float, block_c: int) -> dict:
    acc = tl.float32 if row_dtype(x.dtype) == torch.float32 else tl.float64
    return dict(
        HAS_WEIGHT=weight is not None, HAS_SOFTCAP=softcap != 0.0, SMOOTH=smoothing != 0.0, ACC=acc, BLOCK_C=block_c
    )


def mean_denominator(target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int, dtype) -> torch.Tensor:
    """torch's "mean" divisor: the counted rows' class weights summed (their count without weights)."""
    counted = target != ignore_index
    if weight is None:
        return counted.sum(dtype=dtype)
    return (weight.to(dtype)[target.long().clamp(0, weight.shape[0] - 1)] * counted).sum()


# ---- the reference path (CPU without the interpreter, KP_BACKEND=reference): the same maths in PyTorch ----


def _reference_terms(x, target, weight, ignore_index, softcap):
    acc = row_dtype(x.dtype)
    c = x.shape[1]
    z = x.to(acc)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    t = target.long()
    counted = t != ignore_index
    bad = counted & ((t < 0) | (t >= c))
    t = t.clamp(0, max(c - 1, 0))
    w = weight.to(acc) if weight is not None else torch.ones(c, dtype=acc, device=x.device)
    return z, t, w, counted, bad


def _reference_forward(x, target, weight, ignore_index, smoothing, z_loss, softcap):
    """(loss, stats): stats (rows, 2) the row max m and sum of exp(z - m), as the kernel saves them."""
    z, t, w, counted, bad = _reference_terms(x, target, weight, ignore_index, softcap)
    m = z.max(dim=1).values
    base = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)[:, None]
    s = torch.exp(z - base).sum(1)
    log_s = torch.log(s)
    lse = m + log_s
    z_t, w_t = z.gather(1, t[:, None])[:, 0], w[t]
    loss = w_t * ((1 - smoothing) * ((m - z_t) + log_s) + z_loss * lse * lse)
    if smoothing:
        loss = loss + smoothing / z.shape[1] * (w.sum() * log_s + (w * (base - z)).sum(1))
    loss = torch.where(counted, loss, torch.zeros_like(loss))
    return torch.where(bad, torch.full_like(loss, float("nan")), loss), torch.stack([m, s], 1)


def _reference_backward(g, x, target, weight, stats, ignore_index, smoothing, z_loss, softcap):
    z, t, w, counted, bad = _reference_terms(x, target, weight, ignore_index, softcap)
    m, s = (v.to(z.dtype)[:, None] for v in stats.unbind(1))
    p = torch.exp(z - m) / s
    lse = m + torch.log(s)
    w_t = w[t][:, None]
    d = w_t * ((1 - smoothing) + 2 * z_loss * lse) * p
    d = d - torch.nn.functional.one_hot(t, z.shape[1]).to(z.dtype) * w_t * (1 - smoothing)
    if smoothing:
        d = d + smoothing / z.shape[1] * (w.sum() * p - w)
    if softcap:
        d = d * (1 - (z / softcap) ** 2)
    d = torch.where(counted[:, None], g.to(z.dtype)[:, None] * d, torch.zeros_like(d))
    return torch.where(bad[:, None], torch.full_like(d, float("nan")), d)


# ---- launchers: x is (rows, C) with unit column stride; target, loss (rows,); stats (rows, 2) ----


def launch_forward(op, x, target, weight, loss, stats, ignore_index, smoothing, z_loss, softcap) -> None:
    """loss (rows,) and stats (rows, 2: the row max and sum of exponentials) written in place."""
    backend = kp_core.choose_backend(op, x)
    if backend == kp_core.REFERENCE:
        kp_core.reference(op)
        ref_loss, ref_stats = _reference_forward(x, target, weight, ignore_index, smoothing, z_loss, softcap)
        loss.copy_(ref_loss)
        stats.copy_(ref_stats)
        return
    rows, c = x.shape
    kp_core.check_index_fits(op, "the launch grid (rows)", rows)
    block_c, num_warps = _tiles("_ce_fwd", c, backend)
    args = (x, x.stride(0), target, weight, loss, stats, c, *_scalars(ignore_index, smoothing, z_loss, softcap))
    consts = _consts(x, weight, smoothing, softcap, block_c)
    kp_core.launch(op, backend, kernels._ce_fwd, (rows,), args, consts, num_warps)


def launch_backward(op, grad, x, dx, target, weight, stats, ignore_index, smoothing, z_loss, softcap) -> None:
    """dx (rows, C, unit column stride; may be x itself) = grad[i] * dloss_i/dx, written in place. grad: (rows,), any
    stride (an expanded scalar's is 0)."""
    backend = kp_core.choose_backend(op, x)
    if backend == kp_core.REFERENCE:
        kp_core.reference(op)
        dx.copy_(_reference_backward(grad, x, target, weight, stats, ignore_index, smoothing, z_loss, softcap))
        return
    rows, c = x.shape
    kp_core.check_index_fits(op, "the launch grid (rows)", rows)
    block_c, num_warps = _tiles("_ce_bwd", c, backend)
    # the smoothing term's W = sum_j w_j, one value on the device (no read back to the host); the forward sums it itself
    total = weight.sum(dtype=row_dtype(x.dtype)).reshape(1) if weight is not None and smoothing else x
    scalars = (*_scalars(ignore_index, smoothing, z_loss, softcap), total)
    args = (x, x.stride(0), dx, dx.stride(0), target, weight, stats, grad, grad.stride(0), c, *scalars)
    consts = _consts(x, weight, smoothing, softcap, block_c)
    kp_core.launch(op, backend, kernels._ce_bwd, (rows,), args, consts, num_warps)


def forward(
    input: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss per row, its (max, sum of exponentials) (rows, 2)), row_dtype, of a (rows, C) input with unit column
    stride; softcap 0: none."""
    loss, stats = _fake(input)
    if input.numel():
        launch_forward(OP, input, target, weight, loss, stats, ignore_index, label_smoothing, z_loss, softcap)
    else:  # no classes (the public function refuses them) or no rows: nothing to launch
        loss.zero_(), stats.zero_()
    return loss, stats


def backward(
    grad_loss: torch.Tensor,
    input: torch.Tensor,
    target: torch.Tensor,
    weight: Optional[torch.Tensor],
    stats: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    z_loss: float,
    softcap: float,
) -> torch.Tensor:
    """d(input), laid out as input."""
    dx = torch.empty_like(input)
    if dx.numel():
        if grad_loss is None:  # the statistics alone were used: they carry no gradient
            return dx.zero_()
        args = (ignore_index, label_smoothing, z_loss, softcap)
        launch_backward(OP_BWD, grad_loss, input, dx, target, weight, stats, *args)
    return dx


# ---- declaration ----


def _fake(input, *rest):
    dtype = row_dtype(input.dtype)
    return input.new_empty(input.shape[0], dtype=dtype), input.new_empty((input.shape[0], 2), dtype=dtype)


CROSS_ENTROPY = kp_core.op(
    OP,
    forward,
    _fake,
    backward=backward,
    backward_fake=lambda grad_loss, input, *rest: torch.empty_like(input),
    save=lambda args, outputs: (*args[:3], outputs[1]),  # input, target, weight, the row statistics
    grad_inputs=("input",),
    differentiable_outputs=1,  # the loss; the statistics are a by-product
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)
