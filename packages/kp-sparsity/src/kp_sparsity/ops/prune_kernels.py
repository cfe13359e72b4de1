"""Triton kernel of 2:4 pruning and packing (the selection rule is in kp_sparsity.ops.prune's docstring).

One program takes a BLOCK_M x BLOCK_K tile of the (M, K) weight: per group of 4 along K it ranks the 4 scores,
keeps the 2 best, and writes what the call asks for: the keep mask, the pruned dense tile, and the packed form
CUTLASS's sparse GEMM reads (the 2 kept values of each group in index order, and 4 bits of metadata per group,
16 bits per 4 groups, in CUTLASS's interleaved column-major metadata layout).
"""

import triton
import triton.language as tl

from kp_core import jit_keys


@triton.jit
def split4(t):
    """The 4 entries of each group of a (BM, BK) tile as 4 (BM, BK / 4) tensors."""
    pairs = tl.reshape(t, (t.shape[0], t.shape[1] // 4, 2, 2))
    even, odd = tl.split(pairs)  # [..., p, 0] and [..., p, 1]: entries (0, 2) and (1, 3)
    t0, t2 = tl.split(even)
    t1, t3 = tl.split(odd)
    return t0, t1, t2, t3


@triton.jit
def kept_pairs(w, keep0, keep1, keep2, keep3):
    """Each group's 2 kept entries in index order, (BM, BK / 2), and their indices as a nibble, first | second
    << 2, (BM, BK / 4) int32, for a (BM, BK) tile whose groups keep exactly 2 (keepN: the group's entry N)."""
    w0, w1, w2, w3 = split4(w)
    # the first kept index is 0, 1 or else 2; the second is 3, 2 or else 1
    first = tl.where(keep0, 0, tl.where(keep1, 1, 2))
    second = tl.where(keep3, 3, tl.where(keep2, 2, 1))
    v0 = tl.where(first == 0, w0, tl.where(first == 1, w1, w2))
    v1 = tl.where(second == 3, w3, tl.where(second == 2, w2, w1))
    return tl.reshape(tl.join(v0, v1), (w.shape[0], w.shape[1] // 2)), first | (second << 2)


@triton.jit
def _store_meta(META, meta, r0, q0, M, K):
    """Store the (BM, BC) int16 metadata tile whose top-left element is (r0, 2 * q0) of the (M, K / 16) matrix in
    CUTLASS's layout (torch.sparse._semi_structured_conversions' scatter offsets): rows reordered in groups of 32
    (row 32a + 8b + c goes to 32a + 4c + b), each 2 x 2 block transposed, then column-major by pairs of columns.
    Such a tile (BM a multiple of 32, r0 and BC even) fills BC / 2 runs of 2 * BM contiguous elements: it is
    permuted into that order in registers, so that its stores are contiguous."""
    BM: tl.constexpr = meta.shape[0]
    BC: tl.constexpr = meta.shape[1]
    tl.static_assert(BM % 32 == 0 and BC % 2 == 0, "packing takes BLOCK_M a multiple of 32, BLOCK_K of 32")
    rows = tl.reshape(tl.permute(tl.reshape(meta, (BM // 32, 4, 8, BC)), (0, 2, 1, 3)), (BM, BC))
    # in a pair of columns, row r's two elements go to 4 (r // 2) + 2 (column % 2) + r % 2
    runs = tl.reshape(tl.permute(tl.reshape(rows, (BM // 2, 2, BC // 2, 2)), (2, 0, 3, 1)), (BC // 2, 2 * BM))
    q = q0 + tl.arange(0, BC // 2)
    at = 2 * r0 + tl.arange(0, 2 * BM)
    inside = (q < K // 32)[:, None] & (at < 2 * M)[None, :]
    tl.store(META + q.to(tl.int64)[:, None] * (2 * M) + at[None, :], runs, mask=inside)


@triton.jit
def _load_scores(W, stride_w, SCALE, M, K, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's BLOCK_M x BLOCK_K tile of the (M, K) weight (row-tile major): its rows, columns, in-bounds
    mask, values and float32 scores |w| (times the column scale: Wanda, the input column's activation norm)."""
    tiles_k = tl.cdiv(K, BLOCK_K)
    rm = (tl.program_id(0) // tiles_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = (tl.program_id(0) % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (rm < M)[:, None] & (rk < K)[None, :]
    w = tl.load(W + rm.to(tl.int64)[:, None] * stride_w + rk[None, :], mask=inside, other=0.0)
    score = tl.abs(w.to(tl.float32))
    if HAS_SCALE:
        score = score * tl.load(SCALE + rk, mask=rk < K, other=0.0)[None, :]
    return rm, rk, inside, w, score


@triton.jit
def _prune_2_4(
    W,
    stride_w,
    SCALE,
    MASK,
    OUT,
    VALUES,
    META,
    M,
    K,
    HAS_SCALE: tl.constexpr,
    WRITE_MASK: tl.constexpr,
    WRITE_DENSE: tl.constexpr,
    WRITE_PACKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm, rk, inside, w, score = _load_scores(W, stride_w, SCALE, M, K, HAS_SCALE, BLOCK_M, BLOCK_K)
    score = tl.where(score != score, float("inf"), score)  # NaN ranks as the largest: it is kept, not hidden
    s0, s1, s2, s3 = split4(score)
    # rank = how many of the group beat this entry: a larger score, or an equal one at a lower index
    keep0 = ((s1 > s0).to(tl.int32) + (s2 > s0).to(tl.int32) + (s3 > s0).to(tl.int32)) < 2
    keep1 = ((s0 >= s1).to(tl.int32) + (s2 > s1).to(tl.int32) + (s3 > s1).to(tl.int32)) < 2
    keep2 = ((s0 >= s2).to(tl.int32) + (s1 >= s2).to(tl.int32) + (s3 > s2).to(tl.int32)) < 2
    keep3 = ((s0 >= s3).to(tl.int32) + (s1 >= s3).to(tl.int32) + (s2 >= s3).to(tl.int32)) < 2
    k0, k1, k2, k3 = keep0.to(tl.int8), keep1.to(tl.int8), keep2.to(tl.int8), keep3.to(tl.int8)
    keep = tl.reshape(tl.join(tl.join(k0, k2), tl.join(k1, k3)), (BLOCK_M, BLOCK_K)) != 0
    offs = rm.to(tl.int64)[:, None] * K + rk[None, :]
    if WRITE_MASK:
        tl.store(MASK + offs, keep.to(tl.int8), mask=inside)
    if WRITE_DENSE:
        tl.store(OUT + offs, tl.where(keep, w, tl.zeros_like(w)), mask=inside)
    if WRITE_PACKED:
        values, nibble = kept_pairs(w, keep0, keep1, keep2, keep3)
        tile_m, tile_k = tl.program_id(0) // tl.cdiv(K, BLOCK_K), tl.program_id(0) % tl.cdiv(K, BLOCK_K)
        rv = tile_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        tl.store(
            VALUES + rm.to(tl.int64)[:, None] * (K // 2) + rv[None, :],
            values,
            mask=(rm < M)[:, None] & (rv < K // 2)[None, :],
        )
        quads = tl.reshape(nibble, (BLOCK_M, BLOCK_K // 16, 4))
        shifts = 4 * tl.arange(0, 4)
        meta = tl.sum(quads << shifts[None, None, :], axis=2)  # disjoint bit fields: the sum is their OR
        meta = (meta - ((meta >> 15) & 1) * 65536).to(tl.int16)  # the low 16 bits as a signed int16
        _store_meta(META, meta, tile_m * BLOCK_M, tile_k * (BLOCK_K // 32), M, K)


@triton.jit
def _mask_2_4_transposable(
    W,
    stride_w,
    SCALE,
    TABLE,
    MASK,
    M,
    K,
    N_PATTERNS,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The transposable 2:4 mask of a BLOCK_M x BLOCK_K tile: per 4 x 4 block, of the N_PATTERNS 0/1 patterns
    with 2 ones in every row and column (TABLE: 128 x 16, rows past N_PATTERNS unused), the one whose entries'
    scores sum highest (the first on a tie), scored for all blocks at once as one float32 matmul."""
    rm, rk, inside, w, score = _load_scores(W, stride_w, SCALE, M, K, HAS_SCALE, BLOCK_M, BLOCK_K)
    # NaN and inf score as the largest finite float: a product with a pattern's 0 must stay 0, not NaN
    score = tl.where((score != score) | (score > 3.0e38), 3.0e38, score)
    blocks = tl.permute(tl.reshape(score, (BLOCK_M // 4, 4, BLOCK_K // 4, 4)), (0, 2, 1, 3))
    blocks = tl.reshape(blocks, (BLOCK_M // 4 * (BLOCK_K // 4), 16))
    p = tl.arange(0, 128)
    patterns = tl.load(TABLE + p[None, :] * 16 + tl.arange(0, 16)[:, None])  # (16, 128)
    sums = tl.dot(blocks, patterns, input_precision=PRECISION)
    sums = tl.where((p < N_PATTERNS)[None, :], sums, -float("inf"))
    best = tl.argmax(sums, axis=1, tie_break_left=True)
    bits = tl.load(TABLE + best[:, None] * 16 + tl.arange(0, 16)[None, :])  # (blocks, 16)
    keep = tl.permute(tl.reshape(bits, (BLOCK_M // 4, BLOCK_K // 4, 4, 4)), (0, 2, 1, 3))
    keep = tl.reshape(keep, (BLOCK_M, BLOCK_K))
    tl.store(MASK + rm.to(tl.int64)[:, None] * K + rk[None, :], (keep != 0).to(tl.int8), mask=inside)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
