"""Triton kernels of the FlashAttention-2 backward, deterministic (no atomics: every output is written by one
program); the maths is in kp_attention.ops.attention_blocks' docstring.

FlashAttention-2 / Triton tutorial split:
    delta_i = sum_d dO_id O_id - dlse_i                       (_attn_bwd_preprocess)
    dS_ij   = P_ij (dO_i . v_j - delta_i) * tanh'             (recomputed from lse)
    dK, dV: one program per key block and kv head loops over the group's q heads and query blocks (_attn_bwd_dkdv)
    dQ:     one program per query block and q head loops over key blocks (_attn_bwd_dq)
Dropout: both kernels draw the forward's mask again (attention_blocks.dropout_keep) and scale dP by it.

The launchers, the PyTorch reference and the op declarations are in kp_attention.ops.attention; the forward kernel
is in kp_attention.ops.attention_fwd_kernels; the conformance spec is conformance/specs/test_attention.py.
"""

import triton
import triton.language as tl

from kp_attention.ops.attention_blocks import (
    allowed,
    apply_mask,
    dot,
    dropout_keep,
    kv_range,
    load1d,
    load2d,
    mm,
    q_range,
    query_program,
    region,
    score_exp,
    score_units,
    scores,
    seq_bounds,
)
from kp_core import jit_keys


@triton.jit
def _attn_bwd_preprocess(
    Out,
    DO,
    DLSE,
    DELTA,
    CU_Q,
    sob,
    sos,
    soh,
    sod,
    sdb,
    sds,
    sdh,
    sdd,
    slb,
    slh,
    seqlen_q,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    VARLEN: tl.constexpr,
    HAS_DLSE: tl.constexpr,
    ROWSUM: tl.constexpr,
):
    """delta = rowsum(dO * O) - dlse, in lse's layout. Grid (query blocks, q heads, batch). Without ROWSUM (the
    fp32 path, DELTA fp64) only -dlse: _attn_bwd_dq adds sum_j P_ij dP_ij itself."""
    pid_m = tl.program_id(0)
    h64 = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2)
    q_start, seqlen_q = seq_bounds(CU_Q, b, seqlen_q, VARLEN)
    b64 = b.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen_q
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(
        Out + b64 * sob + q_start * sos + h64 * soh + offs_m[:, None] * sos + offs_d[None, :] * sod,
        mask=mask,
        other=0.0,
    )
    do = tl.load(
        DO + b64 * sdb + q_start * sds + h64 * sdh + offs_m[:, None] * sds + offs_d[None, :] * sdd, mask=mask, other=0.0
    )
    if ROWSUM:
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    else:
        delta = tl.sum(o.to(tl.float32) * 0.0, axis=1)
    row = b64 * slb + h64 * slh + q_start + offs_m
    if HAS_DLSE:
        delta = delta - tl.load(DLSE + row, mask=row_ok, other=0.0)
    tl.store(DELTA + row, delta, mask=row_ok)


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    MASK,
    SEED,
    DK,
    DV,
    CU_Q,
    CU_K,
    sqb,
    sqs,
    sqh,
    sqd,
    skb,
    sks,
    skh,
    skd,
    svb,
    svs,
    svh,
    svd,
    sdb,
    sds,
    sdh,
    sdd,
    sdkb,
    sdks,
    sdkh,
    sdkd,
    sdvb,
    sdvs,
    sdvh,
    sdvd,
    slb,
    slh,
    smb,
    smh,
    smq,
    smk,
    seqlen_q,
    seqlen_k,
    group,
    scale,
    qk_scale,
    sc_in,
    sc_out,
    window_left,
    window_right,
    drop_threshold,
    drop_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr,
    VARLEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    DROPOUT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid (key blocks, kv heads, batch): dK, dV of one key block summed over the group's q heads."""
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start, seqlen_q = seq_bounds(CU_Q, b, seqlen_q, VARLEN)
    k_start, seqlen_k = seq_bounds(CU_K, b, seqlen_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if VARLEN:
        if n0 >= seqlen_k:
            return
    if BOTTOM_RIGHT:
        diag = seqlen_k - seqlen_q
    else:
        diag = seqlen_k * 0
    b64 = b.to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    keys = offs_n[:, None]
    kv_mask = (offs_n < seqlen_k)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(
        K + b64 * skb + k_start * sks + kvh64 * skh + offs_n[:, None] * sks + offs_d[None, :] * skd,
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V + b64 * svb + k_start * svs + kvh64 * svh + offs_n[:, None] * svs + offs_d[None, :] * svd,
        mask=kv_mask,
        other=0.0,
    )
    if DROPOUT:
        seed = tl.load(SEED)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = q_range(
        n0, seqlen_q, seqlen_k, diag, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    for g in range(0, group):
        h64 = (kvh * group + g).to(tl.int64)
        Q_base = Q + b64 * sqb + q_start * sqs + h64 * sqh
        DO_base = DO + b64 * sdb + q_start * sds + h64 * sdh
        L_base = LSE + b64 * slb + h64 * slh + q_start
        D_base = DELTA + b64 * slb + h64 * slh + q_start
        M_base = MASK + b64 * smb + h64 * smh
        bh = b64 * tl.num_programs(1) * group + h64  # (batch, q head), as the forward numbers it for dropout
        for REGION in tl.static_range(3):
            start, end = region(REGION, lo, mid_lo, mid_hi, hi)
            for start_m in range(start, end, BLOCK_M):
                # dK, dV of this key block from one query block, in transposed form (keys along rows)
                rows = start_m + offs_m
                d_ok = offs_d < HEAD_DIM
                q_ok = rows < seqlen_q
                qT = load2d(Q_base + rows[None, :] * sqs + offs_d[:, None] * sqd, d_ok, q_ok, PAD_D, REGION != 0)
                lse2 = score_units(load1d(L_base + rows, q_ok, REGION != 0), IEEE)
                lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # fully masked row: all its p are 0 below
                # the fp32 path forms scores as the forward does (q @ k^T), so P = exp(s - lse) rounds as there
                if IEEE:
                    sT = tl.trans(mm(tl.trans(qT), tl.trans(k), IEEE))
                else:
                    sT = dot(k, qT, tl.zeros([k.shape[0], qT.shape[1]], dtype=tl.float32), IEEE)
                s2T, thT = scores(sT, qk_scale, sc_in, sc_out, SOFTCAP, IEEE)
                s2T = apply_mask(s2T, M_base, rows[None, :], keys, smq, smk, seqlen_q, seqlen_k, diag, MASK_KIND, IEEE)
                if REGION != 0:
                    ok = allowed(
                        rows[None, :], keys, seqlen_q, seqlen_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT
                    )
                    s2T = tl.where(ok, s2T, float("-inf"))
                pT = score_exp(s2T - lse2[None, :], IEEE)
                do = load2d(DO_base + rows[:, None] * sds + offs_d[None, :] * sdd, q_ok, d_ok, REGION != 0, PAD_D)
                if DROPOUT:  # dV takes the dropped probabilities, dP the same mask and scale
                    keepT = dropout_keep(seed, bh, rows[None, :], keys, drop_threshold)
                    dv = dot(tl.where(keepT, pT * drop_scale, 0.0).to(do.dtype), do, dv, IEEE)
                else:
                    dv = dot(pT.to(do.dtype), do, dv, IEEE)
                delta = load1d(D_base + rows, q_ok, REGION != 0)
                # dP formed as _attn_bwd_dq forms it, so delta (its row sums there) cancels it to the same rounding
                if IEEE:
                    dpT = tl.trans(mm(do, tl.trans(v), IEEE))
                else:
                    dpT = dot(v, tl.trans(do), tl.zeros([k.shape[0], qT.shape[1]], dtype=tl.float32), IEEE)
                if DROPOUT:
                    dpT = tl.where(keepT, dpT * drop_scale, 0.0)
                dsT = (pT * (dpT - delta[None, :])).to(tl.float32)  # fp64 dP and delta on the fp32 path
                if SOFTCAP:
                    dsT = dsT * (1.0 - thT * thT)
                dk = dot(dsT.to(qT.dtype), tl.trans(qT), dk, IEEE)
    dk = dk * scale
    tl.store(
        DK + b64 * sdkb + k_start * sdks + kvh64 * sdkh + offs_n[:, None] * sdks + offs_d[None, :] * sdkd,
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b64 * sdvb + k_start * sdvs + kvh64 * sdvh + offs_n[:, None] * sdvs + offs_d[None, :] * sdvd,
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _attn_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    LSE_FIX,
    MASK,
    SEED,
    DQ,
    CU_Q,
    CU_K,
    sqb,
    sqs,
    sqh,
    sqd,
    skb,
    sks,
    skh,
    skd,
    svb,
    svs,
    svh,
    svd,
    sdb,
    sds,
    sdh,
    sdd,
    sdqb,
    sdqs,
    sdqh,
    sdqd,
    slb,
    slh,
    smb,
    smh,
    smq,
    smk,
    seqlen_q,
    seqlen_k,
    group,
    scale,
    qk_scale,
    sc_in,
    sc_out,
    window_left,
    window_right,
    drop_threshold,
    drop_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr,
    VARLEN: tl.constexpr,
    BOTTOM_RIGHT: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    DROPOUT: tl.constexpr,
    IEEE: tl.constexpr,
    EXACT_DELTA: tl.constexpr,
):
    """Grid (query blocks, q heads, batch), longest rows first as in the forward.

    fp16/bf16 make one pass over the key blocks (PASS 1), accumulating dQ. fp32 (IEEE) first makes PASS 0, which
    only sums dsum = sum_j P_ij dP_ij and psum = sum_j P_ij (fp64), for PyTorch's delta sum_j P_ij dP_ij, here over
    sum_j P_ij: P = exp(s - lse) sums to 1 only within ulps of the fp32 lse, and dP - delta cancels, amplifying any
    such residue. A row with one visible key gets P = 1 and dS = 0 exactly, as in PyTorch.

    EXACT_DELTA (fp16/bf16, small head dims: attention.exact_delta) makes PASS 0 too, in fp32: rowsum(dO * O) from
    the rounded O is off by |dO| |O| ulps of O, which a near one-hot row (large logits) turns into all of its dS,
    where sum_j P_ij dP_ij is exact to fp32."""
    b64, h64, kvh64, q_start, k_start, seqlen_q, seqlen_k, m0, diag = query_program(
        CU_Q, CU_K, seqlen_q, seqlen_k, group, BLOCK_M, VARLEN, BOTTOM_RIGHT
    )
    if VARLEN:
        if m0 >= seqlen_q:
            return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m[:, None]
    row_ok = offs_m < seqlen_q
    q_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(
        Q + b64 * sqb + q_start * sqs + h64 * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
        mask=q_mask,
        other=0.0,
    )
    do = tl.load(
        DO + b64 * sdb + q_start * sds + h64 * sdh + offs_m[:, None] * sds + offs_d[None, :] * sdd,
        mask=q_mask,
        other=0.0,
    )
    row = b64 * slb + h64 * slh + q_start + offs_m
    lse2 = score_units(tl.load(LSE + row, mask=row_ok, other=0.0), IEEE)
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    K_base = K + b64 * skb + k_start * sks + kvh64 * skh
    V_base = V + b64 * svb + k_start * svs + kvh64 * svh
    M_base = MASK + b64 * smb + h64 * smh
    if DROPOUT:
        seed = tl.load(SEED)
        bh = b64 * tl.num_programs(1) + h64
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if IEEE:
        dsum = tl.zeros([BLOCK_M], dtype=tl.float64)
    else:
        dsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    psum = dsum
    lo, mid_lo, mid_hi, hi = kv_range(
        m0, seqlen_q, seqlen_k, diag, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    for PASS in tl.static_range(0 if IEEE or EXACT_DELTA else 1, 2):
        if IEEE:
            if PASS == 0:
                lse2 = lse2.to(tl.float64)
        if IEEE or EXACT_DELTA:
            if PASS == 1:
                # delta = sum_j P_ij dP_ij / sum_j P_ij (minus dlse, already in DELTA; fp64 on the fp32 path), for
                # this kernel and _attn_bwd_dkdv
                delta = delta + tl.where(psum > 0, dsum / tl.where(psum > 0, psum, 1.0), 0.0)
                tl.store(DELTA + row, delta, mask=row_ok)
        if IEEE:
            if PASS == 1:
                # The fp32 lse is only good to half an ulp (1e-6 at lse 20), and a row whose top key dominates takes
                # that whole error into P = exp(s - lse), beyond the 2x rule in dV. lse + log(sum_j P_ij), in fp64,
                # makes the row sum to 1 in pass 1 and in _attn_bwd_dkdv (which reads it from LSE_FIX).
                lse2 = lse2 + tl.log(tl.where(psum > 0, psum, 1.0))
                tl.store(LSE_FIX + row, lse2, mask=row_ok)
        for REGION in tl.static_range(3):
            start, end = region(REGION, lo, mid_lo, mid_hi, hi)
            for start_n in range(start, end, BLOCK_N):
                cols = start_n + offs_n
                d_ok = offs_d < HEAD_DIM
                kv_ok = cols < seqlen_k
                kT = load2d(K_base + cols[None, :] * sks + offs_d[:, None] * skd, d_ok, kv_ok, PAD_D, REGION != 0)
                vT = load2d(V_base + cols[None, :] * svs + offs_d[:, None] * svd, d_ok, kv_ok, PAD_D, REGION != 0)
                s = mm(q, kT, IEEE)
                s2, th = scores(s, qk_scale, sc_in, sc_out, SOFTCAP, IEEE)
                s2 = apply_mask(s2, M_base, rows, cols[None, :], smq, smk, seqlen_q, seqlen_k, diag, MASK_KIND, IEEE)
                if REGION != 0:
                    ok = allowed(
                        rows, cols[None, :], seqlen_q, seqlen_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT
                    )
                    s2 = tl.where(ok, s2, float("-inf"))
                p = score_exp(s2 - lse2[:, None], IEEE)
                dp = mm(do, vT, IEEE)
                if DROPOUT:
                    dp = tl.where(dropout_keep(seed, bh, rows, cols[None, :], drop_threshold), dp * drop_scale, 0.0)
                if PASS == 0:
                    dsum = dsum + tl.sum(p * dp, 1)
                    psum = psum + tl.sum(p.to(psum.dtype), 1)  # fp64 on the fp32 path
                else:
                    ds = (p * (dp - delta[:, None])).to(tl.float32)  # fp64 dP and delta on the fp32 path
                    if SOFTCAP:
                        ds = ds * (1.0 - th * th)
                    dq = dot(ds.to(kT.dtype), tl.trans(kT), dq, IEEE)
    dq = dq * scale
    tl.store(
        DQ + b64 * sdqb + q_start * sdqs + h64 * sdqh + offs_m[:, None] * sdqs + offs_d[None, :] * sdqd,
        dq.to(DQ.dtype.element_ty),
        mask=q_mask,
    )


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
