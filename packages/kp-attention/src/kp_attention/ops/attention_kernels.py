"""Triton kernels of FlashAttention-2 (forward, and a deterministic backward without atomics).

Per query row i of one (batch, q head) and key j of its kv head (GQA: kv head = q head // group):
    s_ij  = scale * q_i . k_j                       (fp32 accumulate; fp64 for fp32 inputs, see _dot)
    s_ij  = softcap * tanh(s_ij / softcap)          (when softcap > 0, Gemma-2)
    s_ij += mask_ij  (float mask)  or  -inf where the boolean mask is False
    s_ij  = -inf unless  diag - left <= j - i <= diag + right  and  j < Sk   (left/right < 0: unbounded)
    lse_i = log(sum_j exp(s_ij)),   o_i = sum_j exp(s_ij - lse_i) v_j
diag = Sk - Sq (bottom-right causal alignment, FlashAttention >= 2.1) or 0 (top-left, torch's is_causal).
Rows with every key masked give o = 0 and lse = -inf, and zero gradients.

Scores are kept in base 2 (log2(e) folded into the scale) so the softmax uses exp2; fp32 inputs keep natural
units (see _exp). Accumulators are fp32; the fp32 path sums each block's dot in fp64 (_dot, Triton >= 3.5).
Backward (FlashAttention-2 / Triton tutorial split, deterministic: every output is written by one program):
    delta_i = sum_d dO_id O_id - dlse_i                       (_attn_bwd_preprocess)
    dS_ij   = P_ij (dO_i . v_j - delta_i) * tanh'             (recomputed from lse)
    dK, dV: one program per key block and kv head loops over the group's q heads and query blocks (_attn_bwd_dkdv)
    dQ:     one program per query block and q head loops over key blocks (_attn_bwd_dq)
Every loop over blocks is split into masked boundary blocks and unmasked interior blocks, and visits only the
blocks the causal/window band can reach.

Tensors are addressed by (batch, seq, head, dim) strides, so (B, S, H, D), (B, H, S, D) views and packed
varlen (total, H, D) tensors run without copies. Varlen: batch b spans rows cu[b]:cu[b+1] (batch stride 0).

The launchers, the PyTorch reference and the op declarations are in kp_attention.ops.attention.

Hopper: this is the portable path (pointer loads, tl.dot). TMA descriptors (tl.make_tensor_descriptor) for the
K/V/Q tiles and warp specialisation (tl.range(..., warp_specialize=True)) would replace the loads in
_fwd_block / the loops of _attn_fwd; the block ranges and masks stay as they are.
"""

import triton
import triton.language as tl

from kp_core.kernel_constants import LN2, LOG2E

# Triton >= 3.5 takes fp64 tl.dot operands (DMMA on sm80/sm90, FMA elsewhere); older Triton rejects them.
F64_DOT = tl.constexpr(tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 5))


@triton.jit
def _dot64(a, b):
    """a @ b of fp32 tiles in fp64: exact products, sums good to fp64 ulps."""
    return tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee")


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b in fp32. fp32 inputs (no TF32): the block's product is summed in fp64 and rounded once, since
    the GPU's IEEE fp32 dot is a chain of D fp32 FMAs that drifts by several ulps (beyond the 2x rule against
    torch's matmuls); a Triton without fp64 dots keeps that chain."""
    if IEEE:
        if F64_DOT:
            return acc + _dot64(a, b).to(tl.float32)
        else:
            return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    """a @ b left unrounded on the fp32 path (fp64, where Triton has fp64 dots), so what follows rounds once: the
    scale or softcap of the scores, the cancelling dP - delta of the backward. fp32 otherwise."""
    zero = tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32)
    if IEEE:
        if F64_DOT:
            return _dot64(a, b)
        else:
            return _dot(a, b, zero, IEEE)
    else:
        return _dot(a, b, zero, IEEE)


@triton.jit
def _exp(x, IEEE: tl.constexpr):
    """exp in the scores' units: base 2 (log2(e) folded into the scale) for fp16/bf16; natural for fp32 inputs,
    whose lse and softmax then round like PyTorch's (the base conversion costs fp32 ulps the 2x rule lacks)."""
    if IEEE:
        return tl.exp(x)
    else:
        return tl.math.exp2(x)


@triton.jit
def _units(lse, IEEE: tl.constexpr):
    """A natural-log lse in the scores' units (see _exp)."""
    if IEEE:
        return lse
    else:
        return lse * LOG2E


@triton.jit
def _load2d(ptrs, ok0, ok1, CHECK0: tl.constexpr, CHECK1: tl.constexpr):
    """Load a tile, bounds-checking only the axes that need it (interior tiles and full head dims load bare)."""
    if CHECK0:
        if CHECK1:
            return tl.load(ptrs, mask=ok0[:, None] & ok1[None, :], other=0.0)
        else:
            return tl.load(ptrs, mask=ok0[:, None], other=0.0)
    else:
        if CHECK1:
            return tl.load(ptrs, mask=ok1[None, :], other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _load1d(ptrs, ok, CHECK: tl.constexpr):
    if CHECK:
        return tl.load(ptrs, mask=ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _seq_bounds(CU, b, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of batch b's sequence: from cu_seqlens when packed, else (0, seqlen)."""
    if VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
    else:
        start = b * 0
        length = seqlen + b * 0
    return start.to(tl.int64), length


@triton.jit
def _scores(s, qk_scale, sc_in, sc_out, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Logits in the scores' units from raw q.k (fp64 from _mm on the fp32 path), and tanh(scale * q.k / softcap)
    (for the backward) when softcapped; both fp32.

    tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|): no libdevice, no overflow; sc_in = 2 log2(e) scale / c.
    1 - e cancels for small |y|, costing fp32 ~eps/|y| relative: the fp32 (IEEE) path takes it in fp64."""
    if SOFTCAP:
        if IEEE:
            e = tl.math.exp2(-tl.abs(s.to(tl.float64)) * sc_in)
        else:
            e = tl.math.exp2(-tl.abs(s) * sc_in)
        th = (1.0 - e) / (1.0 + e)
        th = tl.where(s < 0, -th, th)
        # sc_out = softcap (times log2(e) outside the IEEE path); on the IEEE path th and the product are fp64,
        # rounded once (rounding tanh first, then the product, doubled the logit's error)
        return (th * sc_out).to(tl.float32), th.to(tl.float32)
    else:
        return (s * qk_scale).to(tl.float32), s


@triton.jit
def _allowed(
    rows, cols, seqlen_q, seqlen_k, diag, window_left, window_right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr
):
    """Structural mask (rows, cols broadcast to a 2-D tile): in bounds and inside the causal/window band."""
    ok = (cols < seqlen_k) & (rows < seqlen_q)
    if HAS_RIGHT:
        ok = ok & (cols <= rows + diag + window_right)
    if HAS_LEFT:
        ok = ok & (cols >= rows + diag - window_left)
    return ok


@triton.jit
def _apply_mask(s2, M_base, rows, cols, smq, smk, seqlen_q, seqlen_k, MASK_KIND: tl.constexpr, IEEE: tl.constexpr):
    """attn_mask tile (broadcast strides allowed): 1 = boolean (False -> -inf), 2 = additive float."""
    if MASK_KIND != 0:
        inb = (rows < seqlen_q) & (cols < seqlen_k)
        m = tl.load(M_base + rows * smq + cols * smk, mask=inb, other=0)
        if MASK_KIND == 1:
            s2 = tl.where(m != 0, s2, float("-inf"))
        else:
            s2 = s2 + _units(m.to(tl.float32), IEEE)
    return s2


@triton.jit
def _kv_range(
    m0,
    seqlen_q,
    seqlen_k,
    diag,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Key blocks for query rows [m0, m0 + BLOCK_M): [lo, mid_lo) and [mid_hi, hi) need masks, the interior
    [mid_lo, mid_hi) does not (full blocks inside the band). lo, mid_lo, mid_hi are multiples of BLOCK_N."""
    zero = m0 * 0
    hi = seqlen_k + zero
    lo = zero
    mid_lo = zero
    mid_hi = (seqlen_k // BLOCK_N) * BLOCK_N + zero
    if HAS_RIGHT:
        hi = tl.minimum(hi, m0 + BLOCK_M + diag + window_right)
        mid_hi = tl.minimum(mid_hi, (tl.maximum(m0 + diag + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    if HAS_LEFT:
        lo = (tl.maximum(m0 + diag - window_left, 0) // BLOCK_N) * BLOCK_N
        first_full = tl.maximum(m0 + BLOCK_M - 1 + diag - window_left, 0)
        mid_lo = ((first_full + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _q_range(
    n0,
    seqlen_q,
    seqlen_k,
    diag,
    window_left,
    window_right,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
):
    """Query blocks that can see keys [n0, n0 + BLOCK_N), split like _kv_range (multiples of BLOCK_M)."""
    zero = n0 * 0
    hi = seqlen_q + zero
    lo = zero
    mid_lo = zero
    mid_hi = (seqlen_q // BLOCK_M) * BLOCK_M + zero
    mid_hi = tl.where(n0 + BLOCK_N > seqlen_k, zero, mid_hi)  # a partial key block is never interior
    if HAS_RIGHT:  # query i sees key j only if i >= j - diag - right
        lo = (tl.maximum(n0 - diag - window_right, 0) // BLOCK_M) * BLOCK_M
        first_full = tl.maximum(n0 + BLOCK_N - 1 - diag - window_right, 0)
        mid_lo = ((first_full + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if HAS_LEFT:  # ... and i <= j - diag + left
        hi = tl.minimum(hi, n0 + BLOCK_N - diag + window_left)
        mid_hi = tl.minimum(mid_hi, (tl.maximum(n0 - diag + window_left + 1, 0) // BLOCK_M) * BLOCK_M)
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _fwd_block(
    acc,
    l_i,
    m_i,
    q,
    K_base,
    V_base,
    M_base,
    start_n,
    offs_m,
    offs_n,
    offs_d,
    sks,
    skd,
    svs,
    svd,
    smq,
    smk,
    seqlen_q,
    seqlen_k,
    diag,
    window_left,
    window_right,
    qk_scale,
    sc_in,
    sc_out,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IEEE: tl.constexpr,
    PASS: tl.constexpr,
):
    """One key block. PASS 0: the online softmax (FlashAttention-2), rescaling acc and l by exp2(m_old - m_new).
    PASS 1: row statistics only (m, l). PASS 2: m_i and l_i hold the row's final max and sum and acc +=
    (exp(s - m) / l) @ v, the normalised probabilities PyTorch's softmax-then-matmul forms (the fp32 path's two
    passes, see _attn_fwd; exp(s - lse) would carry lse's rounding, an ulp of a large lse, into every p)."""
    cols = start_n + offs_n
    d_ok = offs_d < HEAD_DIM
    kv_ok = cols < seqlen_k
    kT = _load2d(K_base + cols[None, :] * sks + offs_d[:, None] * skd, d_ok, kv_ok, PAD_D, MASKED)
    s = _mm(q, kT, IEEE)
    s2, _ = _scores(s, qk_scale, sc_in, sc_out, SOFTCAP, IEEE)
    s2 = _apply_mask(s2, M_base, offs_m[:, None], cols[None, :], smq, smk, seqlen_q, seqlen_k, MASK_KIND, IEEE)
    if MASKED:
        ok = _allowed(
            offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT
        )
        s2 = tl.where(ok, s2, float("-inf"))
    if PASS == 2:
        p = _exp(s2 - m_i[:, None], IEEE) / l_i[:, None]
        m_new = m_i
    else:
        m_new = tl.maximum(m_i, tl.max(s2, 1))
        if MASKED or MASK_KIND != 0:  # a row may have no key yet: keep exp2 away from (-inf) - (-inf)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        p = _exp(s2 - m_use[:, None], IEEE)
        alpha = _exp(m_i - m_use, IEEE)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PASS == 0:
            acc = acc * alpha[:, None]
    if PASS != 1:
        v = _load2d(V_base + cols[:, None] * svs + offs_d[None, :] * svd, kv_ok, d_ok, MASKED, PAD_D)
        acc = _dot(p.to(v.dtype), v, acc, IEEE)
    return acc, l_i, m_new


@triton.jit
def _query_program(
    CU_Q, CU_K, seqlen_q, seqlen_k, group, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr
):
    """What a (query block, q head, batch) program works on: 64-bit batch / q head / kv head indices, the
    sequence starts and lengths (from cu_seqlens when packed), the block's first row (blocks run last-first,
    see _attn_fwd) and the mask diagonal."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, seqlen_q = _seq_bounds(CU_Q, b, seqlen_q, VARLEN)
    k_start, seqlen_k = _seq_bounds(CU_K, b, seqlen_k, VARLEN)
    if BOTTOM_RIGHT:
        diag = seqlen_k - seqlen_q
    else:
        diag = seqlen_k * 0
    b64 = b.to(tl.int64)
    return b64, h.to(tl.int64), (h // group).to(tl.int64), q_start, k_start, seqlen_q, seqlen_k, pid_m * BLOCK_M, diag


@triton.jit
def _fwd_loops(
    acc,
    l_i,
    m_i,
    q,
    K_base,
    V_base,
    M_base,
    lo,
    mid_lo,
    mid_hi,
    hi,
    offs_m,
    offs_n,
    offs_d,
    sks,
    skd,
    svs,
    svd,
    smq,
    smk,
    seqlen_q,
    seqlen_k,
    diag,
    window_left,
    window_right,
    qk_scale,
    sc_in,
    sc_out,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IEEE: tl.constexpr,
    PASS: tl.constexpr,
):
    """Every key block of one query block: interior blocks first (no mask work), then the boundary blocks on
    either side of the band."""
    for start_n in range(mid_lo, mid_hi, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc,
            l_i,
            m_i,
            q,
            K_base,
            V_base,
            M_base,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            False,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            PASS,
        )
    for start_n in range(lo, mid_lo, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc,
            l_i,
            m_i,
            q,
            K_base,
            V_base,
            M_base,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            True,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            PASS,
        )
    for start_n in range(mid_hi, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_block(
            acc,
            l_i,
            m_i,
            q,
            K_base,
            V_base,
            M_base,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            True,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            PASS,
        )
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q,
    K,
    V,
    Out,
    LSE,
    MASK,
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
    IEEE: tl.constexpr,
):
    """Grid (query blocks, q heads, batch). Query blocks run last-first: under a causal mask the longest
    rows (most key blocks) start first, which balances the tail."""
    b64, h64, kvh64, q_start, k_start, seqlen_q, seqlen_k, m0, diag = _query_program(
        CU_Q, CU_K, seqlen_q, seqlen_k, group, BLOCK_M, VARLEN, BOTTOM_RIGHT
    )
    if VARLEN:
        if m0 >= seqlen_q:
            return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    Q_base = Q + b64 * sqb + q_start * sqs + h64 * sqh
    K_base = K + b64 * skb + k_start * sks + kvh64 * skh
    V_base = V + b64 * svb + k_start * svs + kvh64 * svh
    M_base = MASK + b64 * smb + h64 * smh
    q_mask = (offs_m < seqlen_q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q_base + offs_m[:, None] * sqs + offs_d[None, :] * sqd, mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _kv_range(
        m0, seqlen_q, seqlen_k, diag, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    if IEEE:
        # fp32: a pass for the row statistics, then one accumulating exp(s - lse) @ v, so the output rounds as
        # PyTorch's softmax-then-matmul does (the one-pass deferred normalisation costs fp32 ulps the 2x rule
        # does not allow). Twice the score work, on the correctness path only.
        acc, l_i, m_i = _fwd_loops(
            acc,
            l_i,
            m_i,
            q,
            K_base,
            V_base,
            M_base,
            lo,
            mid_lo,
            mid_hi,
            hi,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            BLOCK_N,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            1,
        )
        empty = l_i == 0.0  # every key masked: o = 0, lse = -inf
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        acc, l_i, m_i = _fwd_loops(
            acc,
            tl.where(empty, 1.0, l_i),
            tl.where(empty, 0.0, m_i),
            q,
            K_base,
            V_base,
            M_base,
            lo,
            mid_lo,
            mid_hi,
            hi,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            BLOCK_N,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            2,
        )
        out = acc
    else:
        acc, l_i, m_i = _fwd_loops(
            acc,
            l_i,
            m_i,
            q,
            K_base,
            V_base,
            M_base,
            lo,
            mid_lo,
            mid_hi,
            hi,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            BLOCK_N,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            0,
        )
        empty = l_i == 0.0  # every key masked: o = 0, lse = -inf
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    O_base = Out + b64 * sob + q_start * sos + h64 * soh
    tl.store(O_base + offs_m[:, None] * sos + offs_d[None, :] * sod, out.to(Out.dtype.element_ty), mask=q_mask)
    tl.store(LSE + b64 * slb + h64 * slh + q_start + offs_m, lse, mask=offs_m < seqlen_q)


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
    q_start, seqlen_q = _seq_bounds(CU_Q, b, seqlen_q, VARLEN)
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
def _dkdv_block(
    dk,
    dv,
    k,
    v,
    Q_base,
    DO_base,
    L_base,
    D_base,
    M_base,
    start_m,
    offs_m,
    offs_n,
    offs_d,
    sqs,
    sqd,
    sds,
    sdd,
    smq,
    smk,
    seqlen_q,
    seqlen_k,
    diag,
    window_left,
    window_right,
    qk_scale,
    sc_in,
    sc_out,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IEEE: tl.constexpr,
):
    """dK, dV of one key block from one query block, in transposed form (keys along rows)."""
    rows = start_m + offs_m
    d_ok = offs_d < HEAD_DIM
    q_ok = rows < seqlen_q
    qT = _load2d(Q_base + rows[None, :] * sqs + offs_d[:, None] * sqd, d_ok, q_ok, PAD_D, MASKED)
    lse2 = _units(_load1d(L_base + rows, q_ok, MASKED), IEEE)
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)  # fully masked row: all its p are 0 below
    if IEEE:  # the fp32 path forms scores as the forward does (q @ k^T), so P = exp(s - lse) rounds as there
        sT = tl.trans(_mm(tl.trans(qT), tl.trans(k), IEEE))
    else:
        sT = _dot(k, qT, tl.zeros([k.shape[0], qT.shape[1]], dtype=tl.float32), IEEE)
    s2T, thT = _scores(sT, qk_scale, sc_in, sc_out, SOFTCAP, IEEE)
    s2T = _apply_mask(s2T, M_base, rows[None, :], offs_n[:, None], smq, smk, seqlen_q, seqlen_k, MASK_KIND, IEEE)
    if MASKED:
        ok = _allowed(
            rows[None, :], offs_n[:, None], seqlen_q, seqlen_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT
        )
        s2T = tl.where(ok, s2T, float("-inf"))
    pT = _exp(s2T - lse2[None, :], IEEE)
    do = _load2d(DO_base + rows[:, None] * sds + offs_d[None, :] * sdd, q_ok, d_ok, MASKED, PAD_D)
    dv = _dot(pT.to(do.dtype), do, dv, IEEE)
    delta = _load1d(D_base + rows, q_ok, MASKED)
    if IEEE:  # dP formed as _attn_bwd_dq forms it, so delta (its row sums there) cancels it to the same rounding
        dpT = tl.trans(_mm(do, tl.trans(v), IEEE))
    else:
        dpT = _dot(v, tl.trans(do), tl.zeros([k.shape[0], qT.shape[1]], dtype=tl.float32), IEEE)
    dsT = (pT * (dpT - delta[None, :])).to(tl.float32)  # fp64 dP and delta on the fp32 path
    if SOFTCAP:
        dsT = dsT * (1.0 - thT * thT)
    dk = _dot(dsT.to(qT.dtype), tl.trans(qT), dk, IEEE)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    MASK,
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
    IEEE: tl.constexpr,
):
    """Grid (key blocks, kv heads, batch): dK, dV of one key block summed over the group's q heads."""
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start, seqlen_q = _seq_bounds(CU_Q, b, seqlen_q, VARLEN)
    k_start, seqlen_k = _seq_bounds(CU_K, b, seqlen_k, VARLEN)
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
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _q_range(
        n0, seqlen_q, seqlen_k, diag, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    for g in range(0, group):
        h64 = (kvh * group + g).to(tl.int64)
        Q_base = Q + b64 * sqb + q_start * sqs + h64 * sqh
        DO_base = DO + b64 * sdb + q_start * sds + h64 * sdh
        L_base = LSE + b64 * slb + h64 * slh + q_start
        D_base = DELTA + b64 * slb + h64 * slh + q_start
        M_base = MASK + b64 * smb + h64 * smh
        for start_m in range(mid_lo, mid_hi, BLOCK_M):
            dk, dv = _dkdv_block(
                dk,
                dv,
                k,
                v,
                Q_base,
                DO_base,
                L_base,
                D_base,
                M_base,
                start_m,
                offs_m,
                offs_n,
                offs_d,
                sqs,
                sqd,
                sds,
                sdd,
                smq,
                smk,
                seqlen_q,
                seqlen_k,
                diag,
                window_left,
                window_right,
                qk_scale,
                sc_in,
                sc_out,
                False,
                HEAD_DIM,
                PAD_D,
                HAS_LEFT,
                HAS_RIGHT,
                SOFTCAP,
                MASK_KIND,
                IEEE,
            )
        for start_m in range(lo, mid_lo, BLOCK_M):
            dk, dv = _dkdv_block(
                dk,
                dv,
                k,
                v,
                Q_base,
                DO_base,
                L_base,
                D_base,
                M_base,
                start_m,
                offs_m,
                offs_n,
                offs_d,
                sqs,
                sqd,
                sds,
                sdd,
                smq,
                smk,
                seqlen_q,
                seqlen_k,
                diag,
                window_left,
                window_right,
                qk_scale,
                sc_in,
                sc_out,
                True,
                HEAD_DIM,
                PAD_D,
                HAS_LEFT,
                HAS_RIGHT,
                SOFTCAP,
                MASK_KIND,
                IEEE,
            )
        for start_m in range(mid_hi, hi, BLOCK_M):
            dk, dv = _dkdv_block(
                dk,
                dv,
                k,
                v,
                Q_base,
                DO_base,
                L_base,
                D_base,
                M_base,
                start_m,
                offs_m,
                offs_n,
                offs_d,
                sqs,
                sqd,
                sds,
                sdd,
                smq,
                smk,
                seqlen_q,
                seqlen_k,
                diag,
                window_left,
                window_right,
                qk_scale,
                sc_in,
                sc_out,
                True,
                HEAD_DIM,
                PAD_D,
                HAS_LEFT,
                HAS_RIGHT,
                SOFTCAP,
                MASK_KIND,
                IEEE,
            )
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
def _dq_block(
    dq,
    dsum,
    psum,
    q,
    do,
    lse2,
    delta,
    K_base,
    V_base,
    M_base,
    start_n,
    offs_m,
    offs_n,
    offs_d,
    sks,
    skd,
    svs,
    svd,
    smq,
    smk,
    seqlen_q,
    seqlen_k,
    diag,
    window_left,
    window_right,
    qk_scale,
    sc_in,
    sc_out,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IEEE: tl.constexpr,
    PASS: tl.constexpr,
):
    """dQ of one query block from one key block. PASS 1 (fp32 path): only dsum += sum_j P_ij dP_ij and
    psum += sum_j P_ij (fp64), for PyTorch's delta sum_j P_ij dP_ij, here over sum_j P_ij: P = exp(s - lse) sums
    to 1 only within ulps of the fp32 lse, and dP - delta cancels, amplifying any such residue. A row with one
    visible key gets P = 1 and dS = 0 exactly, as in PyTorch."""
    cols = start_n + offs_n
    d_ok = offs_d < HEAD_DIM
    kv_ok = cols < seqlen_k
    kT = _load2d(K_base + cols[None, :] * sks + offs_d[:, None] * skd, d_ok, kv_ok, PAD_D, MASKED)
    vT = _load2d(V_base + cols[None, :] * svs + offs_d[:, None] * svd, d_ok, kv_ok, PAD_D, MASKED)
    s = _mm(q, kT, IEEE)
    s2, th = _scores(s, qk_scale, sc_in, sc_out, SOFTCAP, IEEE)
    s2 = _apply_mask(s2, M_base, offs_m[:, None], cols[None, :], smq, smk, seqlen_q, seqlen_k, MASK_KIND, IEEE)
    if MASKED:
        ok = _allowed(
            offs_m[:, None], cols[None, :], seqlen_q, seqlen_k, diag, window_left, window_right, HAS_LEFT, HAS_RIGHT
        )
        s2 = tl.where(ok, s2, float("-inf"))
    p = _exp(s2 - lse2[:, None], IEEE)
    dp = _mm(do, vT, IEEE)
    if PASS == 1:
        dsum = dsum + tl.sum(p * dp, 1)
        psum = psum + tl.sum(p.to(tl.float64), 1)
    else:
        ds = (p * (dp - delta[:, None])).to(tl.float32)  # fp64 dP and delta on the fp32 path
        if SOFTCAP:
            ds = ds * (1.0 - th * th)
        dq = _dot(ds.to(kT.dtype), tl.trans(kT), dq, IEEE)
    return dq, dsum, psum


@triton.jit
def _dq_loops(
    dq,
    dsum,
    psum,
    q,
    do,
    lse2,
    delta,
    K_base,
    V_base,
    M_base,
    offs_m,
    offs_n,
    offs_d,
    sks,
    skd,
    svs,
    svd,
    smq,
    smk,
    seqlen_q,
    seqlen_k,
    diag,
    window_left,
    window_right,
    qk_scale,
    sc_in,
    sc_out,
    lo,
    mid_lo,
    mid_hi,
    hi,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAD_D: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    MASK_KIND: tl.constexpr,
    IEEE: tl.constexpr,
    PASS: tl.constexpr,
):
    """Every key block of one query block: interior blocks (no mask work), then the boundary blocks."""
    for start_n in range(mid_lo, mid_hi, BLOCK_N):
        dq, dsum, psum = _dq_block(
            dq,
            dsum,
            psum,
            q,
            do,
            lse2,
            delta,
            K_base,
            V_base,
            M_base,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            False,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            PASS,
        )
    for start_n in range(lo, mid_lo, BLOCK_N):
        dq, dsum, psum = _dq_block(
            dq,
            dsum,
            psum,
            q,
            do,
            lse2,
            delta,
            K_base,
            V_base,
            M_base,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            True,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            PASS,
        )
    for start_n in range(mid_hi, hi, BLOCK_N):
        dq, dsum, psum = _dq_block(
            dq,
            dsum,
            psum,
            q,
            do,
            lse2,
            delta,
            K_base,
            V_base,
            M_base,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            True,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            PASS,
        )
    return dq, dsum, psum


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
    IEEE: tl.constexpr,
):
    """Grid (query blocks, q heads, batch), longest rows first as in the forward."""
    b64, h64, kvh64, q_start, k_start, seqlen_q, seqlen_k, m0, diag = _query_program(
        CU_Q, CU_K, seqlen_q, seqlen_k, group, BLOCK_M, VARLEN, BOTTOM_RIGHT
    )
    if VARLEN:
        if m0 >= seqlen_q:
            return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
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
    lse2 = _units(tl.load(LSE + row, mask=row_ok, other=0.0), IEEE)
    lse2 = tl.where(lse2 == float("-inf"), 0.0, lse2)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    K_base = K + b64 * skb + k_start * sks + kvh64 * skh
    V_base = V + b64 * svb + k_start * svs + kvh64 * svh
    M_base = MASK + b64 * smb + h64 * smh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if IEEE:
        dsum = tl.zeros([BLOCK_M], dtype=tl.float64)
    else:
        dsum = tl.zeros([BLOCK_M], dtype=tl.float32)
    psum = dsum
    lo, mid_lo, mid_hi, hi = _kv_range(
        m0, seqlen_q, seqlen_k, diag, window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT
    )
    # fp32 path: delta = sum_j P_ij dP_ij / sum_j P_ij (minus dlse, already in DELTA, fp64 there), for this kernel
    # and _attn_bwd_dkdv
    if IEEE:
        lse2 = lse2.to(tl.float64)
        dq, dsum, psum = _dq_loops(
            dq,
            dsum,
            psum,
            q,
            do,
            lse2,
            delta,
            K_base,
            V_base,
            M_base,
            offs_m,
            offs_n,
            offs_d,
            sks,
            skd,
            svs,
            svd,
            smq,
            smk,
            seqlen_q,
            seqlen_k,
            diag,
            window_left,
            window_right,
            qk_scale,
            sc_in,
            sc_out,
            lo,
            mid_lo,
            mid_hi,
            hi,
            BLOCK_N,
            HEAD_DIM,
            PAD_D,
            HAS_LEFT,
            HAS_RIGHT,
            SOFTCAP,
            MASK_KIND,
            IEEE,
            1,
        )
        delta = delta + tl.where(psum > 0, dsum / tl.where(psum > 0, psum, 1.0), 0.0)
        tl.store(DELTA + row, delta, mask=row_ok)
        # The fp32 lse is only good to half an ulp (1e-6 at lse 20), and a row whose top key dominates takes that
        # whole error into P = exp(s - lse), beyond the 2x rule in dV. lse + log(sum_j P_ij), in fp64, makes the
        # row sum to 1 in pass 2 and in _attn_bwd_dkdv (which reads it from LSE_FIX).
        lse2 = lse2 + tl.log(tl.where(psum > 0, psum, 1.0))
        tl.store(LSE_FIX + row, lse2, mask=row_ok)
    dq, dsum, psum = _dq_loops(
        dq,
        dsum,
        psum,
        q,
        do,
        lse2,
        delta,
        K_base,
        V_base,
        M_base,
        offs_m,
        offs_n,
        offs_d,
        sks,
        skd,
        svs,
        svd,
        smq,
        smk,
        seqlen_q,
        seqlen_k,
        diag,
        window_left,
        window_right,
        qk_scale,
        sc_in,
        sc_out,
        lo,
        mid_lo,
        mid_hi,
        hi,
        BLOCK_N,
        HEAD_DIM,
        PAD_D,
        HAS_LEFT,
        HAS_RIGHT,
        SOFTCAP,
        MASK_KIND,
        IEEE,
        0,
    )
    dq = dq * scale
    tl.store(
        DQ + b64 * sdqb + q_start * sdqs + h64 * sdqh + offs_m[:, None] * sdqs + offs_d[None, :] * sdqd,
        dq.to(DQ.dtype.element_ty),
        mask=q_mask,
    )
