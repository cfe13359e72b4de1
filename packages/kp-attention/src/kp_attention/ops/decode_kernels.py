"""Triton kernels of KV-cache attention (flash-decoding); the maths is in kp_attention.ops.decode's docstring."""

import triton
import triton.language as tl

from kp_attention.ops.attention_blocks import dot, mm
from kp_core import jit_keys
from kp_core.kernel_constants import LN2, LOG2E


@triton.jit
def _exp_units(x, IEEE: tl.constexpr):
    """exp in the scores' units: base 2 (log2(e) folded into the scores) for fp16/bf16, natural for fp32, taken in
    fp64 (fp32 exp on GPUs is exp2(x * log2(e)), whose rounded product costs ulps the 2x rule lacks)."""
    if IEEE:
        return tl.exp(x.to(tl.float64)).to(tl.float32)
    else:
        return tl.exp2(x)


@triton.jit
def _log_units(x, IEEE: tl.constexpr):
    if IEEE:
        return tl.log(x.to(tl.float64)).to(tl.float32)
    else:
        return tl.log2(x)


@triton.jit
def _decode_split(
    Q,
    stride_qb,
    stride_qs,
    stride_qh,
    K,
    stride_kb,
    stride_kn,
    stride_kh,
    V,
    stride_vb,
    stride_vn,
    stride_vh,
    SEQLENS,
    BT,
    stride_btb,
    ALIBI,
    stride_ab,
    stride_ah,
    LEFTPAD,
    OUT,
    stride_ob,
    stride_os,
    stride_oh,
    LSE,
    O_PART,
    LSE_PART,
    Hkv,
    GROUP,
    Sq,
    num_splits,
    m_blocks,
    sm_scale,
    softcap,
    win_left,
    win_right,
    capacity,
    num_blocks,
    new,
    BAD,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr,
    IEEE: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
):
    """One (batch, kv head, row block) x one split: online softmax over the split's key blocks.
    D (the head dim) is a constexpr so that D == BLOCK_D drops the head-dim masks.

    Tile rows r are (q head h * GROUP + r // Sq, query r % Sq). For fp16/bf16 scores live in the log2 domain
    (s * log2(e)) so the softmax uses exp2, and lse is stored in the log2 domain for the partials, natural log
    for the final output; fp32 (IEEE) stays in natural units throughout.

    Values the launcher's check would refuse (a length outside [new, capacity], a block id outside the cache;
    never checked on the host by default) read nothing out of bounds: the sequence's rows come out NaN instead,
    and BAD[0] is set to 1 (decode.check_inputs reports it)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    mb = pid % m_blocks
    h = (pid // m_blocks) % Hkv
    b = pid // (m_blocks * Hkv)
    b64 = b.to(tl.int64)
    L = tl.load(SEQLENS + b)
    n_bad = ((L < new) | (L > capacity)).to(tl.int32)
    L = tl.where(n_bad > 0, 0, L)  # nothing to read
    if HAS_LEFTPAD:  # the sequence's keys start at cache_leftpad[b]: [first, L)
        first = tl.load(LEFTPAD + b)
        n_bad += ((first < 0) | (first > L)).to(tl.int32)
        first = tl.where(n_bad > 0, 0, first)

    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * Sq
    hq = h * GROUP + rows // Sq
    qi = rows % Sq
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_mask = row_ok[:, None] & d_ok[None, :]
    q_ptrs = Q + b64 * stride_qb + qi[:, None] * stride_qs + hq[:, None].to(tl.int64) * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=q_mask, other=0.0)
    diag = qi + L - Sq  # the key on each row's diagonal
    if HAS_ALIBI:  # each row's q head's slope: s -= slope * |j - diag| (FlashAttention's ALiBi bias)
        slope = tl.load(ALIBI + b64 * stride_ab + hq.to(tl.int64) * stride_ah, mask=row_ok, other=0.0)

    # Keys any row of the tile may see: [lo, L), lo rounded down to a block; this split's share of it.
    lo = L * 0
    if HAS_LEFT:
        lo = tl.maximum(L - Sq - win_left, 0)
    if HAS_LEFTPAD:
        lo = tl.maximum(lo, first)
    lo = (lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(L - lo, BLOCK_N), num_splits) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, L)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    k_head = K + h.to(tl.int64) * stride_kh + offs_d[None, :]
    v_head = V + h.to(tl.int64) * stride_vh + offs_d[None, :]
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_n0
        if PAGED:
            page = tl.load(BT + b64 * stride_btb + n0 // PAGE).to(tl.int64)
            page_ok = (page >= 0) & (page < num_blocks)
            n_bad += tl.where(page_ok, 0, 1)
            page = tl.where(page_ok, page, 0)
            slot = (n0 % PAGE + offs_n0).to(tl.int64)
            k_rows = page * stride_kb + slot * stride_kn
            v_rows = page * stride_vb + slot * stride_vn
        else:
            k_rows = b64 * stride_kb + offs_n.to(tl.int64) * stride_kn
            v_rows = b64 * stride_vb + offs_n.to(tl.int64) * stride_vn
        n_ok = offs_n < end
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_head + k_rows[:, None], mask=kv_mask, other=0.0)
        # fp32: the dot left unrounded (fp64) and scaled, then rounded once (attention_blocks.mm)
        s = (mm(q, tl.trans(k), IEEE) * sm_scale).to(tl.float32)
        if SOFTCAP:
            # c * tanh(s / c), tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits +-1 when exp over/underflows. The
            # subtraction cancels for small |s| (fp32 loses ~eps / |x| relative): the fp32 path takes it in fp64.
            if IEEE:
                e = tl.exp(s.to(tl.float64) * 2.0 / softcap)
                s = (softcap - (2.0 * softcap) / (e + 1.0)).to(tl.float32)
            else:
                s = softcap - (2.0 * softcap) / (tl.exp2(s * ((1.0 / softcap) * (2.0 * LOG2E))) + 1.0)
        if HAS_ALIBI:
            s = s - slope[:, None] * tl.abs(offs_n[None, :] - diag[:, None]).to(tl.float32)
        if not IEEE:  # fp32 inputs stay in natural units: the base change costs ulps the 2x rule lacks
            s = s * LOG2E
        ok = n_ok[None, :]
        if HAS_RIGHT:
            ok = ok & (offs_n[None, :] <= diag[:, None] + win_right)
        if HAS_LEFT:
            ok = ok & (offs_n[None, :] >= diag[:, None] - win_left)
        if HAS_LEFTPAD:
            ok = ok & (offs_n[None, :] >= first)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = _exp_units(m_i - m_safe, IEEE)
        p = _exp_units(s - m_safe[:, None], IEEE)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + v_rows[:, None], mask=kv_mask, other=0.0)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
        m_i = m_new

    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse2 = tl.where(seen, m_i + _log_units(tl.where(seen, l_i, 1.0), IEEE), float("-inf"))
    if n_bad > 0:
        out = tl.full([BLOCK_M, BLOCK_D], float("nan"), dtype=tl.float32)
        lse2 = tl.full([BLOCK_M], float("nan"), dtype=tl.float32)
        tl.store(BAD, 1)
    hq64 = hq.to(tl.int64)
    row_id = (b64 * Hkv * GROUP + hq64) * Sq + qi  # row of the (B, Hq, Sq) lse
    if ONE_SPLIT:
        o_ptrs = OUT + b64 * stride_ob + qi[:, None] * stride_os + hq64[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
        tl.store(LSE + row_id, lse2 if IEEE else lse2 * LN2, mask=row_ok)
    else:
        part = row_id * num_splits + split
        tl.store(O_PART + part[:, None] * D + offs_d[None, :], out, mask=q_mask)
        tl.store(LSE_PART + part, lse2, mask=row_ok)


@triton.jit
def _decode_combine(
    O_PART,
    LSE_PART,
    OUT,
    stride_ob,
    stride_os,
    stride_oh,
    LSE,
    Hq,
    Sq,
    num_splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One output row (b, q head, query) x one BLOCK_D slice of the head dim: lse = log2 sum_s 2^lse_s,
    out = sum_s 2^(lse_s - lse) out_s (natural log and exp for fp32 inputs, IEEE, whose partials are in natural
    units). The head dim in slices: at batch 1 the rows alone are too few programs to fill the GPU, and each
    program's loads are one round trip when BLOCK_S covers every split."""
    row = tl.program_id(0).to(tl.int64)  # (b * Hq + hq) * Sq + i
    qi = row % Sq
    hq = (row // Sq) % Hq
    b = row // (Sq * Hq)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    lse_row = LSE_PART + row * num_splits
    m = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), 0)
    for s0 in range(0, num_splits, BLOCK_S):
        lse = tl.load(lse_row + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, 0))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    denom = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), 0)
    for s0 in range(0, num_splits, BLOCK_S):
        s_ok = s0 + offs_s < num_splits
        w = _exp_units(tl.load(lse_row + s0 + offs_s, mask=s_ok, other=float("-inf")) - m_safe, IEEE)
        parts = (row * num_splits + s0 + offs_s)[:, None] * D + offs_d[None, :]
        o = tl.load(O_PART + parts, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        denom += tl.sum(w, 0)
    out = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(OUT + b * stride_ob + qi * stride_os + hq * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)
    # denom is 0 for a row that sees no key (lse -inf) and NaN for a split that flagged bad input (lse NaN).
    lse_units = m_safe + _log_units(tl.where(denom > 0.0, denom, 1.0), IEEE)
    lse_out = tl.where(denom == 0.0, float("-inf"), lse_units if IEEE else lse_units * LN2)
    lse_out = tl.where(denom == denom, lse_out, float("nan"))
    if tl.program_id(1) == 0:
        tl.store(LSE + row, lse_out)


@triton.jit
def _decode_append(
    K_NEW,
    stride_nb,
    stride_ns,
    stride_nh,
    stride_nd,
    V_NEW,
    stride_mb,
    stride_ms,
    stride_mh,
    stride_md,
    K_CACHE,
    stride_kb,
    stride_kn,
    stride_kh,
    stride_kd,
    V_CACHE,
    stride_vb,
    stride_vn,
    stride_vh,
    stride_vd,
    SEQLENS,
    BT,
    stride_btb,
    new,
    Hkv,
    capacity,
    num_blocks,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr,
    PAGED: tl.constexpr,
):
    """One new token (b, i) of k and v, all kv heads, written at position cache_seqlens[b] + i (through
    block_table when paged). A sequence whose length or block id is out of range writes nothing (the split
    kernel then gives its rows NaN), so no value of cache_seqlens or block_table writes outside the caches."""
    pid = tl.program_id(0)
    b = (pid // new).to(tl.int64)
    i = pid % new
    L = tl.load(SEQLENS + b)
    ok = (L >= 0) & (L + new <= capacity)
    pos = tl.where(ok, L + i, 0).to(tl.int64)
    if PAGED:
        page = tl.load(BT + b * stride_btb + pos // PAGE, mask=ok, other=-1).to(tl.int64)
        ok = ok & (page >= 0) & (page < num_blocks)
        k_row = page * stride_kb + (pos % PAGE) * stride_kn
        v_row = page * stride_vb + (pos % PAGE) * stride_vn
    else:
        k_row = b * stride_kb + pos * stride_kn
        v_row = b * stride_vb + pos * stride_vn
    offs_h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    ok_d = offs_d * 0 + ok.to(tl.int64) > 0  # as a tile: the interpreter will not AND a scalar into a mask
    for h0 in range(0, Hkv, BLOCK_H):
        m = (h0 + offs_h < Hkv) & (offs_d < D) & ok_d
        hh = h0 + offs_h
        k = tl.load(K_NEW + b * stride_nb + i * stride_ns + hh * stride_nh + offs_d * stride_nd, mask=m)
        tl.store(K_CACHE + k_row + hh * stride_kh + offs_d * stride_kd, k, mask=m)
        v = tl.load(V_NEW + b * stride_mb + i * stride_ms + hh * stride_mh + offs_d * stride_md, mask=m)
        tl.store(V_CACHE + v_row + hh * stride_vh + offs_d * stride_vd, v, mask=m)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
