"""Triton kernels of the cross-entropy (the maths is in kp_losses.ops.cross_entropy's docstring).

One program per row, walking the row's classes in BLOCK_C slices: the forward keeps a running max m and sum s of
exp(z - m) (one read of the logits) and saves both, the backward recomputes the probabilities as exp(z - m) / s (a
second read: within a few ulps whatever the logits' offset, where exp(z - lse) would be off by lse's own ulp, a
1000-nat logit's 1e-13 in float64) and writes the gradient (one write, possibly over the logits themselves:
fused_linear_cross_entropy's own chunk buffer). Arithmetic in ACC (fp32 for fp16/bf16 logits, fp64 for fp32/fp64
ones), rounded once at the store.
"""

import triton
import triton.language as tl

from kp_core import jit_keys


@triton.jit
def _capped(x, softcap, HAS_SOFTCAP: tl.constexpr):
    """softcap * tanh(x / softcap) (Gemma 2's final-logit cap), or x. tanh from one exp of -2|u|, which neither
    overflows nor loses the small values' relative precision beyond ACC's own rounding of 1 - e."""
    if HAS_SOFTCAP:
        u = x / softcap
        e = tl.exp(-2.0 * tl.abs(u))
        t = (1.0 - e) / (1.0 + e)
        return softcap * tl.where(u < 0, -t, t)
    return x


@triton.jit
def _real(bits, ACC: tl.constexpr):
    """A float64 passed as its int64 bits (Triton passes Python floats as fp32: 0.1 would be off by 1.5e-9, which
    an fp64 loss cannot hide), in ACC."""
    return bits.to(tl.int64).to(tl.float64, bitcast=True).to(ACC)


@triton.jit
def _weight_total(WSUM, C, HAS_WEIGHT: tl.constexpr, ACC: tl.constexpr):
    """W = sum_j w_j: read from WSUM (one value, summed by torch once a call), C without weights."""
    if HAS_WEIGHT:
        return tl.load(WSUM).to(ACC)
    return C + tl.zeros((), ACC)  # C may come as a constexpr (Triton specialises 1)


@triton.jit
def _target(T, row, ignore_index, C):
    """(target as int32 clamped into [0, C) for its loads, counted (not ignore_index), out of range)."""
    t = tl.load(T + row).to(tl.int64)
    counted = t != ignore_index
    bad = counted & ((t < 0) | (t >= C))
    return tl.minimum(tl.maximum(t, 0), C - 1).to(tl.int32), counted, bad


@triton.jit
def _ce_fwd(
    X,
    stride_x,
    T,
    W,
    LOSS,
    STATS,
    C,
    ignore_index,
    smoothing_bits,
    z_loss_bits,
    softcap_bits,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTH: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Row r: m = max_j z_j and s = sum_j exp(z_j - m) (saved for the backward), z the (capped) logits, and
    loss = w_t ((1 - eps)(lse - z_t) + z_loss lse^2) + eps / C sum_j w_j (lse - z_j), lse = m + log(s); 0 for an
    ignored row, NaN for a target out of [0, C). Differences are taken from m (lse - z_t = (m - z_t) + log s), so a
    row's offset (logits near 1000) costs no precision beyond the logits' own."""
    smoothing, z_loss, softcap = _real(smoothing_bits, ACC), _real(z_loss_bits, ACC), _real(softcap_bits, ACC)
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    m = tl.full((), float("-inf"), ACC)
    s = tl.zeros((), ACC)
    below = tl.zeros((), ACC)  # sum_j w_j (m - z_j) over the classes seen, for the smoothing term
    seen = tl.zeros((), ACC)  # sum_j w_j over them
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = cols < C
        z = _capped(tl.load(x_row + cols, mask=mask, other=0.0).to(ACC), softcap, HAS_SOFTCAP)
        z_max = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_max, axis=0))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row of -inf so far: no NaN from -inf - -inf
        s = s * tl.exp(m - base) + tl.sum(tl.exp(z_max - base), axis=0)
        if SMOOTH:  # masked lanes hold z = 0 and w = 0
            w = tl.load(W + cols, mask=mask, other=0.0).to(ACC) if HAS_WEIGHT else tl.where(mask, 1.0, 0.0).to(ACC)
            below += tl.where(seen == 0.0, 0.0, seen * (base - m))  # the classes seen, from the new max
            below += tl.sum(w * (base - z), axis=0)
            seen += tl.sum(w, axis=0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    t, counted, bad = _target(T, row, ignore_index, C)
    z_t = _capped(tl.load(x_row + t).to(ACC), softcap, HAS_SOFTCAP)
    w_t = tl.load(W + t).to(ACC) if HAS_WEIGHT else 1.0
    loss = w_t * ((1.0 - smoothing) * ((m - z_t) + log_s) + z_loss * lse * lse)
    if SMOOTH:  # sum_j w_j (lse - z_j) = W log s + sum_j w_j (m - z_j)
        loss += smoothing / C * (seen * log_s + below)
    loss = tl.where(counted, loss, 0.0)
    tl.store(LOSS + row, tl.where(bad, float("nan"), loss))
    tl.store(STATS + 2 * row, m)
    tl.store(STATS + 2 * row + 1, s)


@triton.jit
def _ce_bwd(
    X,
    stride_x,
    DX,
    stride_dx,
    T,
    W,
    STATS,
    G,
    stride_g,
    C,
    ignore_index,
    smoothing_bits,
    z_loss_bits,
    softcap_bits,
    WSUM,
    HAS_WEIGHT: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SMOOTH: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dx_j = g (w_t ((1 - eps) + 2 z_loss lse) p_j - w_t (1 - eps) [j = t] + eps / C (W p_j - w_j)) dz_j/dx_j, p =
    exp(z - m) / s (the forward's row statistics), lse = m + log(s), W = sum_j w_j, dz/dx = 1 - (z / softcap)^2; g the
    row's loss gradient. 0 on an ignored row.
    DX may be X (each slice is read before it is written, by the same program)."""
    smoothing, z_loss, softcap = _real(smoothing_bits, ACC), _real(z_loss_bits, ACC), _real(softcap_bits, ACC)
    row = tl.program_id(0).to(tl.int64)
    t, counted, bad = _target(T, row, ignore_index, C)
    g = tl.load(G + row * stride_g).to(ACC)
    m = tl.load(STATS + 2 * row).to(ACC)
    s = tl.load(STATS + 2 * row + 1).to(ACC)
    lse, inv_s = m + tl.log(s), 1.0 / s
    w_t = tl.load(W + t).to(ACC) if HAS_WEIGHT else 1.0
    coef = w_t * ((1.0 - smoothing) + 2.0 * z_loss * lse)
    if SMOOTH:
        coef += smoothing / C * _weight_total(WSUM, C, HAS_WEIGHT, ACC)
    for start in range(0, C, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        mask = cols < C
        z = _capped(tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(ACC), softcap, HAS_SOFTCAP)
        d = coef * (tl.exp(z - m) * inv_s) - tl.where(cols == t, w_t * (1.0 - smoothing), 0.0)
        if SMOOTH:
            w = tl.load(W + cols, mask=mask, other=0.0).to(ACC) if HAS_WEIGHT else 1.0
            d -= smoothing / C * w
        if HAS_SOFTCAP:
            r = z / softcap
            d *= 1.0 - r * r
        d = tl.where(counted, g * d, 0.0)  # zeros, as torch gives, even where g is inf (mean over no counted row)
        tl.store(DX + row * stride_dx + cols, tl.where(bad, float("nan"), d).to(DX.dtype.element_ty), mask=mask)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
