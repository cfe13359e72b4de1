"""Triton kernel packing a 2:4 weight, and its transpose, into cuSPARSELt's compressed layout.

cuSPARSELt's compressed (R, C) 16-bit matrix (what torch._cslt_compress returns, viewed flat): the 2 kept values
of every group of 4 along C, row-major (R, C / 2); then 4 bits of metadata per group (first kept index | second
<< 2, as CUTLASS's), 4 groups per 16-bit word, in tiles of 64 rows x 8 groups (128 words; tiles row-tile major),
inside a tile nibble p holding (row r, group g) with p's bits, low first: r3, g2, g0, g1, r0, r1, r2, r4, r5.
The layout was read off torch._cslt_compress on sm90 (a probe compressing patterns that encode each group's
position) and the package tests compare kp's packing with it bit for bit.
"""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_sparsity.ops.prune_kernels import kept_pairs, split4


@triton.jit
def _store_compressed(w, keep, OUT, META, r0, c0, R, C):
    """Pack the (BR, BC) tile at (r0, c0) of an (R, C) matrix whose 2:4 keep mask is `keep` (2 per group of 4
    along C; BR a multiple of 64, BC of 32)."""
    BR: tl.constexpr = w.shape[0]
    BC: tl.constexpr = w.shape[1]
    k0, k1, k2, k3 = split4(keep.to(tl.int8))
    values, nib = kept_pairs(w, k0 != 0, k1 != 0, k2 != 0, k3 != 0)  # nib: (BR, BC / 4)
    rr = r0 + tl.arange(0, BR)
    rv = c0 // 2 + tl.arange(0, BC // 2)
    tl.store(OUT + rr.to(tl.int64)[:, None] * (C // 2) + rv[None, :], values)
    # a word holds groups (r, g), (r + 8, g), (r, g + 4), (r + 8, g + 4) at bits 0, 4, 8, 12 (r3 = g2 = 0)
    j = tl.arange(0, 2)
    by_g = tl.sum(tl.reshape(nib, (BR, BC // 32, 2, 4)) << (8 * j)[None, None, :, None], axis=2)
    words = tl.sum(tl.reshape(by_g, (BR // 16, 2, 8, BC // 32, 4)) << (4 * j)[None, :, None, None, None], axis=1)
    a = tl.arange(0, BR // 16)[:, None, None, None]
    b = tl.arange(0, 8)[None, :, None, None]
    t = tl.arange(0, BC // 32)[None, None, :, None]
    lo = tl.arange(0, 4)[None, None, None, :]
    r = r0 + a * 16 + b
    g = c0 // 4 + t * 8 + lo
    at = ((r >> 6) * (C // 32) + (g >> 3)).to(tl.int64) * 128 + (g & 3) + (r & 7) * 4 + ((r >> 4) & 3) * 32
    tl.store(META + at, (words - ((words >> 15) & 1) * 65536).to(tl.int16))


@triton.jit
def _pack_cusparselt(W, stride_w, MASK, OUT, META, OUT_T, META_T, M, K, BLOCK: tl.constexpr, TRANSPOSE: tl.constexpr):
    """One BLOCK x BLOCK tile of W (M, K) and its 2:4 mask: W packed, and (TRANSPOSE, the mask 2:4 along M too)
    W^T packed, each in cuSPARSELt's layout (M and K multiples of BLOCK)."""
    tiles_k = K // BLOCK
    m0 = (tl.program_id(0) // tiles_k) * BLOCK
    k0 = (tl.program_id(0) % tiles_k) * BLOCK
    rm = m0 + tl.arange(0, BLOCK)
    rk = k0 + tl.arange(0, BLOCK)
    w = tl.load(W + rm.to(tl.int64)[:, None] * stride_w + rk[None, :])
    keep = tl.load(MASK + rm.to(tl.int64)[:, None] * K + rk[None, :]) != 0
    _store_compressed(w, keep, OUT, META, m0, k0, M, K)
    if TRANSPOSE:
        _store_compressed(tl.trans(w), tl.trans(keep), OUT_T, META_T, k0, m0, K, M)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
