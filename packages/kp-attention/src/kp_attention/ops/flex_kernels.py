"""Triton kernels of flex attention: FlashAttention-2 over a block-sparse mask, with traced mods.

Per (batch b, q head h) and the block mask's row of query block qb (Q_BLOCK rows):
    s_ij = score_mod(scale * q_i . k_j, b, h, i, j)         (SCORE_MOD, a function flex_codegen wrote)
    s_ij = -inf unless mask_mod(b, h, i, j) and j < Sk      (MASK_MOD, on partial blocks only)
    lse_i = log sum_j exp(s_ij),  o_i = sum_j exp(s_ij - lse_i) [keep_ij / (1 - p)] v_j
Key blocks come from the block mask (kp_attention.flex.BlockMask): FULL_* lists the blocks where mask_mod holds
everywhere (no mask work), KV_* the partial ones; other blocks are never visited. The backward recomputes P and
dS_ij = P_ij (dP_ij - delta_i) as attention_bwd_kernels does, then takes dS through score_mod's generated
backward (which also adds the gradients of captured tensors, in the dQ kernel only, so each adds once). The dK/dV
kernel walks the transposed lists (Q_*). fp32 inputs follow the fixed-function kernels' two-pass scheme
(attention_fwd_kernels, attention_bwd_kernels): the maths and its reasons are in attention_blocks' docstring.
"""

import triton
import triton.language as tl

from kp_attention.ops.attention_blocks import dot, dropout_keep, mm, query_program, score_exp, score_units
from kp_core import jit_keys
from kp_core.kernel_constants import LN2


@triton.jit
def _modded(
    s,
    b,
    h,
    rows,
    cols,
    seqlen_k,
    SC0,
    SC1,
    SC2,
    SC3,
    SMETA,
    MC0,
    MC1,
    MC2,
    MC3,
    MMETA,
    SCORE_MOD: tl.constexpr,
    MASK_MOD: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    """(score after score_mod, keep): keep is the key bound, and mask_mod on a partial block."""
    if SCORE_MOD is not None:
        s = SCORE_MOD(s, b, h, rows, cols, SC0, SC1, SC2, SC3, SMETA)
    keep = (cols < seqlen_k) & (rows >= 0)
    if PARTIAL:
        if MASK_MOD is not None:
            keep = keep & MASK_MOD(b, h, rows, cols, MC0, MC1, MC2, MC3, MMETA)
    return s, keep


@triton.jit
def _flex_fwd(
    Q,
    K,
    V,
    Out,
    LSE,
    KV_NUM,
    KV_IDX,
    FULL_NUM,
    FULL_IDX,
    SEED,
    SC0,
    SC1,
    SC2,
    SC3,
    SMETA,
    MC0,
    MC1,
    MC2,
    MC3,
    MMETA,
    O_PART,
    L_PART,
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
    snb,
    snh,
    sib,
    sih,
    siq,
    seqlen_q,
    seqlen_k,
    group,
    scale,
    drop_threshold,
    drop_scale,
    n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    MASK_MOD: tl.constexpr,
    HAS_FULL: tl.constexpr,
    DROPOUT: tl.constexpr,
    IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Grid (query blocks, q heads, batch), last block first. LSE is (B, Hq, Sq) contiguous; KV_NUM/FULL_NUM are
    (B', H', query mask blocks) with strides (snb, snh, 1), KV_IDX/FULL_IDX (B', H', blocks, kv blocks) with
    (sib, sih, siq, 1) (B' and H' are 1 or B and Hq: a stride 0 broadcasts). fp32 (IEEE) makes two passes, as
    attention_fwd_kernels._attn_fwd does.

    SPLIT (flash-decoding, fp16/bf16, few query blocks): axis 0 also counts n_splits splits of each row's block
    list; a split attends its share of the blocks and writes its normalised output and lse (fp32) to O_PART
    (splits, B, Hq, Sq, D) and L_PART (splits, B, Hq, Sq), which _flex_combine merges."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)  # longest rows first, as attention_blocks.query_program
    split = pid % n_splits
    m0 = (pid // n_splits) * BLOCK_M
    h64 = tl.program_id(1).to(tl.int64)
    b64 = tl.program_id(2).to(tl.int64)
    kvh64 = h64 // group
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m[:, None]
    b32 = b64.to(tl.int32)
    h32 = h64.to(tl.int32)
    d_ok = offs_d < HEAD_DIM
    q_mask = (offs_m < seqlen_q)[:, None] & d_ok[None, :]
    q = tl.load(Q + b64 * sqb + h64 * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
    K_base = K + b64 * skb + kvh64 * skh
    V_base = V + b64 * svb + kvh64 * svh
    qb = m0 // Q_BLOCK
    row_n = b64 * snb + h64 * snh + qb
    row_i = b64 * sib + h64 * sih + qb * siq
    if DROPOUT:
        seed = tl.load(SEED)
        bh = b64 * tl.num_programs(1) + h64
    # counts past a list's width (siq) and negative indices are clamped: a hand-made BlockMask stays in bounds
    n_full = tl.minimum(tl.load(FULL_NUM + row_n), siq) * HAS_FULL
    n_total = n_full + tl.minimum(tl.load(KV_NUM + row_n), siq)
    chunk = (n_total + n_splits - 1) // n_splits  # this split's share of the list: full blocks, then partial
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_total)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for PASS in tl.static_range(0 if IEEE else 1, 2):
        if IEEE:
            if PASS == 1:  # m_i and l_i hold the row's final max and sum
                empty = l_i == 0.0
                lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
                l_i = tl.where(empty, 1.0, l_i)
                m_i = tl.where(empty, 0.0, m_i)
        for PART in tl.static_range(0 if HAS_FULL else 1, 2):  # 0 full blocks, 1 partial blocks
            if PART == 0:
                first = lo
                last = tl.minimum(hi, n_full)
            else:
                first = tl.maximum(lo, n_full) - n_full
                last = hi - n_full
            for i in range(first, last):
                if PART == 0:
                    kb = tl.maximum(tl.load(FULL_IDX + row_i + i), 0)
                else:
                    kb = tl.maximum(tl.load(KV_IDX + row_i + i), 0)
                for sub in range(0, KV_BLOCK // BLOCK_N):
                    cols = kb * KV_BLOCK + sub * BLOCK_N + offs_n
                    kv_ok = cols < seqlen_k
                    kT = tl.load(
                        K_base + cols[None, :] * sks + offs_d[:, None] * skd,
                        mask=d_ok[:, None] & kv_ok[None, :],
                        other=0.0,
                    )
                    s = (mm(q, kT, IEEE) * scale).to(tl.float32)
                    s, keep = _modded(
                        s,
                        b32,
                        h32,
                        rows,
                        cols[None, :],
                        seqlen_k,
                        SC0,
                        SC1,
                        SC2,
                        SC3,
                        SMETA,
                        MC0,
                        MC1,
                        MC2,
                        MC3,
                        MMETA,
                        SCORE_MOD,
                        MASK_MOD,
                        PART == 1,
                    )
                    s2 = score_units(tl.where(keep, s, float("-inf")), IEEE)
                    if IEEE and PASS == 1:
                        p = score_exp(s2 - m_i[:, None], IEEE) / l_i[:, None]
                    else:
                        m_new = tl.maximum(m_i, tl.max(s2, 1))
                        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
                        p = score_exp(s2 - m_use[:, None], IEEE)
                        alpha = score_exp(m_i - m_use, IEEE)
                        l_i = l_i * alpha + tl.sum(p, 1)
                        if not IEEE:
                            acc = acc * alpha[:, None]
                        m_i = m_new
                    if PASS == 1:
                        if DROPOUT:
                            p = tl.where(dropout_keep(seed, bh, rows, cols[None, :], drop_threshold), p, 0.0)
                        v = tl.load(
                            V_base + cols[:, None] * svs + offs_d[None, :] * svd,
                            mask=kv_ok[:, None] & d_ok[None, :],
                            other=0.0,
                        )
                        acc = dot(p.to(v.dtype), v, acc, IEEE)
    if IEEE:
        out = acc
    else:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    if DROPOUT:
        out = out * drop_scale
    row = (b64 * tl.num_programs(1) + h64) * seqlen_q + offs_m
    if SPLIT:  # (split, batch, head, row) of the workspaces, contiguous
        part = split.to(tl.int64) * tl.num_programs(2) * tl.num_programs(1) * seqlen_q + row
        tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=q_mask)
        tl.store(L_PART + part, lse, mask=offs_m < seqlen_q)
    else:
        O_base = Out + b64 * sob + h64 * soh
        tl.store(O_base + offs_m[:, None] * sos + offs_d[None, :] * sod, out.to(Out.dtype.element_ty), mask=q_mask)
        tl.store(LSE + row, lse, mask=offs_m < seqlen_q)


@triton.jit
def _flex_combine(
    O_PART,
    L_PART,
    Out,
    LSE,
    sob,
    sos,
    soh,
    sod,
    seqlen_q,
    n_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (query blocks, q heads, batch): out = sum_s w_s o_s / sum_s w_s, w_s = exp(lse_s - max lse), and
    lse = max + log(sum_s w_s), over the splits of _flex_fwd (SPLIT); rows no split saw give 0 and -inf."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    h64 = tl.program_id(1).to(tl.int64)
    b64 = tl.program_id(2).to(tl.int64)
    row_ok = offs_m < seqlen_q
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    row = (b64 * tl.num_programs(1) + h64) * seqlen_q + offs_m
    stride = tl.num_programs(2) * tl.num_programs(1) * seqlen_q  # one split's rows
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for s in range(0, n_splits):
        m = tl.maximum(m, tl.load(L_PART + s * stride + row, mask=row_ok, other=float("-inf")))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for s in range(0, n_splits):
        w = tl.exp(tl.load(L_PART + s * stride + row, mask=row_ok, other=float("-inf")) - m_use)
        o = tl.load(O_PART + (s * stride + row)[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
        total += w
        acc += w[:, None] * o
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), m_use + tl.log(tl.where(empty, 1.0, total)))
    tl.store(
        Out + b64 * sob + h64 * soh + offs_m[:, None] * sos + offs_d[None, :] * sod,
        out.to(Out.dtype.element_ty),
        mask=mask,
    )
    tl.store(LSE + row, lse, mask=row_ok)


@triton.jit
def _flex_bwd_dq(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    LSE_FIX,
    DQ,
    KV_NUM,
    KV_IDX,
    FULL_NUM,
    FULL_IDX,
    SEED,
    SC0,
    SC1,
    SC2,
    SC3,
    SMETA,
    SG0,
    SG1,
    SG2,
    SG3,
    MC0,
    MC1,
    MC2,
    MC3,
    MMETA,
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
    snb,
    snh,
    sib,
    sih,
    siq,
    seqlen_q,
    seqlen_k,
    group,
    scale,
    drop_threshold,
    drop_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_BWD: tl.constexpr,
    MASK_MOD: tl.constexpr,
    HAS_FULL: tl.constexpr,
    DROPOUT: tl.constexpr,
    IEEE: tl.constexpr,
    EXACT_DELTA: tl.constexpr,
):
    """Grid (query blocks, q heads, batch): dQ of one query block, and the captured tensors' gradients. DQ has
    q's strides. PASS 0 (fp32, and EXACT_DELTA) sums delta = sum_j P_ij dP_ij / sum_j P_ij into DELTA (and the
    corrected fp32 lse into LSE_FIX) for this kernel's PASS 1 and the dK/dV kernel, as
    attention_bwd_kernels._attn_bwd_dq does."""
    b64, h64, kvh64, q_start, k_start, seqlen_q, seqlen_k, m0, diag = query_program(
        SEED, SEED, seqlen_q, seqlen_k, group, BLOCK_M, False, False
    )
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rows = offs_m[:, None]
    b32 = b64.to(tl.int32)
    h32 = h64.to(tl.int32)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < seqlen_q
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b64 * sqb + h64 * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=q_mask, other=0.0)
    do = tl.load(DO + b64 * sdb + h64 * sdh + offs_m[:, None] * sds + offs_d[None, :] * sdd, mask=q_mask, other=0.0)
    row = (b64 * tl.num_programs(1) + h64) * seqlen_q + offs_m
    lse2 = score_units(tl.load(LSE + row, mask=row_ok, other=0.0), IEEE)
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    K_base = K + b64 * skb + kvh64 * skh
    V_base = V + b64 * svb + kvh64 * svh
    qb = m0 // Q_BLOCK
    row_n = b64 * snb + h64 * snh + qb
    row_i = b64 * sib + h64 * sih + qb * siq
    if DROPOUT:
        seed = tl.load(SEED)
        bh = b64 * tl.num_programs(1) + h64
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if IEEE:
        dsum = tl.zeros([BLOCK_M], dtype=tl.float64)
    else:
        dsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    psum = dsum
    for PASS in tl.static_range(0 if IEEE or EXACT_DELTA else 1, 2):
        if IEEE:
            if PASS == 0:
                lse2 = lse2.to(tl.float64)
        if IEEE or EXACT_DELTA:
            if PASS == 1:
                delta = delta + tl.where(psum > 0, dsum / tl.where(psum > 0, psum, 1.0), 0.0)
                tl.store(DELTA + row, delta, mask=row_ok)
        if IEEE:
            if PASS == 1:  # each row's P sums to 1 in fp64 (see attention_bwd_kernels._attn_bwd_dq)
                lse2 = lse2 + tl.log(tl.where(psum > 0, psum, 1.0))
                tl.store(LSE_FIX + row, lse2, mask=row_ok)
        for PART in tl.static_range(0 if HAS_FULL else 1, 2):
            if PART == 0:
                n_blocks = tl.minimum(tl.load(FULL_NUM + row_n), siq)
            else:
                n_blocks = tl.minimum(tl.load(KV_NUM + row_n), siq)
            for i in range(0, n_blocks):
                if PART == 0:
                    kb = tl.maximum(tl.load(FULL_IDX + row_i + i), 0)
                else:
                    kb = tl.maximum(tl.load(KV_IDX + row_i + i), 0)
                for sub in range(0, KV_BLOCK // BLOCK_N):
                    cols = kb * KV_BLOCK + sub * BLOCK_N + offs_n
                    kv_ok = cols < seqlen_k
                    tile_ok = d_ok[:, None] & kv_ok[None, :]
                    kT = tl.load(K_base + cols[None, :] * sks + offs_d[:, None] * skd, mask=tile_ok, other=0.0)
                    vT = tl.load(V_base + cols[None, :] * svs + offs_d[:, None] * svd, mask=tile_ok, other=0.0)
                    raw = (mm(q, kT, IEEE) * scale).to(tl.float32)
                    s, keep = _modded(
                        raw,
                        b32,
                        h32,
                        rows,
                        cols[None, :],
                        seqlen_k,
                        SC0,
                        SC1,
                        SC2,
                        SC3,
                        SMETA,
                        MC0,
                        MC1,
                        MC2,
                        MC3,
                        MMETA,
                        SCORE_MOD,
                        MASK_MOD,
                        PART == 1,
                    )
                    s2 = score_units(tl.where(keep, s, float("-inf")), IEEE)
                    p = score_exp(s2 - lse2[:, None], IEEE)
                    dp = mm(do, vT, IEEE)
                    if DROPOUT:
                        dp = tl.where(dropout_keep(seed, bh, rows, cols[None, :], drop_threshold), dp * drop_scale, 0.0)
                    if PASS == 0:
                        dsum = dsum + tl.sum(p * dp, 1)
                        psum = psum + tl.sum(p.to(psum.dtype), 1)
                    else:
                        ds = (p * (dp - delta[:, None])).to(tl.float32)
                        if SCORE_BWD is not None:
                            valid = keep & (rows < seqlen_q)
                            ds = SCORE_BWD(
                                ds,
                                raw,
                                b32,
                                h32,
                                rows,
                                cols[None, :],
                                SC0,
                                SC1,
                                SC2,
                                SC3,
                                SMETA,
                                SG0,
                                SG1,
                                SG2,
                                SG3,
                                valid,
                            )
                        dq = dot(ds.to(kT.dtype), tl.trans(kT), dq, IEEE)
    dq = dq * scale
    tl.store(
        DQ + b64 * sqb + h64 * sqh + offs_m[:, None] * sqs + offs_d[None, :] * sqd,
        dq.to(DQ.dtype.element_ty),
        mask=q_mask,
    )


@triton.jit
def _flex_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    Q_NUM,
    Q_IDX,
    FULLQ_NUM,
    FULLQ_IDX,
    SEED,
    SC0,
    SC1,
    SC2,
    SC3,
    SMETA,
    MC0,
    MC1,
    MC2,
    MC3,
    MMETA,
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
    snb,
    snh,
    sib,
    sih,
    siq,
    seqlen_q,
    seqlen_k,
    group,
    scale,
    drop_threshold,
    drop_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    SCORE_MOD: tl.constexpr,
    SCORE_BWD: tl.constexpr,
    MASK_MOD: tl.constexpr,
    HAS_FULL: tl.constexpr,
    DROPOUT: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Grid (key blocks, kv heads, batch): dK, dV of one key block summed over the group's q heads, walking the
    query blocks of the transposed lists (Q_NUM (B', H', kv mask blocks), Q_IDX (..., q blocks)). DK and DV have
    k's and v's strides; LSE is the fp32 path's corrected one (LSE_FIX of the dQ kernel, fp64) or the forward's."""
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b64 = tl.program_id(2).to(tl.int64)
    kvh64 = kvh.to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    keys = offs_n[:, None]
    b32 = b64.to(tl.int32)
    d_ok = offs_d < HEAD_DIM
    kv_mask = (offs_n < seqlen_k)[:, None] & d_ok[None, :]
    k = tl.load(K + b64 * skb + kvh64 * skh + offs_n[:, None] * sks + offs_d[None, :] * skd, mask=kv_mask, other=0.0)
    v = tl.load(V + b64 * svb + kvh64 * svh + offs_n[:, None] * svs + offs_d[None, :] * svd, mask=kv_mask, other=0.0)
    if DROPOUT:
        seed = tl.load(SEED)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    kb = n0 // KV_BLOCK
    for g in range(0, group):
        h64 = (kvh * group + g).to(tl.int64)
        h32 = h64.to(tl.int32)
        Q_base = Q + b64 * sqb + h64 * sqh
        DO_base = DO + b64 * sdb + h64 * sdh
        L_base = LSE + (b64 * tl.num_programs(1) * group + h64) * seqlen_q
        row_n = b64 * snb + h64 * snh + kb
        row_i = b64 * sib + h64 * sih + kb * siq
        bh = b64 * tl.num_programs(1) * group + h64
        for PART in tl.static_range(0 if HAS_FULL else 1, 2):
            if PART == 0:
                n_blocks = tl.minimum(tl.load(FULLQ_NUM + row_n), siq)
            else:
                n_blocks = tl.minimum(tl.load(Q_NUM + row_n), siq)
            for i in range(0, n_blocks):
                if PART == 0:
                    qb = tl.maximum(tl.load(FULLQ_IDX + row_i + i), 0)
                else:
                    qb = tl.maximum(tl.load(Q_IDX + row_i + i), 0)
                for sub in range(0, Q_BLOCK // BLOCK_M):
                    rows = qb * Q_BLOCK + sub * BLOCK_M + offs_m
                    q_ok = rows < seqlen_q
                    qT = tl.load(
                        Q_base + rows[None, :] * sqs + offs_d[:, None] * sqd,
                        mask=d_ok[:, None] & q_ok[None, :],
                        other=0.0,
                    )
                    lse2 = score_units(tl.load(L_base + rows, mask=q_ok, other=0.0), IEEE)
                    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
                    if IEEE:
                        rawT = tl.trans(mm(tl.trans(qT), tl.trans(k), IEEE))
                    else:
                        rawT = dot(k, qT, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
                    rawT = (rawT * scale).to(tl.float32)
                    sT, keepT = _modded(
                        rawT,
                        b32,
                        h32,
                        rows[None, :],
                        keys,
                        seqlen_k,
                        SC0,
                        SC1,
                        SC2,
                        SC3,
                        SMETA,
                        MC0,
                        MC1,
                        MC2,
                        MC3,
                        MMETA,
                        SCORE_MOD,
                        MASK_MOD,
                        PART == 1,
                    )
                    keepT = keepT & q_ok[None, :]
                    s2T = score_units(tl.where(keepT, sT, float("-inf")), IEEE)
                    pT = score_exp(s2T - lse2[None, :], IEEE)
                    do = tl.load(
                        DO_base + rows[:, None] * sds + offs_d[None, :] * sdd,
                        mask=q_ok[:, None] & d_ok[None, :],
                        other=0.0,
                    )
                    if DROPOUT:
                        dropT = dropout_keep(seed, bh, rows[None, :], keys, drop_threshold)
                        dv = dot(tl.where(dropT, pT * drop_scale, 0.0).to(do.dtype), do, dv, IEEE)
                    else:
                        dv = dot(pT.to(do.dtype), do, dv, IEEE)
                    delta = tl.load(
                        DELTA + (b64 * tl.num_programs(1) * group + h64) * seqlen_q + rows, mask=q_ok, other=0.0
                    )
                    if IEEE:
                        dpT = tl.trans(mm(do, tl.trans(v), IEEE))
                    else:
                        dpT = dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
                    if DROPOUT:
                        dpT = tl.where(dropT, dpT * drop_scale, 0.0)
                    dsT = (pT * (dpT - delta[None, :])).to(tl.float32)
                    if SCORE_BWD is not None:  # the captures' gradients are the dQ kernel's: none added here
                        dsT = SCORE_BWD(
                            dsT,
                            rawT,
                            b32,
                            h32,
                            rows[None, :],
                            keys,
                            SC0,
                            SC1,
                            SC2,
                            SC3,
                            SMETA,
                            SC0,
                            SC1,
                            SC2,
                            SC3,
                            keepT & (keys < 0),
                        )
                    dk = dot(dsT.to(qT.dtype), tl.trans(qT), dk, IEEE)
    dk = dk * scale
    tl.store(
        DK + b64 * skb + kvh64 * skh + offs_n[:, None] * sks + offs_d[None, :] * skd,
        dk.to(DK.dtype.element_ty),
        mask=kv_mask,
    )
    tl.store(
        DV + b64 * svb + kvh64 * svh + offs_n[:, None] * svs + offs_d[None, :] * svd,
        dv.to(DV.dtype.element_ty),
        mask=kv_mask,
    )


@triton.jit
def _flex_block_classes(
    CLS,
    MC0,
    MC1,
    MC2,
    MC3,
    MMETA,
    seqlen_q,
    seqlen_k,
    n_kv_blocks,
    Q_BLOCK: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    SUB_M: tl.constexpr,
    SUB_N: tl.constexpr,
    MASK_MOD: tl.constexpr,
):
    """Grid (query mask blocks, H', B'): CLS[b, h, qb, kb] (int8, contiguous) = 0 where mask_mod is False on
    every in-bounds element of the block, 2 where it is True on all of them, 1 otherwise (partial)."""
    qb = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    out = CLS + ((b.to(tl.int64) * tl.num_programs(1) + h) * tl.num_programs(0) + qb) * n_kv_blocks
    offs_m = tl.arange(0, SUB_M)
    offs_n = tl.arange(0, SUB_N)
    for kb in range(0, n_kv_blocks):
        seen = tl.zeros([SUB_M, SUB_N], dtype=tl.int32)
        held = tl.zeros([SUB_M, SUB_N], dtype=tl.int32)
        for sm in range(0, Q_BLOCK // SUB_M):
            rows = qb * Q_BLOCK + sm * SUB_M + offs_m[:, None]
            for sn in range(0, KV_BLOCK // SUB_N):
                cols = kb * KV_BLOCK + sn * SUB_N + offs_n[None, :]
                inb = (rows < seqlen_q) & (cols < seqlen_k)
                keep = MASK_MOD(b, h, rows, cols, MC0, MC1, MC2, MC3, MMETA)
                seen += inb.to(tl.int32)
                held += (inb & keep).to(tl.int32)
        n_seen = tl.sum(tl.sum(seen, 1), 0)
        n_held = tl.sum(tl.sum(held, 1), 0)
        cls = tl.where(n_held == 0, 0, tl.where(n_held == n_seen, 2, 1))
        tl.store(out + kb, cls.to(tl.int8))


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
