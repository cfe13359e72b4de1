"""Triton helpers shared by the attention kernels (attention_fwd_kernels, attention_bwd_kernels) and the decode
kernels: dots and exponentials in the scores' units, bounds-checked tile loads, the score transform (scale,
softcap), the masks, and the block ranges each loop visits.

Per query row i of one (batch, q head) and key j of its kv head (GQA: kv head = q head // group):
    s_ij  = scale * q_i . k_j                       (fp32 accumulate; fp64 for fp32 inputs, see dot)
    s_ij  = softcap * tanh(s_ij / softcap)          (when softcap > 0, Gemma-2)
    s_ij += mask_ij  (float mask)  or  -inf where the boolean mask is False  or  -slope_bh * |j - i - diag| (ALiBi)
    s_ij  = -inf unless  diag - left <= j - i <= diag + right  and  j < Sk   (left/right < 0: unbounded)
    lse_i = log(sum_j exp(s_ij)),   o_i = sum_j exp(s_ij - lse_i) v_j
diag = Sk - Sq (bottom-right causal alignment, FlashAttention >= 2.1) or 0 (top-left, torch's is_causal).
Rows with every key masked give o = 0 and lse = -inf, and zero gradients.
Dropout (kp_attention.ops.dropout): o_i = sum_j exp(s_ij - lse_i) keep_ij / (1 - p) v_j; the backward uses
dP_ij = keep_ij / (1 - p) dO_i . v_j in dS = P (dP - delta), delta_i = dO_i . o_i still.

Scores are kept in base 2 (log2(e) folded into the scale) so the softmax uses exp2; fp32 inputs keep natural
units (see score_exp). Accumulators are fp32; the fp32 path sums each block's dot in fp64 (dot, Triton >= 3.5).

Every loop over blocks visits three regions (`region`): the interior blocks, which need no mask work, then the
masked boundary blocks on either side of the causal/window band; blocks outside the band are never visited.
The kernels write that loop once, as a `tl.static_range(3)` over the region, so each region compiles to a loop
of its own with the mask code present only where it is needed.

Tensors are addressed by (batch, seq, head, dim) strides, so (B, S, H, D), (B, H, S, D) views and packed
varlen (total, H, D) tensors run without copies. Varlen: batch b spans rows cu[b]:cu[b+1] (batch stride 0).
"""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_core.kernel_constants import LOG2E

# Triton >= 3.5 takes fp64 tl.dot operands (DMMA on sm80/sm90, FMA elsewhere); older Triton rejects them.
F64_DOT = tl.constexpr(tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 5))


@triton.jit
def dot64(a, b):
    """a @ b of fp32 tiles in fp64: exact products, sums good to fp64 ulps."""
    return tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee")


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b in fp32. fp32 inputs (no TF32): the block's product is summed in fp64 and rounded once, since
    the GPU's IEEE fp32 dot is a chain of D fp32 FMAs that drifts by several ulps (beyond the 2x rule against
    torch's matmuls); a Triton without fp64 dots keeps that chain."""
    if IEEE:
        if F64_DOT:
            return acc + dot64(a, b).to(tl.float32)
        else:
            return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def mm(a, b, IEEE: tl.constexpr):
    """a @ b left unrounded on the fp32 path (fp64, where Triton has fp64 dots), so what follows rounds once: the
    scale or softcap of the scores, the cancelling dP - delta of the backward. fp32 otherwise."""
    zero = tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32)
    if IEEE:
        if F64_DOT:
            return dot64(a, b)
        else:
            return dot(a, b, zero, IEEE)
    else:
        return dot(a, b, zero, IEEE)


@triton.jit
def score_exp(x, IEEE: tl.constexpr):
    """exp in the scores' units: base 2 (log2(e) folded into the scale) for fp16/bf16; natural for fp32 inputs,
    whose lse and softmax then round like PyTorch's (the base conversion costs fp32 ulps the 2x rule lacks)."""
    if IEEE:
        return tl.exp(x)
    else:
        return tl.math.exp2(x)


@triton.jit
def score_units(lse, IEEE: tl.constexpr):
    """A natural-log lse in the scores' units (see score_exp)."""
    if IEEE:
        return lse
    else:
        return lse * LOG2E


@triton.jit
def load2d(ptrs, ok0, ok1, CHECK0: tl.constexpr, CHECK1: tl.constexpr):
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
def load1d(ptrs, ok, CHECK: tl.constexpr):
    if CHECK:
        return tl.load(ptrs, mask=ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def seq_bounds(CU, b, seqlen, VARLEN: tl.constexpr):
    """(first row, length) of batch b's sequence: from cu_seqlens when packed, else (0, seqlen)."""
    if VARLEN:
        start = tl.load(CU + b)
        length = tl.load(CU + b + 1) - start
    else:
        start = b * 0
        length = seqlen + b * 0
    return start.to(tl.int64), length


@triton.jit
def scores(s, qk_scale, sc_in, sc_out, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Logits in the scores' units from raw q.k (fp64 from mm on the fp32 path), and tanh(scale * q.k / softcap)
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
def allowed(
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
def apply_mask(s2, M_base, rows, cols, smq, smk, seqlen_q, seqlen_k, diag, MASK_KIND: tl.constexpr, IEEE: tl.constexpr):
    """attn_mask tile (broadcast strides allowed): 1 = boolean (False -> -inf), 2 = additive float; 3 = ALiBi,
    M_base at the (batch, head)'s fp32 slope: s_ij -= slope * |j - i - diag| (FlashAttention's bias)."""
    if MASK_KIND == 3:
        slope = tl.load(M_base)
        s2 = s2 - score_units(slope * tl.abs(cols - rows - diag).to(tl.float32), IEEE)
    elif MASK_KIND != 0:
        inb = (rows < seqlen_q) & (cols < seqlen_k)
        m = tl.load(M_base + rows * smq + cols * smk, mask=inb, other=0)
        if MASK_KIND == 1:
            s2 = tl.where(m != 0, s2, float("-inf"))
        else:
            s2 = s2 + score_units(m.to(tl.float32), IEEE)
    return s2


@triton.jit
def dropout_keep(seed, bh, rows, cols, threshold):
    """Which (query row, key) pairs of tile (rows, cols broadcast to 2-D) dropout keeps, for (batch, q head) bh =
    b * Hq + h: Philox-4x32-10 under `seed`, counter (key, row, bh, 0), the first word's top 24 bits >= threshold
    (kp_attention.ops.dropout, where keep_mask draws the same in PyTorch)."""
    zero = (rows + cols) * 0
    c0 = (cols + zero).to(tl.uint32)
    c1 = (rows + zero).to(tl.uint32)
    c2 = (zero + bh).to(tl.uint32)
    word, _, _, _ = tl.philox(seed, c0, c1, c2, zero.to(tl.uint32))
    return (word >> 8).to(tl.int32) >= threshold


@triton.jit
def kv_range(
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
def q_range(
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
    """Query blocks that can see keys [n0, n0 + BLOCK_N), split like kv_range (multiples of BLOCK_M)."""
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
def query_program(
    CU_Q, CU_K, seqlen_q, seqlen_k, group, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr
):
    """What a (query block, q head, batch) program works on: 64-bit batch / q head / kv head indices, the
    sequence starts and lengths (from cu_seqlens when packed), the block's first row (blocks run last-first,
    see _attn_fwd) and the mask diagonal."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, seqlen_q = seq_bounds(CU_Q, b, seqlen_q, VARLEN)
    k_start, seqlen_k = seq_bounds(CU_K, b, seqlen_k, VARLEN)
    if BOTTOM_RIGHT:
        diag = seqlen_k - seqlen_q
    else:
        diag = seqlen_k * 0
    b64 = b.to(tl.int64)
    return b64, h.to(tl.int64), (h // group).to(tl.int64), q_start, k_start, seqlen_q, seqlen_k, pid_m * BLOCK_M, diag


@triton.jit
def region(REGION: tl.constexpr, lo, mid_lo, mid_hi, hi):
    """[start, end) of loop region REGION of a block range from kv_range / q_range: 0 the interior [mid_lo, mid_hi)
    (no mask work, visited first), 1 and 2 the masked boundary blocks [lo, mid_lo) and [mid_hi, hi)."""
    if REGION == 0:
        start = mid_lo
        end = mid_hi
    elif REGION == 1:
        start = lo
        end = mid_lo
    else:
        start = mid_hi
        end = hi
    return start, end


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
