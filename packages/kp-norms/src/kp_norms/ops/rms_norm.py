"""RMSNorm: Triton forward/backward kernels, their launchers, the custom ops and the functional API.

    rstd = 1 / sqrt(mean(x**2) + eps)        (per row, in fp32; fp64 for fp64 input)
    y    = (x * rstd * w).to(x.dtype)        (one rounding, as torch.nn.functional.rms_norm does)

Backward, with n = x * rstd and dn = dy * w:
    dx = rstd * (dn - n * mean(dn * n))      dw = sum_rows(dy * n)
dw is summed from one fp32 partial per program by torch, so it is deterministic (no atomics).
"""

import dataclasses
import functools
import math
import struct
from typing import Optional

import torch

import kp_core

OP = "kp::rms_norm"
OP_BWD = "kp::rms_norm_backward"
PACKAGE = "kp-norms"
DTYPES = kp_core.FLOAT_DTYPES

if kp_core.has_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _inv_rms(sum_sq, N, eps_hi, eps_lo, ACC: tl.constexpr):
        """1 / sqrt(sum_sq / N + eps), correctly rounded (the approximate fp32 ops cost ~2 ulp).

        Triton passes float arguments as fp32, so eps arrives as two fp32 halves (eps_hi + eps_lo) that
        rebuild it to ~48 bits for fp64 inputs; in fp32 the sum is just fp32(eps)."""
        eps = tl.cast(eps_hi, ACC) + tl.cast(eps_lo, ACC)
        if ACC == tl.float64:
            v = sum_sq / N + eps
            r = 1.0 / tl.sqrt(v)
            # The GPU backend may turn 1/sqrt into an approximate fp64 rsqrt (~2^-46 relative error, seen
            # on H100); one Newton step makes it exact to rounding. Rows with inf (r = 0) or a zero sum
            # (r = inf) keep r as is, so NaN/Inf propagate exactly as in the reference.
            r = tl.where((r > 0) & (r < float("inf")), r * (1.5 - 0.5 * v * r * r), r)
        else:
            r = tl.div_rn(1.0, tl.sqrt_rn(sum_sq / N + eps))
        return r

    @triton.jit
    def _rms_norm_fwd(
        X,
        stride_x,
        Y,
        stride_y,
        W,
        RSTD,
        M,
        N,
        eps_hi,
        eps_lo,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_W: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """y = x * rstd * w for BLOCK_M whole rows held in registers."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < N)[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(ACC)
        rstd = _inv_rms(tl.sum(x * x, axis=1), N, eps_hi, eps_lo, ACC)
        y = x * rstd[:, None]
        if HAS_W:
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
            y = y * w[None, :]
        tl.store(Y + rows64 * stride_y + cols[None, :], y, mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_ok)

    @triton.jit
    def _rms_norm_fwd_looped(
        X,
        stride_x,
        Y,
        stride_y,
        W,
        RSTD,
        M,  # unused: the grid has one program per row; kept so both forward kernels share a launch
        N,
        eps_hi,
        eps_lo,
        BLOCK_N: tl.constexpr,
        HAS_W: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """One row too wide for registers: a pass for the sum of squares, a pass to normalise.
        The first pass asks L2 to keep the row, so the second reads it from there, not from memory."""
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        y_row = Y + row * stride_y
        acc = tl.zeros([BLOCK_N], dtype=ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < N, other=0.0, eviction_policy="evict_last").to(ACC)
            acc += x * x
        rstd = _inv_rms(tl.sum(acc, axis=0), N, eps_hi, eps_lo, ACC)
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            x = tl.load(x_row + cols, mask=cols < N, other=0.0, eviction_policy="evict_first").to(ACC)
            y = x * rstd
            if HAS_W:
                y = y * tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)
            tl.store(y_row + cols, y, mask=cols < N)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_norm_bwd(
        DY,
        stride_dy,
        X,
        stride_x,
        W,
        RSTD,
        DX,
        stride_dx,
        DW_PART,
        M,
        N,
        rows_per_program,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HAS_W: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """Each program walks `rows_per_program` rows, BLOCK_M at a time, and writes one dw partial.

        The next block's x, dy and rstd are loaded before this block is computed: one persistent program
        per SM then keeps two blocks of loads in flight (without it the loop is latency-bound, ~1.4 TB/s).
        """
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(ACC)
        dw = tl.zeros([BLOCK_N], dtype=ACC)
        first = pid * rows_per_program
        last = tl.minimum(first + rows_per_program, M)
        rows = first + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x_next = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        dy_next = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
        rstd_next = tl.load(RSTD + rows, mask=rows < last, other=0.0)
        for _ in range(first, last, BLOCK_M):
            x, dy, rstd = x_next.to(ACC), dy_next.to(ACC), rstd_next
            out_rows64, out_mask = rows64, mask
            rows += BLOCK_M
            mask = (rows < last)[:, None] & col_ok[None, :]
            rows64 = rows.to(tl.int64)[:, None]
            x_next = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
            dy_next = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
            rstd_next = tl.load(RSTD + rows, mask=rows < last, other=0.0)
            n = x * rstd[:, None]
            if HAS_W:
                dn = dy * w[None, :]
                dw += tl.sum(dy * n, axis=0)
            else:
                dn = dy
            c = tl.sum(dn * n, axis=1) / N
            dx = (dn - n * c[:, None]) * rstd[:, None]
            tl.store(DX + out_rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=out_mask)
        if HAS_W:
            tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)

    @triton.jit
    def _rms_norm_bwd_looped(
        DY,
        stride_dy,
        X,
        stride_x,
        W,
        RSTD,
        DX,
        stride_dx,
        DW_PART,
        M,
        N,
        rows_per_program,
        BLOCK_N: tl.constexpr,
        HAS_W: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """Wide rows: per row, one pass for mean(dn * n), one for dx; the dw partial lives in DW_PART."""
        pid = tl.program_id(0)
        first = pid * rows_per_program
        last = tl.minimum(first + rows_per_program, M)
        dw_row = DW_PART + pid.to(tl.int64) * N
        # Row pointers advance by their stride: 64-bit pointer arithmetic, no int32 overflow.
        x_row = X + first.to(tl.int64) * stride_x
        dy_row = DY + first.to(tl.int64) * stride_dy
        dx_row = DX + first.to(tl.int64) * stride_dx
        for row in range(first, last):
            rstd = tl.load(RSTD + row)
            acc = tl.zeros([BLOCK_N], dtype=ACC)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                ok = cols < N
                x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(ACC)
                dy = tl.load(dy_row + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(ACC)
                if HAS_W:
                    dy = dy * tl.load(W + cols, mask=ok, other=0.0).to(ACC)
                acc += dy * x * rstd
            c = tl.sum(acc, axis=0) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                ok = cols < N
                x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(ACC)
                dy = tl.load(dy_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(ACC)
                n = x * rstd
                dn = dy
                if HAS_W:
                    dn = dy * tl.load(W + cols, mask=ok, other=0.0).to(ACC)
                    # Only this program touches this partial row, so read-modify-write is race-free.
                    part = tl.load(dw_row + cols, mask=ok, other=0.0)
                    tl.store(dw_row + cols, part + dy * n, mask=ok)
                dx = (dn - n * c) * rstd
                tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=ok)
            x_row += stride_x
            dy_row += stride_dy
            dx_row += stride_dx


# (block_rows, num_warps) a benchmark sweep may pin per op (benchmarks/bench_rms_norm.py --tune);
# empty in normal use.
CONFIG_OVERRIDE: dict[str, tuple[int, int]] = {}
PROGRAMS_PER_SM = 1  # backward: persistent programs per SM (each keeps two blocks of loads in flight)


def _config(op: str, n: int, element_size: int) -> kp_core.RowConfig:
    cfg = kp_core.row_config(op, n, element_size)
    if cfg.looped or op not in CONFIG_OVERRIDE:
        return cfg
    block_rows, num_warps = CONFIG_OVERRIDE[op]
    return dataclasses.replace(cfg, block_rows=block_rows, num_warps=num_warps)


@functools.lru_cache(maxsize=64)
def _split_eps(eps: float) -> tuple[float, float]:
    """eps as fp32 hi + lo halves (see _inv_rms)."""
    hi = struct.unpack("f", struct.pack("f", eps))[0]
    return hi, eps - hi


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose columns are unit-stride (rows may be strided); copies only when it must."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


# ---- reference path (CPU without the interpreter, or KP_BACKEND=reference) ----


def _reference_forward(x, weight, eps):
    xf = x.to(_acc_dtype(x.dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd[:, None]
    if weight is not None:
        y = y * weight.to(y.dtype)
    return y.to(x.dtype), rstd


def _reference_backward(dy, x, weight, rstd):
    acc = _acc_dtype(x.dtype)
    n = x.to(acc) * rstd[:, None]
    dyf = dy.to(acc)
    dn = dyf * weight.to(acc) if weight is not None else dyf
    dx = (dn - n * (dn * n).mean(-1, keepdim=True)) * rstd[:, None]
    dw = (dyf * n).sum(0).to(weight.dtype) if weight is not None else x.new_empty((0,))
    return dx.to(x.dtype), dw


# ---- launchers: inputs are 2-D (rows, N); the functional API below does the reshaping ----


def _backward_impl(dy, x, weight, rstd):
    """(dx, dw) for 2-D x; dw is an empty tensor when there is no weight."""
    backend = kp_core.choose_backend(OP_BWD, x)
    m, n = x.shape
    if backend == kp_core.REFERENCE or x.numel() == 0:
        kp_core.note_launch(OP_BWD, "reference", kp_core.REFERENCE)
        return _reference_backward(dy, x, weight, rstd)
    x, dy = _rows(x), _rows(dy)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cfg = _config(OP_BWD, n, x.element_size())
    programs = kp_core.persistent_programs(x.device, triton.cdiv(m, cfg.block_rows), PROGRAMS_PER_SM)
    rows_per_program = triton.cdiv(m, programs)
    programs = triton.cdiv(m, rows_per_program)
    has_w = weight is not None
    # Looped kernel accumulates in place, so its partials start at zero.
    alloc = torch.zeros if cfg.looped else torch.empty
    dw_part = alloc((programs, n) if has_w else (1,), dtype=_acc_dtype(x.dtype), device=x.device)
    w = weight if has_w else x  # any pointer; never read when HAS_W is False
    acc = _tl_acc(x.dtype)
    kernel, block_rows = (_rms_norm_bwd_looped, {}) if cfg.looped else (_rms_norm_bwd, {"BLOCK_M": cfg.block_rows})
    kernel[(programs,)](
        dy,
        dy.stride(0),
        x,
        x.stride(0),
        w,
        rstd,
        dx,
        dx.stride(0),
        dw_part,
        m,
        n,
        rows_per_program,
        **block_rows,
        BLOCK_N=cfg.block_cols,
        HAS_W=has_w,
        ACC=acc,
        num_warps=cfg.num_warps,
    )
    kp_core.note_launch(OP_BWD, kernel.fn.__name__, backend)
    dw = dw_part.sum(0).to(weight.dtype) if has_w else x.new_empty((0,))
    return dx, dw


def _forward_impl(x, weight, eps):
    """(y, rstd) for 2-D x."""
    backend = kp_core.choose_backend(OP, x)
    m, n = x.shape
    if backend == kp_core.REFERENCE or x.numel() == 0:
        kp_core.note_launch(OP, "reference", kp_core.REFERENCE)
        return _reference_forward(x, weight, eps)
    x = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty((m,), dtype=_acc_dtype(x.dtype), device=x.device)
    cfg = _config(OP, n, x.element_size())
    has_w = weight is not None
    w = weight if has_w else x
    acc = _tl_acc(x.dtype)
    if cfg.looped:  # one program per row
        kernel, grid, block_rows = _rms_norm_fwd_looped, m, {}
    else:
        kernel, grid, block_rows = _rms_norm_fwd, triton.cdiv(m, cfg.block_rows), {"BLOCK_M": cfg.block_rows}
    kernel[(grid,)](
        x,
        x.stride(0),
        y,
        y.stride(0),
        w,
        rstd,
        m,
        n,
        *_split_eps(eps),
        **block_rows,
        BLOCK_N=cfg.block_cols,
        HAS_W=has_w,
        ACC=acc,
        num_warps=cfg.num_warps,
    )
    kp_core.note_launch(OP, kernel.fn.__name__, backend)
    return y, rstd


# ---- torch.library ops (what torch.compile sees) and the eager autograd path ----


def _fwd_fake(x, weight, eps):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), x.new_empty((x.shape[0],), dtype=_acc_dtype(x.dtype))


def _bwd_fake(dy, x, weight, rstd):
    dw = x.new_empty((0,)) if weight is None else torch.empty_like(weight)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), dw


def _setup_context(ctx, inputs, output):
    x, weight, _eps = inputs
    ctx.save_for_backward(x, weight, output[1])


def _op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, (dw if weight is not None else None), None


@kp_core.custom_op(OP_BWD, package=PACKAGE, spec="rms_norm", dtypes=DTYPES, fake=_bwd_fake)
def rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor], rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dw); dw is an empty tensor when there is no weight (custom ops return no None)."""
    return _backward_impl(dy, x, weight, rstd)


@kp_core.custom_op(
    OP,
    package=PACKAGE,
    spec="rms_norm",
    dtypes=DTYPES,
    fake=_fwd_fake,
    backward=_op_backward,
    setup_context=_setup_context,
)
def rms_norm_op(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(x, weight, eps)


class _RMSNormFunction(torch.autograd.Function):
    """Eager calls skip the custom-op dispatch (tens of microseconds a call); the same launchers run either
    way. Even so, one eager forward+backward still costs more CPU time than a 64M-element step takes on an
    H100 (benchmarks/results/: CPU cost per call), so plain-launch timings there are CPU-bound."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward_impl(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward_impl(dy, x, weight, rstd)
        return dx, (dw if weight is not None else None), None


# ---- functional API (torch.nn.functional.rms_norm's signature and semantics) ----


def _check(input, normalized_shape, weight, eps):
    name = "kp_norms.rms_norm"
    kp_core.check_tensor(name, "input", input, dtypes=DTYPES)
    if isinstance(normalized_shape, int):
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
    if weight is not None:
        kp_core.check_tensor(name, "weight", weight, dtypes=DTYPES)
        kp_core.check_same_dtype(name, "weight", weight, input, "input")
        kp_core.check_same_device(name, input=input, weight=weight)
        kp_core.check_shape(name, "weight", weight, normalized_shape)
    if eps is not None and not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps >= 0):
        raise ValueError(f"{name}: eps must be a non-negative number or None, got {eps!r}")
    return normalized_shape


def rms_norm(
    input: torch.Tensor,
    normalized_shape: "int | list[int] | tuple[int, ...] | torch.Size",
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.rms_norm`.

    eps=None takes the epsilon of the compute dtype (fp32, or fp64 for fp64 input), which is what PyTorch's
    implementation does (its docs say `torch.finfo(input.dtype).eps`; for fp16/bf16 the code differs).
    """
    normalized_shape = _check(input, normalized_shape, weight, eps)
    if eps is None:
        eps = torch.finfo(_acc_dtype(input.dtype)).eps
    n = math.prod(normalized_shape)
    # Explicit row count, so zero-size inputs (rows or columns) reshape too.
    x2 = input.reshape(math.prod(input.shape[: input.dim() - len(normalized_shape)]), n)
    w = weight.reshape(n) if weight is not None else None
    if torch.compiler.is_compiling():
        y = rms_norm_op(x2, w, float(eps))[0]
    else:
        y = _RMSNormFunction.apply(x2, w, float(eps))
    return y.view(input.shape)
