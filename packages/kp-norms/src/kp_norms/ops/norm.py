"""Row norms: RMSNorm and LayerNorm, optionally after a residual add and before an activation, one kernel family.

Per row, with s = x + residual when there is one (rounded to the input dtype, as torch's add is):
    rms:    xc = s                 rstd = 1 / sqrt(mean(s**2) + eps)
    layer:  xc = s - mean(s)       rstd = 1 / sqrt(mean(xc**2) + eps)
    n = xc * rstd                  (rounded to the input dtype first when round_n: Llama's casting)
    y = act(n * (offset + w) + b)  (rounded once, when stored)

Backward, with z = n * (offset + w) + b, dz = dy * act'(z), dn = dz * (offset + w):
    dx = rstd * (dn - mean(dn) - n * mean(dn * n))   (rms drops mean(dn))   plus ds, the gradient of s
    dw = sum_rows(dz * n)      db = sum_rows(dz)
with n unrounded under round_n too (the rounding's derivative taken as 1: the exact-arithmetic gradient; summing
the rounded n's errors over rows made dw drift past the conformance rule where rows share one large element).
dw and db are summed from one fp32 partial per program by a second small kernel, so they are deterministic (no
atomics).

fp16/bf16 inputs are computed in fp32; fp32 and fp64 inputs in fp64. For fp32 that is what makes kp's results
more accurate than PyTorch's fp32 ops, which round after each step: a model patched with kp then stays at least
as close to its float64 twin as the unpatched model (with fp32 math the two were equal on average, and a whole
model's max error, a noisy statistic, came out up to 2.5x worse for either). The cost is fp64 arithmetic on the
fp32 path, cheap on data-centre GPUs (about half the fp32 rate) and much slower on consumer ones.

The kernels are in kp_norms.ops.norm_kernels; this module holds the launchers, the PyTorch reference
path and the two op declarations: kp::norm (with its backward) and kp::add_norm_ (in place, no autograd).
"""

import dataclasses
import functools
import math
import struct
from typing import NamedTuple, Optional

import torch

import kp_core
from kp_core import activation, float8

if kp_core.has_triton():
    import triton.language as tl

    from kp_norms.ops import norm_kernels as kernels

OP = "kp::norm"
OP_BWD = f"{OP}_backward"
OP_INPLACE = "kp::add_norm_"
OP_FP8 = "kp::norm_float8"
OP_FP8_BWD = f"{OP_FP8}_backward"
FP8_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the inputs a float8 output is made from
CAST_BLOCK_N = 2048  # columns per step of _cast_float8
PACKAGE = "kp-norms"
SPEC = "norm"
DTYPES = kp_core.FLOAT_DTYPES
PROGRAMS_PER_SM = 1  # backward: persistent programs per SM (each keeps two blocks of loads in flight)
SUM_BLOCK_N = 128  # columns per program of the partial-sum kernel


@functools.lru_cache(maxsize=8)
def _programs_per_sm_for(_generation: int) -> int:
    return kp_core.settings("_norm_bwd", programs_per_sm=PROGRAMS_PER_SM)["programs_per_sm"]


@functools.lru_cache(maxsize=1024)
def _tiles_for(kernel: str, n: int, element_size: int, _generation: int) -> kp_core.RowConfig:
    """kp_core.row_config, with rows per program and warps of the fused kernels pinnable per kernel
    (`kp_core.pin("_norm_fwd", block_rows=.., num_warps=..)`: benchmarks/bench_norm.py --tune)."""
    cfg = kp_core.row_config(kernel, n, element_size)
    if cfg.looped:
        return cfg
    s = kp_core.settings(kernel, block_rows=cfg.block_rows, num_warps=cfg.num_warps)
    return dataclasses.replace(cfg, block_rows=s["block_rows"], num_warps=s["num_warps"])


@functools.lru_cache(maxsize=64)
def split_eps(eps: float) -> tuple[float, float]:
    """eps as fp32 hi + lo halves (see norm_kernels._inv_rms)."""
    try:
        hi = struct.unpack("f", struct.pack("f", eps))[0]
    except OverflowError:  # beyond float32: it rounds to inf, as torch's fp32 eps would
        hi = math.copysign(math.inf, eps)
    return hi, (eps - hi) if math.isfinite(hi) else 0.0


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """kp's compute dtype: fp32 for fp16/bf16; fp64 for fp32 and fp64 (fp32 inputs are then rounded once, at the
    store, where PyTorch's own fp32 ops round after every step: see the module docstring)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64


def out_dtype(x: torch.Tensor, weight: Optional[torch.Tensor], round_n: bool) -> torch.dtype:
    """The input's dtype, except Llama's casting multiplies in the promoted dtype of input and weight."""
    return torch.promote_types(x.dtype, weight.dtype) if round_n and weight is not None else x.dtype


def _vector(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """A weight or bias the kernels can index as w[col]: a strided view is copied (it is one row)."""
    return t if t is None or t.stride(0) == 1 else t.contiguous()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose columns are unit-stride (rows may be strided); copies only when it must."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _tl_acc(dtype: torch.dtype):
    return tl.float32 if dtype in (torch.float16, torch.bfloat16) else tl.float64


# ---- reference path (CPU without the interpreter, or KP_BACKEND=reference) ----


def _reference_norm(s, weight, bias, eps, rms, offset, round_n, act):
    """(y, mean, rstd) from the formula in the accumulation dtype; autograd through it gives the backward."""
    xf = s.to(acc_dtype(s.dtype))
    mean = None if rms else xf.mean(-1)
    xc = xf if rms else xf - mean[:, None]
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    n = xc * rstd[:, None]
    w = None if weight is None else weight.to(xf.dtype) + offset
    if round_n:  # w multiplies n rounded to the input dtype; its gradient takes n unrounded, as the kernels' does
        n_r = n.to(s.dtype).to(xf.dtype)
        z = n_r if w is None else n_r * w.detach() + n * (w - w.detach())  # the second term is 0, dw = dy * n
    else:
        z = n if w is None else n * w
    z = z if bias is None else z + bias.to(xf.dtype)
    y = activation.reference(z, act).to(out_dtype(s, weight, round_n))
    return y, mean, rstd


def _reference_backward(dy, ds, s, weight, bias, eps, rms, offset, round_n, act):
    dx, dw, db = kp_core.vjp(
        lambda s, weight, bias: _reference_norm(s, weight, bias, eps, rms, offset, round_n, act)[0],
        (s, weight, bias),
        dy,
    )
    if ds is not None:
        dx = dx + ds
    return dx, dw, db


# ---- launchers: inputs are 2-D (rows, N); kp_norms.functional does the reshaping ----

# Per call signature, what a launch needs besides the tensors (kernel, tiles, constexprs), worked out once: an
# eager call then costs one cached lookup here instead of a dozen small steps.


def _generation() -> int:
    return kp_core.tuning.generation()


@functools.lru_cache(maxsize=1024)
def _forward_plan(dtype, n, rms, has_r, has_w, has_b, offset, round_n, act, stats, fp8, generation):
    """(kernel, rows per program (0: looped), constexprs, num_warps) of the forward; fp8: None or (mode, float8
    dtype, power_of_2, soft) of the float8 copy (kernels.ROW or TENSOR)."""
    cfg = _tiles_for("_norm_fwd", n, dtype.itemsize, generation)
    mode, dtype8, pow2, soft = fp8 or (0, torch.float8_e4m3fn, False, False)
    switches = dict(
        RMS=rms,
        HAS_R=has_r,
        HAS_W=has_w,
        HAS_B=has_b,
        OFFSET=offset,
        ROUND_N=round_n,
        ACT=act,
        STATS=stats,
        ACC=_tl_acc(dtype),
        FP8=mode,
    )
    if cfg.looped:
        return kernels._norm_fwd_looped, 0, kp_core.Constexprs(BLOCK_N=cfg.block_cols, **switches), cfg.num_warps
    cast = float8.cast_constexprs(dtype8, pow2, soft)
    consts = kp_core.Constexprs(BLOCK_M=cfg.block_rows, BLOCK_N=cfg.block_cols, **switches, **cast)
    return kernels._norm_fwd, cfg.block_rows, consts, cfg.num_warps


@functools.lru_cache(maxsize=256)
def _cast_plan(n, rowwise, dtype8, pow2, soft):
    """(constexprs, num_warps) of _cast_float8."""
    block_n = min(CAST_BLOCK_N, kp_core.next_power_of_2(n))
    cast = float8.cast_constexprs(dtype8, pow2, soft)
    return kp_core.Constexprs(BLOCK_N=block_n, ROWWISE=rowwise, **cast), 4 if block_n <= 1024 else 8


class BackwardPlan(NamedTuple):
    """What a backward launch needs besides the tensors (_backward_plan)."""

    cfg: kp_core.RowConfig  # tiles and warps of the main kernel
    slots: int  # programs the backward may spread over
    n_parts: int  # partial-sum arrays: dw's and db's (one when there is neither)
    buffers: int  # scratch arrays: the partials, and the looped Kahan kernel's compensations beside them
    kahan: bool  # compensated sums (see norm_kernels)
    acc: torch.dtype  # the partials' dtype
    consts: kp_core.Constexprs  # the main kernel's constexprs
    sum_consts: kp_core.Constexprs  # the partial-sum kernel's
    sum_grid: tuple[int]  # the partial-sum kernel's grid


@functools.lru_cache(maxsize=1024)
def _backward_plan(dtype, w_dtype, b_dtype, n, rms, has_ds, offset, round_n, act, device, generation) -> BackwardPlan:
    """The backward's launch plan; w_dtype/b_dtype are None without a weight/bias."""
    has_w, has_b = w_dtype is not None, b_dtype is not None
    cfg = _tiles_for("_norm_bwd", n, dtype.itemsize, generation)
    acc = acc_dtype(dtype)
    # Compensated sums where the result keeps fp32 precision from fp32 accumulation (see norm_kernels).
    kahan = acc == torch.float32 and torch.float32 in (w_dtype, b_dtype)
    # dw's and db's partials in one buffer; the looped kernel keeps its compensations beside them.
    n_parts = max(1, has_w + has_b)
    buffers = (2 if cfg.looped and kahan else 1) * n_parts
    per_sm = _programs_per_sm_for(generation)
    where = torch.device("cuda", device) if device >= 0 else torch.device("cpu")
    slots = kp_core.persistent_programs(where, 1 << 30, per_sm)  # programs the backward may spread over
    switches = dict(
        RMS=rms,
        HAS_DS=has_ds,
        HAS_W=has_w,
        HAS_B=has_b,
        OFFSET=offset,
        ROUND_N=round_n,
        ACT=act,
        KAHAN=kahan,
        ACC=_tl_acc(dtype),
    )
    consts = (
        kp_core.Constexprs(BLOCK_N=cfg.block_cols, **switches)
        if cfg.looped
        else kp_core.Constexprs(BLOCK_M=cfg.block_rows, BLOCK_N=cfg.block_cols, **switches)
    )
    block_n = min(SUM_BLOCK_N, kp_core.next_power_of_2(n))
    sum_consts = kp_core.Constexprs(BLOCK_P=32, BLOCK_N=block_n, HAS_W=has_w, HAS_B=has_b, ACC=_tl_acc(dtype))
    return BackwardPlan(cfg, slots, n_parts, buffers, kahan, acc, consts, sum_consts, (kp_core.cdiv(n, block_n),))


def _forward(op, x, residual, weight, bias, eps, rms, offset, round_n, act, stats, s_out=None, fp8=None):
    """(y, s, mean, rstd, cast) for 2-D x; s = x + residual (None without one), written into s_out when given; mean
    and rstd are None unless stats (mean for LayerNorm only). fp8: None, or (float8 dtype, rowwise, power_of_2)
    for cast = (data, scale, amax), y cast to float8 (scale and amax (M,) rowwise, 0-d tensorwise); else None."""
    backend = kp_core.choose_backend(op, x)
    has_r = residual is not None
    weight, bias = _vector(weight), _vector(bias)
    if backend == kp_core.REFERENCE or x.numel() == 0:
        kp_core.reference(op)
        s = x + residual if has_r else x
        if s_out is not None:
            s_out.copy_(s)
            s = s_out
        y, mean, rstd = _reference_norm(s, weight, bias, eps, rms, offset, round_n, act)
        cast = None if fp8 is None else float8.reference_cast(y, *fp8)
        return y, (s if has_r else None), mean, rstd, cast
    m, n = x.shape
    x = _rows(x)
    y = x.new_empty((m, n), dtype=out_dtype(x, weight, round_n))
    if has_r:
        residual = _rows(residual)
        s = x.new_empty((m, n)) if s_out is None else s_out
    else:
        s = residual = x  # never read or written
    if stats:
        rstd = x.new_empty((m,), dtype=acc_dtype(x.dtype))
        mean = rstd if rms else x.new_empty((m,), dtype=rstd.dtype)
    else:
        mean = rstd = y  # never written
    plan8 = cast = None
    q = q_bits = q_scale = q_amax = y  # never read or written without fp8
    if fp8 is not None:
        dtype8, rowwise, pow2 = fp8
        soft = float8.soft_float8(backend)
        plan8 = (kernels.ROW.value if rowwise else kernels.TENSOR.value, dtype8, pow2, soft)
        q = torch.empty((m, n), dtype=dtype8, device=x.device)
        q_bits = q.view(torch.uint8) if soft else q
        q_scale = torch.empty((m,) if rowwise else (), dtype=torch.float32, device=x.device)
        q_amax = torch.zeros((m,) if rowwise else (), dtype=torch.int32, device=x.device)  # float32 bits
    kernel, block_rows, consts, num_warps = _forward_plan(
        x.dtype, n, rms, has_r, weight is not None, bias is not None, offset, round_n, act, stats, plan8, _generation()
    )
    args = (
        x,
        x.stride(0),
        residual,
        residual.stride(0),
        s,
        s.stride(0),
        y,
        y.stride(0),
        x if weight is None else weight,
        x if bias is None else bias,
        mean,
        rstd,
    )
    eps_args = split_eps(eps)
    if block_rows == 0:  # looped: one program per row
        kp_core.launch(op, backend, kernel, (m,), (*args, q_amax, n, *eps_args), consts, num_warps)
    else:
        grid = (kp_core.cdiv(m, block_rows),)
        q_args = (q_bits, q_bits.stride(0), q_scale, q_amax)
        kp_core.launch(op, backend, kernel, grid, (*args, *q_args, m, n, *eps_args), consts, num_warps)
    if fp8 is not None:
        if block_rows == 0 or not rowwise:  # the cast from the amax the norm kernel left
            cast_consts, cast_warps = _cast_plan(n, rowwise, dtype8, pow2, soft)
            cast_args = (y, y.stride(0), q_bits, q_bits.stride(0), q_scale, q_amax, n)
            kp_core.launch(op, backend, kernels._cast_float8, (m,), cast_args, cast_consts, cast_warps)
        cast = (q, q_scale, q_amax.view(torch.float32))
    if not stats:
        return y, (s if has_r else None), None, None, cast
    return y, (s if has_r else None), (None if rms else mean), rstd, cast


def forward(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    offset: float,
    round_n: bool,
    act: int,
    stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, s, mean, rstd): s = x + residual (None without one); mean (LayerNorm) and rstd only with stats."""
    return _forward(OP, x, residual, weight, bias, eps, rms, offset, round_n, act, stats)[:4]


def forward_float8(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    offset: float,
    round_n: bool,
    act: int,
    stats: bool,
    fp8: torch.dtype,
    rowwise: bool,
    power_of_2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """forward's (y, s, mean, rstd), then y cast to float8 as (data, scale, amax): data as uint8 (the float8 bytes:
    the caller views it as fp8), scale and amax (M,) per row when rowwise, 0-d for the tensor."""
    cast = (fp8, rowwise, power_of_2)
    y, s, mean, rstd, (data, scale, amax) = _forward(
        OP_FP8, x, residual, weight, bias, eps, rms, offset, round_n, act, stats, fp8=cast
    )
    # float8 as its bytes: autograd and opcheck take a float8 output for a differentiable one
    return y, s, mean, rstd, data.view(torch.uint8), scale, amax


def backward(
    dy: Optional[torch.Tensor],
    ds: Optional[torch.Tensor],
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    rms: bool,
    offset: float,
    round_n: bool,
    act: int,
    stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dw, db) for 2-D x (the normalised input: s when there was a residual); ds, the gradient that reached
    s directly, is added to dx. dw/db are None when there is no weight/bias."""
    return _backward(OP_BWD, dy, ds, x, weight, bias, mean, rstd, eps, rms, offset, round_n, act)


def backward_float8(
    dy: Optional[torch.Tensor],
    ds: Optional[torch.Tensor],
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    eps: float,
    rms: bool,
    offset: float,
    round_n: bool,
    act: int,
    stats: bool,
    fp8: torch.dtype,
    rowwise: bool,
    power_of_2: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """backward, for kp::norm_float8 (the float8 copy is not differentiable)."""
    return _backward(OP_FP8_BWD, dy, ds, x, weight, bias, mean, rstd, eps, rms, offset, round_n, act)


def _backward(op, dy, ds, x, weight, bias, mean, rstd, eps, rms, offset, round_n, act):
    if ds is not None and ds.numel() == 0:  # no residual: the empty s output's (materialised) gradient
        ds = None
    if dy is None:  # only s was used
        dy = x.new_zeros(x.shape, dtype=out_dtype(x, weight, round_n))
    backend = kp_core.choose_backend(op, x)
    if backend == kp_core.REFERENCE or x.numel() == 0:
        kp_core.reference(op)
        return _reference_backward(dy, ds, x, weight, bias, eps, rms, offset, round_n, act)
    m, n = x.shape
    x, dy = _rows(x), _rows(dy)
    weight, bias = _vector(weight), _vector(bias)
    ds = None if ds is None else _rows(ds)
    has_w, has_b = weight is not None, bias is not None
    plan = _backward_plan(
        x.dtype,
        weight.dtype if has_w else None,
        bias.dtype if has_b else None,
        n,
        rms,
        ds is not None,
        offset,
        round_n,
        act,
        x.get_device(),
        _generation(),
    )
    rows_per_program = kp_core.cdiv(m, max(1, min(plan.slots, kp_core.cdiv(m, plan.cfg.block_rows))))
    programs = kp_core.cdiv(m, rows_per_program)
    dx = x.new_empty((m, n))
    parts = kp_core.workspace(x, (programs, n), plan.acc, count=plan.buffers)
    parts = parts if plan.buffers > 1 else (parts,)
    dw_part, db_part = parts[0], parts[plan.n_parts - 1]
    args = (
        dy,
        dy.stride(0),
        dx if ds is None else ds,
        0 if ds is None else ds.stride(0),
        x,
        x.stride(0),
        x if weight is None else weight,
        x if bias is None else bias,
        rstd if rms else mean,
        rstd,
        dx,
        dx.stride(0),
        dw_part,
        db_part,
    )
    if plan.cfg.looped:
        # dw's, db's compensations (unused without KAHAN)
        comps = (parts[plan.n_parts], parts[-1]) if plan.kahan else (dw_part, db_part)
        kernel, args = kernels._norm_bwd_looped, (*args, *comps, m, n, rows_per_program)
    else:
        kernel, args = kernels._norm_bwd, (*args, m, n, rows_per_program)
    kp_core.launch(op, backend, kernel, (programs,), args, plan.consts, plan.cfg.num_warps)
    dw = weight.new_empty(weight.shape) if has_w else None
    db = bias.new_empty(bias.shape) if has_b else None
    if has_w or has_b:
        sum_args = (dw_part, db_part, dw if has_w else dx, db if has_b else dx, programs, n)
        kp_core.launch(op, backend, kernels._norm_bwd_sum, plan.sum_grid, sum_args, plan.sum_consts, 4)
    return dx, dw, db


def add_norm_(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
    offset: float,
    round_n: bool,
    act: int,
) -> torch.Tensor:
    """y, with x + residual written into residual (2-D, unit column stride). No autograd: inference only."""
    return _forward(OP_INPLACE, x, residual, weight, bias, eps, rms, offset, round_n, act, False, residual)[0]


# ---- declarations ----


def _forward_fake(x, residual, weight, bias, eps, rms, offset, round_n, act, stats):
    m = x.shape[0]
    s = x.new_empty(x.shape) if residual is not None else None
    rstd = x.new_empty((m,), dtype=acc_dtype(x.dtype)) if stats else None
    mean = x.new_empty((m,), dtype=acc_dtype(x.dtype)) if stats and not rms else None
    return x.new_empty(x.shape, dtype=out_dtype(x, weight, round_n)), s, mean, rstd


def _backward_fake(dy, ds, x, weight, bias, mean, rstd, eps, rms, offset, round_n, act, stats):
    dw = None if weight is None else torch.empty_like(weight)
    db = None if bias is None else torch.empty_like(bias)
    return x.new_empty(x.shape), dw, db


def _save(args, outputs):
    x, residual, weight, bias = args[:4]
    y, s, mean, rstd = outputs[:4]
    return (x if residual is None else s), weight, bias, mean, rstd


NORM = kp_core.op(
    OP,
    forward,
    _forward_fake,
    backward=backward,
    backward_fake=_backward_fake,
    save=_save,
    grad_inputs=("x", "weight", "bias"),
    same_grad={"residual": "x"},
    differentiable_outputs=2,  # y and s; mean and rstd are statistics
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
    inline=True,  # traced into compiled graphs: packages/kp/tests/test_inline.py
)


def _forward_float8_fake(x, residual, weight, bias, eps, rms, offset, round_n, act, stats, fp8, rowwise, power_of_2):
    y, s, mean, rstd = _forward_fake(x, residual, weight, bias, eps, rms, offset, round_n, act, stats)
    shape = (x.shape[0],) if rowwise else ()
    scale, amax = (x.new_empty(shape, dtype=torch.float32) for _ in range(2))  # two tensors, not one twice
    return y, s, mean, rstd, x.new_empty(x.shape, dtype=torch.uint8), scale, amax


def _backward_float8_fake(dy, ds, x, weight, bias, mean, rstd, eps, rms, offset, round_n, act, stats, *cast):
    return _backward_fake(dy, ds, x, weight, bias, mean, rstd, eps, rms, offset, round_n, act, stats)


NORM_FLOAT8 = kp_core.op(
    OP_FP8,
    forward_float8,
    _forward_float8_fake,
    backward=backward_float8,
    backward_fake=_backward_float8_fake,
    save=_save,
    grad_inputs=("x", "weight", "bias"),
    same_grad={"residual": "x"},
    differentiable_outputs=2,  # y and s; the statistics and the float8 copy are not
    package=PACKAGE,
    spec=SPEC,
    dtypes=FP8_DTYPES,
    # Not inline (kp_core.library): launched by inductor, the rowwise weight gradient differed from kp's own
    # launch by an ulp on an H200 (cause not found yet; see docs/kp-core.md)
)


def _add_norm_fake(x, residual, weight, bias, eps, rms, offset, round_n, act):
    return x.new_empty(x.shape, dtype=out_dtype(x, weight, round_n))


ADD_NORM_ = kp_core.op(
    OP_INPLACE,
    add_norm_,
    _add_norm_fake,
    mutates_args=("residual",),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)
