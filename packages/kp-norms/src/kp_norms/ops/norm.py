"""Row norms: RMSNorm and LayerNorm, optionally after a residual add and before an activation, one kernel.

Per row, with s = x + residual when there is one (rounded to the input dtype, as torch's add is):
    rms:    xc = s                 rstd = 1 / sqrt(mean(s**2) + eps)
    layer:  xc = s - mean(s)       rstd = 1 / sqrt(mean(xc**2) + eps)
    n = xc * rstd                  (rounded to the input dtype first when round_n: Llama's casting)
    y = act(n * (offset + w) + b)  (in fp32, fp64 for fp64 input; rounded once when stored)

Backward, with z = n * (offset + w) + b, dz = dy * act'(z), dn = dz * (offset + w):
    dx = rstd * (dn - mean(dn) - n * mean(dn * n))   (rms drops mean(dn))   plus ds, the gradient of s
    dw = sum_rows(dz * n)      db = sum_rows(dz)
dw and db are summed from one fp32 partial per program by torch, so they are deterministic (no atomics).
"""

import dataclasses
import functools
import struct
from typing import Optional

import torch

import kp_core
from kp_norms.ops import activation

OP = "kp::norm"
OP_BWD = "kp::norm_backward"
OP_INPLACE = "kp::add_norm_"
PACKAGE = "kp-norms"
SPEC = "norm"
DTYPES = kp_core.FLOAT_DTYPES

if kp_core.has_triton():
    import triton
    import triton.language as tl

    from kp_norms.ops.activation import act_fwd, act_grad

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
    def _affine(n, w, b, X_TY: tl.constexpr, OFFSET: tl.constexpr, ROUND_N: tl.constexpr, HAS_W: tl.constexpr,
                HAS_B: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
        """z = n * (offset + w) + b, with Llama's rounding of n when asked."""
        if ROUND_N:
            n = n.to(X_TY).to(ACC)
        z = n
        if HAS_W:
            if OFFSET != 0.0:
                w = w + OFFSET
            z = z * w
        if HAS_B:
            z = z + b
        return z

    @triton.jit
    def _norm_fwd(
        X, stride_x, R, stride_r, S, stride_s, Y, stride_y, W, B, MEAN, RSTD, M, N, eps_hi, eps_lo,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RMS: tl.constexpr, HAS_R: tl.constexpr,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr, OFFSET: tl.constexpr, ROUND_N: tl.constexpr,
        ACT: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        """BLOCK_M whole rows held in registers."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < M
        mask = row_ok[:, None] & (cols < N)[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        if HAS_R:
            x = x + tl.load(R + rows64 * stride_r + cols[None, :], mask=mask, other=0.0)
            tl.store(S + rows64 * stride_s + cols[None, :], x, mask=mask)
        x = x.to(ACC)
        if RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(mask, x - mean[:, None], 0.0)
            tl.store(MEAN + rows, mean, mask=row_ok)
        rstd = _inv_rms(tl.sum(xc * xc, axis=1), N, eps_hi, eps_lo, ACC)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)[None, :] if HAS_W else None
        b = tl.load(B + cols, mask=cols < N, other=0.0).to(ACC)[None, :] if HAS_B else None
        z = _affine(xc * rstd[:, None], w, b, X.dtype.element_ty, OFFSET, ROUND_N, HAS_W, HAS_B, ACC)
        tl.store(Y + rows64 * stride_y + cols[None, :], act_fwd(z, ACT), mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_ok)

    @triton.jit
    def _norm_fwd_looped(
        X, stride_x, R, stride_r, S, stride_s, Y, stride_y, W, B, MEAN, RSTD, M, N, eps_hi, eps_lo,
        BLOCK_N: tl.constexpr, RMS: tl.constexpr, HAS_R: tl.constexpr, HAS_W: tl.constexpr,
        HAS_B: tl.constexpr, OFFSET: tl.constexpr, ROUND_N: tl.constexpr, ACT: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        """One row too wide for registers (one program per row; M unused): a pass for the statistics, a pass
        to normalise. The first pass asks L2 to keep the row, so the second reads it from there.

        LayerNorm's mean and variance merge per chunk (Chan et al.): each chunk's centred sum of squares is
        exact in registers, so there is no sum-of-squares cancellation however large the mean."""
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        s_row = S + row * stride_s
        y_row = Y + row * stride_y
        zero = tl.zeros([BLOCK_N], dtype=ACC)
        acc = zero
        count = tl.sum(zero, axis=0)
        mean = count
        m2 = count
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_last")
            if HAS_R:
                x = x + tl.load(R + row * stride_r + cols, mask=ok, other=0.0, eviction_policy="evict_first")
                tl.store(s_row + cols, x, mask=ok, eviction_policy="evict_last")
            x = x.to(ACC)
            if RMS:
                acc += x * x
            else:
                k = tl.sum(ok.to(ACC), axis=0)
                c_mean = tl.sum(x, axis=0) / k
                c_dev = tl.where(ok, x - c_mean, 0.0)
                total = count + k
                delta = c_mean - mean
                mean = mean + delta * (k / total)
                m2 = m2 + tl.sum(c_dev * c_dev, axis=0) + delta * delta * (count * k / total)
                count = total
        if RMS:
            m2 = tl.sum(acc, axis=0)
        else:
            tl.store(MEAN + row, mean)
        rstd = _inv_rms(m2, N, eps_hi, eps_lo, ACC)
        src_row = s_row if HAS_R else x_row
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            x = tl.load(src_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(ACC)
            xc = x if RMS else x - mean
            w = tl.load(W + cols, mask=ok, other=0.0).to(ACC) if HAS_W else None
            b = tl.load(B + cols, mask=ok, other=0.0).to(ACC) if HAS_B else None
            z = _affine(xc * rstd, w, b, X.dtype.element_ty, OFFSET, ROUND_N, HAS_W, HAS_B, ACC)
            tl.store(y_row + cols, act_fwd(z, ACT), mask=ok)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _dz_and_n(x, dy, mean, rstd, w, b, mask, X_TY: tl.constexpr, RMS: tl.constexpr, HAS_W: tl.constexpr,
                  HAS_B: tl.constexpr, OFFSET: tl.constexpr, ROUND_N: tl.constexpr, ACT: tl.constexpr,
                  ACC: tl.constexpr):  # fmt: skip
        """n (zero outside the row), the n that multiplied w, and dz = dy * act'(z)."""
        xc = x if RMS else tl.where(mask, x - mean, 0.0)
        n = xc * rstd
        n_w = n.to(X_TY).to(ACC) if ROUND_N else n
        dz = dy
        if ACT != 0:
            dz = dy * act_grad(_affine(n, w, b, X_TY, OFFSET, ROUND_N, HAS_W, HAS_B, ACC), ACT)
        return n, n_w, dz

    @triton.jit
    def _norm_bwd(
        DY, stride_dy, DS, stride_ds, X, stride_x, W, B, MEAN, RSTD, DX, stride_dx, DW_PART, DB_PART,
        M, N, rows_per_program,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RMS: tl.constexpr, HAS_DS: tl.constexpr,
        HAS_W: tl.constexpr, HAS_B: tl.constexpr, OFFSET: tl.constexpr, ROUND_N: tl.constexpr,
        ACT: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        """Each program walks `rows_per_program` rows, BLOCK_M at a time, and writes one dw/db partial.

        The next block's x and dy are loaded before this block is computed: one persistent program per
        SM then keeps two blocks of loads in flight (without it the loop is latency-bound, ~1.4 TB/s)."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(ACC)[None, :] if HAS_W else None
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(ACC)[None, :] if HAS_B else None
        w_eff = (w + OFFSET if OFFSET != 0.0 else w) if HAS_W else None
        dw = tl.zeros([BLOCK_N], dtype=ACC)
        db = tl.zeros([BLOCK_N], dtype=ACC)
        first = pid * rows_per_program
        last = tl.minimum(first + rows_per_program, M)
        rows = first + tl.arange(0, BLOCK_M)
        mask = (rows < last)[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x_next = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        dy_next = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
        for _ in range(first, last, BLOCK_M):
            x, dy = x_next.to(ACC), dy_next.to(ACC)
            cur_rows, cur_rows64, cur_mask = rows, rows64, mask
            rows += BLOCK_M
            mask = (rows < last)[:, None] & col_ok[None, :]
            rows64 = rows.to(tl.int64)[:, None]
            x_next = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
            dy_next = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0)
            row_ok = cur_rows < last
            rstd = tl.load(RSTD + cur_rows, mask=row_ok, other=0.0)[:, None]
            mean = None if RMS else tl.load(MEAN + cur_rows, mask=row_ok, other=0.0)[:, None]
            n, n_w, dz = _dz_and_n(x, dy, mean, rstd, w, b, cur_mask, X.dtype.element_ty, RMS, HAS_W, HAS_B,
                                   OFFSET, ROUND_N, ACT, ACC)  # fmt: skip
            dn = dz
            if HAS_W:
                dn = dz * w_eff
                dw += tl.sum(dz * n_w, axis=0)
            if HAS_B:
                db += tl.sum(dz, axis=0)
            dx = dn - n * (tl.sum(dn * n, axis=1) / N)[:, None]
            if not RMS:
                dx = dx - (tl.sum(dn, axis=1) / N)[:, None]
            dx = dx * rstd
            if HAS_DS:
                dx += tl.load(DS + cur_rows64 * stride_ds + cols[None, :], mask=cur_mask, other=0.0).to(ACC)
            tl.store(DX + cur_rows64 * stride_dx + cols[None, :], dx, mask=cur_mask)
        if HAS_W:
            tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)
        if HAS_B:
            tl.store(DB_PART + pid * N + cols, db, mask=col_ok)

    @triton.jit
    def _norm_bwd_looped(
        DY, stride_dy, DS, stride_ds, X, stride_x, W, B, MEAN, RSTD, DX, stride_dx, DW_PART, DB_PART,
        M, N, rows_per_program,
        BLOCK_N: tl.constexpr, RMS: tl.constexpr, HAS_DS: tl.constexpr, HAS_W: tl.constexpr,
        HAS_B: tl.constexpr, OFFSET: tl.constexpr, ROUND_N: tl.constexpr, ACT: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        """Wide rows: per row, one pass for mean(dn * n) and mean(dn), one for dx; partials in DW/DB_PART."""
        pid = tl.program_id(0)
        first = pid * rows_per_program
        last = tl.minimum(first + rows_per_program, M)
        dw_row = DW_PART + pid.to(tl.int64) * N
        db_row = DB_PART + pid.to(tl.int64) * N
        # Row pointers advance by their stride: 64-bit pointer arithmetic, no int32 overflow.
        x_row = X + first.to(tl.int64) * stride_x
        dy_row = DY + first.to(tl.int64) * stride_dy
        ds_row = DS + first.to(tl.int64) * stride_ds
        dx_row = DX + first.to(tl.int64) * stride_dx
        for row in range(first, last):
            rstd = tl.load(RSTD + row)
            mean = None if RMS else tl.load(MEAN + row)
            acc_nn = tl.zeros([BLOCK_N], dtype=ACC)
            acc_n = tl.zeros([BLOCK_N], dtype=ACC)
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                ok = cols < N
                x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(ACC)
                dy = tl.load(dy_row + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(ACC)
                w = tl.load(W + cols, mask=ok, other=0.0).to(ACC) if HAS_W else None
                b = tl.load(B + cols, mask=ok, other=0.0).to(ACC) if HAS_B else None
                n, n_w, dn = _dz_and_n(x, dy, mean, rstd, w, b, ok, X.dtype.element_ty, RMS, HAS_W, HAS_B,
                                       OFFSET, ROUND_N, ACT, ACC)  # fmt: skip
                if HAS_W:
                    dn = dn * (w + OFFSET if OFFSET != 0.0 else w)
                acc_nn += dn * n
                acc_n += dn
            c1 = tl.sum(acc_nn, axis=0) / N
            c2 = tl.sum(acc_n, axis=0) / N
            for start in range(0, N, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                ok = cols < N
                x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(ACC)
                dy = tl.load(dy_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(ACC)
                w = tl.load(W + cols, mask=ok, other=0.0).to(ACC) if HAS_W else None
                b = tl.load(B + cols, mask=ok, other=0.0).to(ACC) if HAS_B else None
                n, n_w, dz = _dz_and_n(x, dy, mean, rstd, w, b, ok, X.dtype.element_ty, RMS, HAS_W, HAS_B,
                                       OFFSET, ROUND_N, ACT, ACC)  # fmt: skip
                dn = dz
                # Only this program touches its partial rows, so read-modify-write is race-free.
                if HAS_W:
                    dn = dz * (w + OFFSET if OFFSET != 0.0 else w)
                    tl.store(dw_row + cols, tl.load(dw_row + cols, mask=ok, other=0.0) + dz * n_w, mask=ok)
                if HAS_B:
                    tl.store(db_row + cols, tl.load(db_row + cols, mask=ok, other=0.0) + dz, mask=ok)
                dx = dn - n * c1
                if not RMS:
                    dx = dx - c2
                dx = dx * rstd
                if HAS_DS:
                    dx += tl.load(ds_row + cols, mask=ok, other=0.0).to(ACC)
                tl.store(dx_row + cols, dx, mask=ok)
            x_row += stride_x
            dy_row += stride_dy
            ds_row += stride_ds
            dx_row += stride_dx


@dataclasses.dataclass(frozen=True)
class Variant:
    """What a call computes besides the row statistics (see the module docstring)."""

    rms: bool = True
    offset: float = 0.0
    round_n: bool = False  # Llama casting: n is rounded to the input dtype before the weight
    act: int = activation.NONE


# (block_rows, num_warps) a benchmark sweep may pin per op (benchmarks/bench_norms.py --tune); empty normally.
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


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def out_dtype(x: torch.Tensor, weight: Optional[torch.Tensor], v: Variant) -> torch.dtype:
    """The input's dtype, except Llama's casting multiplies in the promoted dtype of input and weight."""
    return torch.promote_types(x.dtype, weight.dtype) if v.round_n and weight is not None else x.dtype


def _tl_acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view whose columns are unit-stride (rows may be strided); copies only when it must."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _empty(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,))


# ---- reference path (CPU without the interpreter, or KP_BACKEND=reference) ----


def _reference_norm(s, weight, bias, eps, v: Variant):
    """(y, mean, rstd) from the formula in the accumulation dtype; autograd through it gives the backward."""
    xf = s.to(acc_dtype(s.dtype))
    mean = xf.mean(-1) if not v.rms else None
    xc = xf if v.rms else xf - mean[:, None]
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    n = xc * rstd[:, None]
    if v.round_n:
        n = n.to(s.dtype).to(xf.dtype)
    z = n if weight is None else n * (weight.to(xf.dtype) + v.offset)
    z = z if bias is None else z + bias.to(xf.dtype)
    y = activation.reference(z, v.act).to(out_dtype(s, weight, v))
    return y, (mean if mean is not None else _empty(xf)), rstd


def _reference_backward(dy, ds, s, weight, bias, eps, v: Variant):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() if t is not None else None for t in (s, weight, bias)]
        y = _reference_norm(*leaves, eps, v)[0]
        grads = torch.autograd.grad(y, [t for t in leaves if t is not None], dy, allow_unused=True)
    grads = iter(grads)
    dx, dw, db = (next(grads) if t is not None else None for t in leaves)
    if ds is not None:
        dx = dx + ds
    return dx, (dw if dw is not None else _empty(s)), (db if db is not None else _empty(s))


# ---- launchers: inputs are 2-D (rows, N); kp_norms.functional does the reshaping ----


def forward_impl(x, residual, weight, bias, eps, v: Variant, s_out=None):
    """(y, s, mean, rstd) for 2-D x. s = x + residual (empty without a residual), written into s_out when
    given; mean is empty for RMSNorm."""
    backend = kp_core.choose_backend(OP, x)
    m, n = x.shape
    has_r = residual is not None
    if backend == kp_core.REFERENCE or x.numel() == 0:
        kp_core.note_launch(OP, "reference", kp_core.REFERENCE)
        s = x + residual if has_r else x
        if s_out is not None:
            s_out.copy_(s)
            s = s_out
        y, mean, rstd = _reference_norm(s, weight, bias, eps, v)
        return y, (s if has_r else _empty(x)), mean, rstd
    x = _rows(x)
    acc = acc_dtype(x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype(x, weight, v), device=x.device)
    if has_r:
        residual = _rows(residual)
        s = s_out if s_out is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        s = residual = x  # never read or written
    rstd = torch.empty((m,), dtype=acc, device=x.device)
    mean = rstd if v.rms else torch.empty((m,), dtype=acc, device=x.device)
    cfg = _config(OP, n, x.element_size())
    if cfg.looped:  # one program per row
        kernel, grid, block_rows = _norm_fwd_looped, m, {}
    else:
        kernel, grid, block_rows = _norm_fwd, triton.cdiv(m, cfg.block_rows), {"BLOCK_M": cfg.block_rows}
    kernel[(grid,)](
        x, x.stride(0), residual, residual.stride(0), s, s.stride(0), y, y.stride(0),
        weight if weight is not None else x, bias if bias is not None else x, mean, rstd, m, n, *_split_eps(eps),
        **block_rows, BLOCK_N=cfg.block_cols, RMS=v.rms, HAS_R=has_r, HAS_W=weight is not None,
        HAS_B=bias is not None, OFFSET=float(v.offset), ROUND_N=v.round_n, ACT=v.act, ACC=_tl_acc(x.dtype),
        num_warps=cfg.num_warps,
    )  # fmt: skip
    kp_core.note_launch(OP, kernel.fn.__name__, backend)
    return y, (s if has_r else _empty(x)), (_empty(x) if v.rms else mean), rstd


def backward_impl(dy, ds, x, weight, bias, mean, rstd, eps, v: Variant):
    """(dx, dw, db) for 2-D x (the normalised input: s when there was a residual). ds, the gradient that
    reached s directly, is added to dx. dw/db are empty tensors when there is no weight/bias."""
    backend = kp_core.choose_backend(OP_BWD, x)
    m, n = x.shape
    if backend == kp_core.REFERENCE or x.numel() == 0:
        kp_core.note_launch(OP_BWD, "reference", kp_core.REFERENCE)
        return _reference_backward(dy, ds, x, weight, bias, eps, v)
    x, dy = _rows(x), _rows(dy)
    ds = _rows(ds) if ds is not None else None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cfg = _config(OP_BWD, n, x.element_size())
    programs = kp_core.persistent_programs(x.device, triton.cdiv(m, cfg.block_rows), PROGRAMS_PER_SM)
    rows_per_program = triton.cdiv(m, programs)
    programs = triton.cdiv(m, rows_per_program)
    # The looped kernel accumulates in place, so its partials start at zero.
    alloc = torch.zeros if cfg.looped else torch.empty
    # One buffer holds the dw and db partials, so one reduction launch sums both.
    has = [t is not None for t in (weight, bias)]
    parts = alloc((max(1, sum(has)), programs, n), dtype=acc_dtype(x.dtype), device=x.device)
    dw_part, db_part = parts[0], parts[-1]
    if cfg.looped:
        kernel, block_rows = _norm_bwd_looped, {}
    else:
        kernel, block_rows = _norm_bwd, {"BLOCK_M": cfg.block_rows}
    kernel[(programs,)](
        dy, dy.stride(0), ds if ds is not None else dy, ds.stride(0) if ds is not None else 0, x, x.stride(0),
        weight if weight is not None else x, bias if bias is not None else x, mean if not v.rms else rstd, rstd,
        dx, dx.stride(0), dw_part, db_part, m, n, rows_per_program,
        **block_rows, BLOCK_N=cfg.block_cols, RMS=v.rms, HAS_DS=ds is not None, HAS_W=weight is not None,
        HAS_B=bias is not None, OFFSET=float(v.offset), ROUND_N=v.round_n, ACT=v.act, ACC=_tl_acc(x.dtype),
        num_warps=cfg.num_warps,
    )  # fmt: skip
    kp_core.note_launch(OP_BWD, kernel.fn.__name__, backend)
    sums = parts.sum(1) if any(has) else None
    # Own storage for each (for fp32 weights too): a custom op's outputs are fresh tensors, not views.
    dw = sums[0].to(weight.dtype, copy=True) if has[0] else _empty(x)
    db = sums[-1].to(bias.dtype, copy=True) if has[1] else _empty(x)
    return dx, dw, db


# ---- torch.library ops (what torch.compile sees) and the eager autograd path ----


def _variant(rms, offset, round_n, act) -> Variant:
    return Variant(bool(rms), float(offset), bool(round_n), int(act))


def _fwd_fake(x, residual, weight, bias, eps, rms, offset, round_n, act):
    v = _variant(rms, offset, round_n, act)
    m = x.shape[0]
    acc = acc_dtype(x.dtype)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else _empty(x)
    mean = x.new_empty((0,)) if v.rms else x.new_empty((m,), dtype=acc)
    return torch.empty(x.shape, dtype=out_dtype(x, weight, v), device=x.device), s, mean, x.new_empty((m,), dtype=acc)


def _bwd_fake(dy, ds, x, weight, bias, mean, rstd, eps, rms, offset, round_n, act):
    dw = _empty(x) if weight is None else torch.empty_like(weight)
    db = _empty(x) if bias is None else torch.empty_like(bias)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), dw, db


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, eps, *flags = inputs
    y, s, mean, rstd = output
    ctx.has_r = residual is not None
    ctx.eps, ctx.flags = eps, flags
    ctx.save_for_backward(s if ctx.has_r else x, weight, bias, mean, rstd)


def _op_backward(ctx, dy, ds, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = norm_backward_op(dy, ds if ctx.has_r else None, x, weight, bias, mean, rstd, ctx.eps, *ctx.flags)
    return (
        dx,
        dx if ctx.has_r else None,
        dw if weight is not None else None,
        db if bias is not None else None,
        None, None, None, None, None,
    )  # fmt: skip


@kp_core.custom_op(OP_BWD, package=PACKAGE, spec=SPEC, dtypes=DTYPES, fake=_bwd_fake)
def norm_backward_op(
    dy: torch.Tensor, ds: Optional[torch.Tensor], x: torch.Tensor, weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], mean: torch.Tensor, rstd: torch.Tensor, eps: float, rms: bool, offset: float,
    round_n: bool, act: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dx, dw, db); dw/db are empty tensors when absent (custom ops return no None)."""
    return backward_impl(dy, ds, x, weight, bias, mean, rstd, eps, _variant(rms, offset, round_n, act))


@kp_core.custom_op(
    OP, package=PACKAGE, spec=SPEC, dtypes=DTYPES, fake=_fwd_fake, backward=_op_backward,
    setup_context=_setup_context,
)  # fmt: skip
def norm_op(
    x: torch.Tensor, residual: Optional[torch.Tensor], weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
    eps: float, rms: bool, offset: float, round_n: bool, act: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(y, s, mean, rstd): s = x + residual (empty without one), mean empty for RMSNorm."""
    return forward_impl(x, residual, weight, bias, eps, _variant(rms, offset, round_n, act))


def _inplace_fake(x, residual, weight, bias, eps, rms, offset, round_n, act):
    return torch.empty(x.shape, dtype=out_dtype(x, weight, _variant(rms, offset, round_n, act)), device=x.device)


@kp_core.custom_op(
    OP_INPLACE, package=PACKAGE, spec=SPEC, dtypes=DTYPES, fake=_inplace_fake, mutates_args=("residual",)
)
def add_norm_inplace_op(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
    eps: float, rms: bool, offset: float, round_n: bool, act: int,
) -> torch.Tensor:  # fmt: skip
    """y, with x + residual written into residual (2-D, unit column stride). No autograd: inference only."""
    return forward_impl(x, residual, weight, bias, eps, _variant(rms, offset, round_n, act), s_out=residual)[0]


class NormFunction(torch.autograd.Function):
    """Eager calls skip the custom-op dispatch (tens of microseconds a call); the same launchers run."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, v):
        ctx.set_materialize_grads(False)  # an unused s must not cost a pass over a tensor of zeros
        y, s, mean, rstd = forward_impl(x, residual, weight, bias, eps, v)
        ctx.has_r, ctx.eps, ctx.v = residual is not None, eps, v
        ctx.save_for_backward(s if ctx.has_r else x, weight, bias, mean, rstd)
        ctx.mark_non_differentiable(mean, rstd)
        return y, s, mean, rstd

    @staticmethod
    def backward(ctx, dy, ds, _dmean, _drstd):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros(x.shape, dtype=out_dtype(x, weight, ctx.v), device=x.device)
        dx, dw, db = backward_impl(dy, ds if ctx.has_r else None, x, weight, bias, mean, rstd, ctx.eps, ctx.v)
        return (
            dx,
            dx if ctx.has_r else None,
            dw if weight is not None else None,
            db if bias is not None else None,
            None,
            None,
        )
