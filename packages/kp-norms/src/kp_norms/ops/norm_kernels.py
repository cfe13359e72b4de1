"""Triton kernels of the row norms (the maths is in kp_norms.ops.norm's docstring).

Forward: `_norm_fwd` holds BLOCK_M whole rows in registers; `_norm_fwd_looped` walks one row too wide for
registers in chunks. Backward: `_norm_bwd` is persistent (a slice of rows per program, the next block's loads
issued before this block's maths); `_norm_bwd_looped` walks wide rows in chunks. Both leave one dw/db partial
per program, and `_norm_bwd_sum` adds the partials and casts them to the parameters' dtypes.

A program sums hundreds of rows of dw and db terms one after another. In fp64 (fp32 and fp64 inputs) that is exact
enough; in fp32 it is several times less accurate than a pairwise reduction, which only shows when the result keeps
fp32 precision: half-precision inputs with fp32 weights. There (KAHAN) the sums carry a compensation term. Elsewhere
they do not: its registers slow the fused backward down where rows are wide.
"""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_core.activation_kernels import NONE, act_fwd, act_grad
from kp_core.float8_kernels import abs_bits, multiplier, recip, store_fp8

# FP8: what a forward kernel does for a float8 copy of y. NO_FP8: nothing; ROW: the fused kernel casts each row
# with its own scale, the looped one leaves the row's amax for _cast_float8; TENSOR: the tensor's amax (an atomic
# max), for _cast_float8.
NO_FP8 = tl.constexpr(0)
ROW = tl.constexpr(1)
TENSOR = tl.constexpr(2)


@triton.jit
def _kahan(total, comp, x):
    """total + x with the rounding error carried in comp (the sum is total - comp)."""
    y = x - comp
    t = total + y
    return t, (t - total) - y


@triton.jit
def _accumulate(PART, COMP, x, mask, KAHAN: tl.constexpr):
    """*PART += x, compensated in *COMP when KAHAN (a program's own partial row: race-free read-modify-write)."""
    total = tl.load(PART, mask=mask, other=0.0)
    if KAHAN:
        total, comp = _kahan(total, tl.load(COMP, mask=mask, other=0.0), x)
        tl.store(COMP, comp, mask=mask)
    else:
        total += x
    tl.store(PART, total, mask=mask)


@triton.jit
def _inv_rms(sum_sq, N, eps_hi, eps_lo, ACC: tl.constexpr):
    """1 / sqrt(sum_sq / N + eps), correctly rounded (the approximate fp32 ops cost ~2 ulp).

    Triton passes float arguments as fp32, so eps arrives as two fp32 halves (eps_hi + eps_lo) that rebuild it
    to ~48 bits for fp64 inputs; in fp32 the sum is just fp32(eps)."""
    eps = tl.cast(eps_hi, ACC) + tl.cast(eps_lo, ACC)
    if ACC == tl.float64:
        v = sum_sq / N + eps
        r = 1.0 / tl.sqrt(v)
        # The GPU backend may turn 1/sqrt into an approximate fp64 rsqrt (~2^-46 relative error, seen on H100);
        # one Newton step makes it exact to rounding. Rows with inf (r = 0) or a zero sum (r = inf) keep r as
        # is, so NaN/Inf propagate exactly as in the reference.
        r = tl.where((r > 0) & (r < float("inf")), r * (1.5 - 0.5 * v * r * r), r)
    else:
        r = tl.div_rn(1.0, tl.sqrt_rn(sum_sq / N + eps))
    return r


@triton.jit
def _affine(
    n,
    w,
    b,
    X_TY: tl.constexpr,
    OFFSET: tl.constexpr,
    ROUND_N: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
):
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


# stride_q unspecialised: a float8 store known to be 16-byte aligned makes 16-wide vectors the layout of the
# whole tile, which changes the order of the row sums, and y would no longer be kp::norm's bit for bit.
@triton.jit(do_not_specialize=["stride_q"])
def _norm_fwd(
    X,
    stride_x,
    R,
    stride_r,
    S,
    stride_s,
    Y,
    stride_y,
    W,
    B,
    MEAN,
    RSTD,
    Q,
    stride_q,
    QSCALE,
    QAMAX,
    M,
    N,
    eps_hi,
    eps_lo,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RMS: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    OFFSET: tl.constexpr,
    ROUND_N: tl.constexpr,
    ACT: tl.constexpr,
    STATS: tl.constexpr,
    ACC: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_EPS: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
    POW2: tl.constexpr,
):
    """BLOCK_M whole rows held in registers. STATS: store mean and rstd for the backward. FP8 ROW: also y cast
    to float8 per row (Q, QSCALE, the amax bits in QAMAX); TENSOR: y's amax bits into QAMAX[0]."""
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
        # Two steps (corrected two-pass): the sum's rounding, ulps of a large common offset, would shift every
        # centred value alike; the residuals' own mean takes it back out.
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        shift = tl.sum(xc, axis=1) / N
        xc = tl.where(mask, xc - shift[:, None], 0.0)
        mean = mean + shift
        if STATS:
            tl.store(MEAN + rows, mean, mask=row_ok)
    rstd = _inv_rms(tl.sum(xc * xc, axis=1), N, eps_hi, eps_lo, ACC)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(ACC)[None, :] if HAS_W else None
    b = tl.load(B + cols, mask=cols < N, other=0.0).to(ACC)[None, :] if HAS_B else None
    z = _affine(xc * rstd[:, None], w, b, X.dtype.element_ty, OFFSET, ROUND_N, HAS_W, HAS_B, ACC)
    y = act_fwd(z, ACT).to(Y.dtype.element_ty)
    tl.store(Y + rows64 * stride_y + cols[None, :], y, mask=mask)
    if STATS:
        tl.store(RSTD + rows, rstd, mask=row_ok)
    if FP8 != NO_FP8:  # the cast reads y as stored (rounded), as a cast after the norm would
        y = y.to(tl.float32)
        bits = tl.where(mask, abs_bits(y), 0)
        if FP8 == ROW:
            amax_bits = tl.max(bits, axis=1)
            q = multiplier(amax_bits, FP8_MAX, FP8_EPS, POW2)
            tl.store(QSCALE + rows, recip(q), mask=row_ok)
            tl.store(QAMAX + rows, amax_bits, mask=row_ok)
            store_fp8(Q + rows64 * stride_q + cols[None, :], y * q[:, None], mask, FP8_MAX, E5M2, SOFT)
        else:
            tl.atomic_max(QAMAX, tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _norm_fwd_looped(
    X,
    stride_x,
    R,
    stride_r,
    S,
    stride_s,
    Y,
    stride_y,
    W,
    B,
    MEAN,
    RSTD,
    QAMAX,
    N,
    eps_hi,
    eps_lo,
    BLOCK_N: tl.constexpr,
    RMS: tl.constexpr,
    HAS_R: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    OFFSET: tl.constexpr,
    ROUND_N: tl.constexpr,
    ACT: tl.constexpr,
    STATS: tl.constexpr,
    ACC: tl.constexpr,
    FP8: tl.constexpr,
):
    """One row too wide for registers (one program per row): a pass for the statistics, a pass to normalise.
    The first pass asks L2 to keep the row, so the second reads it from there. FP8 ROW / TENSOR: the row's amax
    bits into QAMAX[row] / QAMAX[0] (an atomic max), for _cast_float8.

    LayerNorm's mean and variance merge per chunk (Chan et al.): each chunk's centred sum of squares is exact in
    registers, so there is no sum-of-squares cancellation however large the mean."""
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
            c_shift = tl.sum(c_dev, axis=0) / k  # the chunk's mean in two steps, as in _norm_fwd
            c_dev = tl.where(ok, c_dev - c_shift, 0.0)
            c_mean = c_mean + c_shift
            total = count + k
            delta = c_mean - mean
            mean = mean + delta * (k / total)
            m2 = m2 + tl.sum(c_dev * c_dev, axis=0) + delta * delta * (count * k / total)
            count = total
    if RMS:
        m2 = tl.sum(acc, axis=0)
    elif STATS:
        tl.store(MEAN + row, mean)
    rstd = _inv_rms(m2, N, eps_hi, eps_lo, ACC)
    src_row = s_row if HAS_R else x_row
    amax = tl.zeros([BLOCK_N], dtype=tl.int32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        x = tl.load(src_row + cols, mask=ok, other=0.0, eviction_policy="evict_first").to(ACC)
        xc = x if RMS else x - mean
        w = tl.load(W + cols, mask=ok, other=0.0).to(ACC) if HAS_W else None
        b = tl.load(B + cols, mask=ok, other=0.0).to(ACC) if HAS_B else None
        z = _affine(xc * rstd, w, b, X.dtype.element_ty, OFFSET, ROUND_N, HAS_W, HAS_B, ACC)
        y = act_fwd(z, ACT).to(Y.dtype.element_ty)
        tl.store(y_row + cols, y, mask=ok)
        if FP8 != NO_FP8:
            amax = tl.maximum(amax, tl.where(ok, abs_bits(y.to(tl.float32)), 0))
    if STATS:
        tl.store(RSTD + row, rstd)
    if FP8 == ROW:
        tl.store(QAMAX + row, tl.max(amax, axis=0))
    elif FP8 == TENSOR:
        tl.atomic_max(QAMAX, tl.max(amax, axis=0))


@triton.jit
def _cast_float8(
    Y,
    stride_y,
    Q,
    stride_q,
    QSCALE,
    QAMAX,
    N,
    BLOCK_N: tl.constexpr,
    ROWWISE: tl.constexpr,
    FP8_MAX: tl.constexpr,
    FP8_EPS: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
    POW2: tl.constexpr,
):
    """Row program_id of y cast to float8 with the amax a forward kernel left in QAMAX (int32 bits): the row's
    own (ROWWISE, its scale at QSCALE[row]) or the tensor's (program 0 writes the one scale)."""
    row = tl.program_id(0).to(tl.int64)
    if ROWWISE:
        q = multiplier(tl.load(QAMAX + row), FP8_MAX, FP8_EPS, POW2)
        tl.store(QSCALE + row, recip(q))
    else:
        q = multiplier(tl.load(QAMAX), FP8_MAX, FP8_EPS, POW2)
        if row == 0:
            tl.store(QSCALE, recip(q))
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        y = tl.load(Y + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
        store_fp8(Q + row * stride_q + cols, y * q, ok, FP8_MAX, E5M2, SOFT)


@triton.jit
def _dz_and_n(
    x,
    dy,
    mean,
    rstd,
    w,
    b,
    mask,
    X_TY: tl.constexpr,
    RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    OFFSET: tl.constexpr,
    ROUND_N: tl.constexpr,
    ACT: tl.constexpr,
    ACC: tl.constexpr,
):
    """n (zero outside the row) and dz = dy * act'(z). With ROUND_N the forward multiplied w by n rounded to the
    input dtype; dw and dx take n unrounded (the rounding's derivative taken as 1), the gradient of the norm in
    exact arithmetic: the rounded n's error, up to half an ulp per row, would otherwise add up in dw."""
    xc = x if RMS else tl.where(mask, x - mean, 0.0)
    n = xc * rstd
    dz = dy
    if ACT != NONE:
        dz = dy * act_grad(_affine(n, w, b, X_TY, OFFSET, ROUND_N, HAS_W, HAS_B, ACC), ACT)
    return n, dz


@triton.jit
def _rounded(x):
    """x, as a value the compiler cannot contract into a later add. dx = dn - mean(dn) must subtract the same
    rounded dn it summed; contracted, dn = dz * w entered one side as an exact product (an FMA) and the other
    rounded, and a one-column row (n = 0, rstd = 1/sqrt(eps)) got 316 times dn's rounding error instead of 0.
    x + 0.0 is not x for x = -0.0, so it is not folded away; a product under it rounds (into an FMA with 0)."""
    return x + 0.0


@triton.jit
def _norm_bwd(
    DY,
    stride_dy,
    DS,
    stride_ds,
    X,
    stride_x,
    W,
    B,
    MEAN,
    RSTD,
    DX,
    stride_dx,
    DW_PART,
    DB_PART,
    M,
    N,
    rows_per_program,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RMS: tl.constexpr,
    HAS_DS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    OFFSET: tl.constexpr,
    ROUND_N: tl.constexpr,
    ACT: tl.constexpr,
    KAHAN: tl.constexpr,
    ACC: tl.constexpr,
):
    """Each program walks `rows_per_program` rows, BLOCK_M at a time, and writes one dw/db partial row.

    The next block's x and dy are loaded before this block is computed: one persistent program per SM then
    keeps two blocks of loads in flight (without it the loop is latency-bound, ~1.4 TB/s)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(ACC)[None, :] if HAS_W else None
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(ACC)[None, :] if HAS_B else None
    w_eff = (w + OFFSET if OFFSET != 0.0 else w) if HAS_W else None
    dw = tl.zeros([BLOCK_N], dtype=ACC)
    db = tl.zeros([BLOCK_N], dtype=ACC)
    if KAHAN:
        dw_c = tl.zeros([BLOCK_N], dtype=ACC)
        db_c = tl.zeros([BLOCK_N], dtype=ACC)
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
        n, dz = _dz_and_n(
            x, dy, mean, rstd, w, b, cur_mask, X.dtype.element_ty, RMS, HAS_W, HAS_B, OFFSET, ROUND_N, ACT, ACC
        )
        dn = _rounded(dz * w_eff) if HAS_W else _rounded(dz)
        if HAS_W:
            if KAHAN:
                dw, dw_c = _kahan(dw, dw_c, tl.sum(dz * n, axis=0))
            else:
                dw += tl.sum(dz * n, axis=0)
        if HAS_B:
            if KAHAN:
                db, db_c = _kahan(db, db_c, tl.sum(dz, axis=0))
            else:
                db += tl.sum(dz, axis=0)
        dx = dn - n * (tl.sum(dn * n, axis=1) / N)[:, None]
        if not RMS:
            dx = dx - (tl.sum(dn, axis=1) / N)[:, None]
        dx = dx * rstd
        if HAS_DS:
            dx += tl.load(DS + cur_rows64 * stride_ds + cols[None, :], mask=cur_mask, other=0.0).to(ACC)
        tl.store(DX + cur_rows64 * stride_dx + cols[None, :], dx, mask=cur_mask)
    if KAHAN:
        dw = dw - dw_c
        db = db - db_c
    if HAS_W:
        tl.store(DW_PART + pid * N + cols, dw, mask=col_ok)
    if HAS_B:
        tl.store(DB_PART + pid * N + cols, db, mask=col_ok)


@triton.jit
def _norm_bwd_looped(
    DY,
    stride_dy,
    DS,
    stride_ds,
    X,
    stride_x,
    W,
    B,
    MEAN,
    RSTD,
    DX,
    stride_dx,
    DW_PART,
    DB_PART,
    DW_COMP,
    DB_COMP,
    M,
    N,
    rows_per_program,
    BLOCK_N: tl.constexpr,
    RMS: tl.constexpr,
    HAS_DS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    OFFSET: tl.constexpr,
    ROUND_N: tl.constexpr,
    ACT: tl.constexpr,
    KAHAN: tl.constexpr,
    ACC: tl.constexpr,
):
    """Rows too wide for registers: per row a pass for mean(dn * n) and mean(dn), then a pass for dx. The
    program's dw/db partial rows and their Kahan compensation rows live in memory; only this program touches
    them, so read-modify-write is race-free."""
    pid = tl.program_id(0)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    part = pid.to(tl.int64) * N  # wide rows: programs * N may pass 2^31
    dw_row = DW_PART + part
    db_row = DB_PART + part
    dw_comp = DW_COMP + part
    db_comp = DB_COMP + part
    zero = tl.zeros([BLOCK_N], dtype=ACC)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < N
        if HAS_W:
            tl.store(dw_row + cols, zero, mask=ok)
            if KAHAN:
                tl.store(dw_comp + cols, zero, mask=ok)
        if HAS_B:
            tl.store(db_row + cols, zero, mask=ok)
            if KAHAN:
                tl.store(db_comp + cols, zero, mask=ok)
    for i in range(0, last - first):
        row = first + i
        row64 = row.to(tl.int64)
        x_row = X + row64 * stride_x
        dy_row = DY + row64 * stride_dy
        rstd = tl.load(RSTD + row)
        mean = None if RMS else tl.load(MEAN + row)
        acc_nn = zero
        acc_n = zero
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            x = tl.load(x_row + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(ACC)
            dy = tl.load(dy_row + cols, mask=ok, other=0.0, eviction_policy="evict_last").to(ACC)
            w = tl.load(W + cols, mask=ok, other=0.0).to(ACC) if HAS_W else None
            b = tl.load(B + cols, mask=ok, other=0.0).to(ACC) if HAS_B else None
            n, dn = _dz_and_n(
                x, dy, mean, rstd, w, b, ok, X.dtype.element_ty, RMS, HAS_W, HAS_B, OFFSET, ROUND_N, ACT, ACC
            )
            dn = _rounded(dn * (w + OFFSET if OFFSET != 0.0 else w)) if HAS_W else _rounded(dn)
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
            n, dz = _dz_and_n(
                x, dy, mean, rstd, w, b, ok, X.dtype.element_ty, RMS, HAS_W, HAS_B, OFFSET, ROUND_N, ACT, ACC
            )
            dn = _rounded(dz * (w + OFFSET if OFFSET != 0.0 else w)) if HAS_W else _rounded(dz)
            if HAS_W:
                _accumulate(dw_row + cols, dw_comp + cols, dz * n, ok, KAHAN)
            if HAS_B:
                _accumulate(db_row + cols, db_comp + cols, dz, ok, KAHAN)
            dx = dn - n * c1
            if not RMS:
                dx = dx - c2
            dx = dx * rstd
            if HAS_DS:
                dx += tl.load(DS + row64 * stride_ds + cols, mask=ok, other=0.0).to(ACC)
            tl.store(DX + row64 * stride_dx + cols, dx, mask=ok)
    if KAHAN:
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            ok = cols < N
            if HAS_W:
                tl.store(dw_row + cols, tl.load(dw_row + cols, mask=ok) - tl.load(dw_comp + cols, mask=ok), mask=ok)
            if HAS_B:
                tl.store(db_row + cols, tl.load(db_row + cols, mask=ok) - tl.load(db_comp + cols, mask=ok), mask=ok)


@triton.jit
def _sum_rows(PART, programs, N, cols, ok, BLOCK_P: tl.constexpr, ACC: tl.constexpr):
    """Column sums of a (programs, N) partial block: a tree within each BLOCK_P rows, Kahan across them."""
    total = tl.zeros([cols.shape[0]], dtype=ACC)
    comp = tl.zeros([cols.shape[0]], dtype=ACC)
    for p0 in range(0, programs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        tile = tl.load(
            PART + p.to(tl.int64)[:, None] * N + cols[None, :], mask=(p < programs)[:, None] & ok[None, :], other=0.0
        )
        total, comp = _kahan(total, comp, tl.sum(tile, axis=0))
    return total - comp


@triton.jit
def _norm_bwd_sum(
    DW_PART,
    DB_PART,
    DW,
    DB,
    programs,
    N,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    ACC: tl.constexpr,
):
    """dw and db from the backward's per-program partials, in the parameters' dtypes."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    if HAS_W:
        tl.store(DW + cols, _sum_rows(DW_PART, programs, N, cols, ok, BLOCK_P, ACC), mask=ok)
    if HAS_B:
        tl.store(DB + cols, _sum_rows(DB_PART, programs, N, cols, ok, BLOCK_P, ACC), mask=ok)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
