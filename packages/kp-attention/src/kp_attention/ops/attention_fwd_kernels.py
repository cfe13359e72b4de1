"""Triton kernel of the FlashAttention-2 forward; the maths is in kp_attention.ops.attention_blocks' docstring.

The launchers, the PyTorch reference and the op declarations are in kp_attention.ops.attention; the backward
kernels are in kp_attention.ops.attention_bwd_kernels; the conformance spec is conformance/specs/test_attention.py.

TMA (a switch of _attn_fwd, Triton >= 3.4): the Q, K and V tiles come through tensor descriptors made on the
device (tl.make_tensor_descriptor: on Hopper, the TMA unit copies each tile into shared memory and zero-fills
rows past the sequence's end) instead of pointer loads; every mask, the block ranges and the maths are the
pointer path's. The launcher takes it only where descriptors can address the tensors (see attention.tma_ok).
"""

import triton
import triton.language as tl

from kp_attention.ops.attention_blocks import (
    allowed,
    apply_mask,
    dot,
    dropout_keep,
    kv_range,
    load2d,
    mm,
    query_program,
    region,
    score_exp,
    scores,
)
from kp_core import jit_keys
from kp_core.kernel_constants import LN2


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    LSE,
    MASK,
    SEED,
    CU_Q,
    CU_K,
    BT,
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
    sob,
    sos,
    soh,
    sod,
    slb,
    slh,
    smb,
    smh,
    smq,
    smk,
    seqlen_q,
    seqlen_k,
    group,
    qk_scale,
    sc_in,
    sc_out,
    window_left,
    window_right,
    drop_threshold,
    drop_scale,
    sbt,
    num_blocks,
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
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    TMA: tl.constexpr,
):
    """Grid (query blocks, q heads, batch). Query blocks run last-first: under a causal mask the longest rows (most
    key blocks) start first, which balances the tail.

    fp16/bf16 make one pass over the key blocks (PASS 1), the online softmax of FlashAttention-2: acc and l are
    rescaled by exp2(m_old - m_new) as the row max grows. fp32 (IEEE) makes two: PASS 0 gathers the row max m
    and sum l only, then PASS 1 accumulates (exp(s - m) / l) @ v, the normalised probabilities PyTorch's
    softmax-then-matmul forms (the one-pass deferred normalisation costs fp32 ulps the 2x rule does not allow,
    and exp(s - lse) would carry lse's rounding, an ulp of a large lse, into every p). Twice the score work, on
    the correctness path only. PAGED (varlen, forward only): K and V are (num_blocks, PAGE, Hkv, D) pages, key j
    of sequence b in page BT[b, j // PAGE] at slot j % PAGE (BLOCK_N divides PAGE: one page per key block; a
    page id outside the cache is clamped into it, the launcher's check refuses it). DROPOUT zeroes the dropped p
    before p @ v (l sums them all) and scales o by 1 / (1 - p)."""
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
    Q_base = Q + b64 * sqb + q_start * sqs + h64 * sqh
    K_base = K + b64 * skb + k_start * sks + kvh64 * skh
    V_base = V + b64 * svb + k_start * svs + kvh64 * svh
    M_base = MASK + b64 * smb + h64 * smh
    if DROPOUT:
        seed = tl.load(SEED)
        bh = b64 * tl.num_programs(1) + h64
    q_mask = (offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    if TMA:  # (batch, seq, head, dim) descriptors, one tile a load: [1, rows, 1, dim]; dim stride 1
        b32, h32, kvh32 = b64.to(tl.int32), h64.to(tl.int32), kvh64.to(tl.int32)
        n_b, n_hq = tl.num_programs(2), tl.num_programs(1)
        q_desc = tl.make_tensor_descriptor(
            Q, shape=[n_b, seqlen_q, n_hq, HEAD_DIM], strides=[sqb, sqs, sqh, 1], block_shape=[1, BLOCK_M, 1, BLOCK_D]
        )
        kv_shape = [n_b, seqlen_k, n_hq // group, HEAD_DIM]
        k_desc = tl.make_tensor_descriptor(K, kv_shape, [skb, sks, skh, 1], [1, BLOCK_N, 1, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(V, kv_shape, [svb, svs, svh, 1], [1, BLOCK_N, 1, BLOCK_D])
        q = q_desc.load([b32, m0, h32, 0]).reshape([BLOCK_M, BLOCK_D])
    else:
        q = tl.load(Q_base + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = kv_range(
        m0, seqlen_q, seqlen_k, diag, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    for PASS in tl.static_range(0 if IEEE else 1, 2):
        if IEEE:
            if PASS == 1:  # m_i and l_i now hold the row's final max and sum
                empty = l_i == 0.0  # every key masked: o = 0, lse = -inf
                lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
                l_i = tl.where(empty, 1.0, l_i)
                m_i = tl.where(empty, 0.0, m_i)
        for REGION in tl.static_range(3):
            start, end = region(REGION, lo, mid_lo, mid_hi, hi)
            for start_n in range(start, end, BLOCK_N):
                cols = start_n + offs_n
                d_ok = offs_d < HEAD_DIM
                kv_ok = cols < seqlen_k
                if PAGED:  # this key block's page, addressed so that + cols * stride lands in it
                    page = tl.load(BT + b64 * sbt + start_n // PAGE)
                    page = tl.minimum(tl.maximum(page, 0), num_blocks - 1).to(tl.int64)
                    back = page * 0 + (start_n % PAGE - start_n)  # int64: from the block's first key to its slot
                    K_base = K + page * skb + kvh64 * skh + back * sks
                    V_base = V + page * svb + kvh64 * svh + back * svs
                if TMA:
                    kT = tl.trans(k_desc.load([b32, start_n, kvh32, 0]).reshape([BLOCK_N, BLOCK_D]))
                else:
                    kT = load2d(K_base + cols[None, :] * sks + offs_d[:, None] * skd, d_ok, kv_ok, PAD_D, REGION != 0)
                s = mm(q, kT, IEEE)
                s2, _ = scores(s, qk_scale, sc_in, sc_out, SOFTCAP, IEEE)
                s2 = apply_mask(s2, M_base, rows, cols[None, :], smq, smk, seqlen_q, seqlen_k, diag, MASK_KIND, IEEE)
                if REGION != 0:
                    ok = allowed(
                        rows, cols[None, :], seqlen_q, seqlen_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT
                    )
                    s2 = tl.where(ok, s2, float("-inf"))
                if IEEE and PASS == 1:
                    p = score_exp(s2 - m_i[:, None], IEEE) / l_i[:, None]
                else:
                    m_new = tl.maximum(m_i, tl.max(s2, 1))
                    if REGION != 0 or MASK_KIND != 0:  # a row may have no key yet: keep exp2 away from (-inf) - (-inf)
                        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                    else:
                        m_use = m_new
                    p = score_exp(s2 - m_use[:, None], IEEE)
                    alpha = score_exp(m_i - m_use, IEEE)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    if not IEEE:
                        acc = acc * alpha[:, None]
                    m_i = m_new
                if PASS == 1:
                    if DROPOUT:
                        p = tl.where(dropout_keep(seed, bh, rows, cols[None, :], drop_threshold), p, 0.0)
                    if TMA:
                        v = v_desc.load([b32, start_n, kvh32, 0]).reshape([BLOCK_N, BLOCK_D])
                    else:
                        v_ptrs = V_base + cols[:, None] * svs + offs_d[None, :] * svd
                        v = load2d(v_ptrs, kv_ok, d_ok, REGION != 0, PAD_D)
                    acc = dot(p.to(v.dtype), v, acc, IEEE)
    if IEEE:
        out = acc
    else:
        empty = l_i == 0.0  # every key masked: o = 0, lse = -inf
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    if DROPOUT:
        out = out * drop_scale
    O_base = Out + b64 * sob + q_start * sos + h64 * soh
    tl.store(O_base + offs_m[:, None] * sos + offs_d[None, :] * sod, out.to(Out.dtype.element_ty), mask=q_mask)
    tl.store(LSE + b64 * slb + h64 * slh + q_start + offs_m, lse, mask=offs_m < seqlen_q)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
