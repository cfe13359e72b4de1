"""KV-cache attention for decoding (FlashAttention's `flash_attn_with_kvcache`), forward only.

For batch b with L = cache_seqlens[b] + Sq_new valid keys (the new k/v, if any, are first written into the cache
at positions cache_seqlens[b] ...), query i of Sq sits on the diagonal p_i = i + L - Sq (bottom-right) and sees
key j < L when
    causal:       j <= p_i                    window left  >= 0: j >= p_i - left
    window right >= 0 (non-causal): j <= p_i + right
    s = scale * q . k;  s = c * tanh(s / c) when softcap c > 0;  out = softmax(s) V;  lse = logsumexp(s)
Rows that see no key give out = 0 and lse = -inf.

Flash-decoding: program (b, kv head, row block, split) loads the queries of all the q heads of its GQA group as
one (group * Sq, D) tile, so K/V are read once per group, and walks its share of the visible key range (each
sequence's own range [lo, L) is cut into `num_splits` equal runs of BLOCK_N blocks, so nothing past L or left of
the window is read). With one split it writes the output directly; otherwise it writes a partial (out, lse) in
fp32 and a second kernel merges the splits: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
Paged caches (num_blocks, block_size, Hkv, D) are read through block_table; BLOCK_N divides block_size, so a
block of keys lies in one page and costs one block_table load.
"""

import functools
import math
from typing import Optional, Union

import torch

import kp_core

OP = "kp::flash_attention_with_kvcache"
PACKAGE = "kp-attention"
SPEC = "attention"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
PAGE_MULTIPLE = 16  # paged block_size must be a multiple of this (the smallest BLOCK_N tl.dot takes)
MAX_SPLITS = 256
# Checking cache_seqlens / block_table values costs one device sync a call (skipped during CUDA-graph capture).
# A serving loop that guarantees them may set this to False.
VALIDATE_VALUES = True

if kp_core.has_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_split(
        Q, stride_qb, stride_qs, stride_qh,
        K, stride_kb, stride_kn, stride_kh,
        V, stride_vb, stride_vn, stride_vh,
        SEQLENS, BT, stride_btb,
        OUT, stride_ob, stride_os, stride_oh, LSE, O_PART, LSE_PART,
        Hkv, GROUP, Sq, num_splits, m_blocks, sm_scale, softcap, win_left, win_right,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
        PAGED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
        IEEE: tl.constexpr, ONE_SPLIT: tl.constexpr,
    ):  # fmt: skip
        """One (batch, kv head, row block) x one split: online softmax over the split's key blocks.
        D (the head dim) is a constexpr so that D == BLOCK_D drops the head-dim masks.

        Tile rows r are (q head h * GROUP + r // Sq, query r % Sq). Scores live in the log2 domain
        (s * log2(e)) so the softmax uses exp2; lse is stored in the log2 domain for the partials, natural
        log for the final output."""
        LOG2E: tl.constexpr = 1.4426950408889634
        LN2: tl.constexpr = 0.6931471805599453
        pid = tl.program_id(0)
        split = tl.program_id(1)
        mb = pid % m_blocks
        h = (pid // m_blocks) % Hkv
        b = pid // (m_blocks * Hkv)
        b64 = b.to(tl.int64)
        L = tl.load(SEQLENS + b)

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

        # Keys any row of the tile may see: [lo, L), lo rounded down to a block; this split's share of it.
        lo = L * 0
        if HAS_LEFT:
            lo = tl.maximum(L - Sq - win_left, 0)
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
                slot = (n0 % PAGE + offs_n0).to(tl.int64)
                k_rows = page * stride_kb + slot * stride_kn
                v_rows = page * stride_vb + slot * stride_vn
            else:
                k_rows = b64 * stride_kb + offs_n.to(tl.int64) * stride_kn
                v_rows = b64 * stride_vb + offs_n.to(tl.int64) * stride_vn
            n_ok = offs_n < end
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_head + k_rows[:, None], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * sm_scale
            if SOFTCAP:
                # c * tanh(s / c), tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits +-1 when exp over/underflows
                s = softcap - (2.0 * softcap) / (tl.exp2(s * (2.0 * LOG2E / softcap)) + 1.0)
            s = s * LOG2E
            ok = n_ok[None, :]
            if HAS_RIGHT:
                ok = ok & (offs_n[None, :] <= diag[:, None] + win_right)
            if HAS_LEFT:
                ok = ok & (offs_n[None, :] >= diag[:, None] - win_left)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_head + v_rows[:, None], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        hq64 = hq.to(tl.int64)
        row_id = (b64 * Hkv * GROUP + hq64) * Sq + qi  # row of the (B, Hq, Sq) lse
        if ONE_SPLIT:
            o_ptrs = OUT + b64 * stride_ob + qi[:, None] * stride_os + hq64[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=q_mask)
            tl.store(LSE + row_id, lse2 * LN2, mask=row_ok)
        else:
            part = row_id * num_splits + split
            tl.store(O_PART + part[:, None] * D + offs_d[None, :], out, mask=q_mask)
            tl.store(LSE_PART + part, lse2, mask=row_ok)

    @triton.jit
    def _decode_combine(
        O_PART, LSE_PART, OUT, stride_ob, stride_os, stride_oh, LSE, Hq, Sq, num_splits,
        D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One output row (b, q head, query): lse = log2 sum_s 2^lse_s, out = sum_s 2^(lse_s - lse) out_s."""
        LN2: tl.constexpr = 0.6931471805599453
        row = tl.program_id(0).to(tl.int64)  # (b * Hq + hq) * Sq + i
        qi = row % Sq
        hq = (row // Sq) % Hq
        b = row // (Sq * Hq)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
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
            w = tl.exp2(tl.load(lse_row + s0 + offs_s, mask=s_ok, other=float("-inf")) - m_safe)
            parts = (row * num_splits + s0 + offs_s)[:, None] * D + offs_d[None, :]
            o = tl.load(O_PART + parts, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
            acc += tl.sum(w[:, None] * o, 0)
            denom += tl.sum(w, 0)
        out = acc / tl.where(denom > 0.0, denom, 1.0)
        tl.store(
            OUT + b * stride_ob + qi * stride_os + hq * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok
        )
        lse_out = tl.where(denom > 0.0, (m_safe + tl.log2(tl.where(denom > 0.0, denom, 1.0))) * LN2, float("-inf"))
        tl.store(LSE + row, lse_out)


# (BLOCK_N, num_warps, num_stages) for the split kernel, keyed "d<BLOCK_D>" (e.g. "d128"); a GPU sweep may pin
# them (benchmarks); empty normally. Paged caches still cap BLOCK_N at the largest power of 2 dividing block_size.
CONFIG_OVERRIDE: dict[str, tuple[int, int, int]] = {}
WAVES = 3  # auto num_splits aims at this many programs per SM (B * Hkv * splits ~ WAVES * SMs)
MAX_BLOCK_M = 64  # query rows (group * Sq) per program; more rows take several programs


def _split_config(block_d: int, element_size: int) -> tuple[int, int, int]:
    key = f"d{block_d}"
    if key in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE[key]
    # ~16 KiB of K per block: enough bytes in flight per stage to stream, no spills for the (M, D) accumulator.
    block_n = max(16, min(128, 8192 // (block_d * element_size) * 2))
    return block_n, 4, 3 if block_d <= 128 else 2


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def auto_num_splits(device: torch.device, programs: int, max_blocks: int) -> int:
    """Splits so that programs * splits fills ~WAVES programs per SM (a small count off-GPU, where the
    interpreter runs programs one after another), never more than the key blocks a sequence can have."""
    if device.type == "cuda":
        slots = WAVES * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        slots = 4
    if programs >= slots:
        return 1
    return max(1, min(triton.cdiv(slots, programs), max_blocks, MAX_SPLITS))


# ---- input checks (shapes, dtypes, devices: no device sync, so they run under torch.compile too) ----


def _check_inputs(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window, softcap, num_splits):
    """The capacity (keys a sequence can hold) and the number of new tokens."""
    kp_core.check_tensor(OP, "q", q, dtypes=DTYPES, ndim=4)
    kp_core.check_tensor(OP, "k_cache", k_cache, dtypes=DTYPES, ndim=4)
    kp_core.check_tensor(OP, "v_cache", v_cache, dtypes=DTYPES, ndim=4)
    kp_core.check_same_dtype(OP, "k_cache", k_cache, q, "q")
    kp_core.check_same_dtype(OP, "v_cache", v_cache, q, "q")
    if (k is None) != (v is None):
        raise ValueError(f"{OP}: k and v (the new tokens) must be given together, got only {'k' if v is None else 'v'}")
    if k is not None:
        kp_core.check_tensor(OP, "k", k, dtypes=DTYPES, ndim=4)
        kp_core.check_tensor(OP, "v", v, dtypes=DTYPES, ndim=4)
        kp_core.check_same_dtype(OP, "k", k, q, "q")
        kp_core.check_same_dtype(OP, "v", v, q, "q")
    if block_table is not None:
        kp_core.check_tensor(OP, "block_table", block_table, dtypes=(torch.int32,), ndim=2)
    if isinstance(cache_seqlens, torch.Tensor):
        kp_core.check_tensor(OP, "cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        raise TypeError(f"{OP}: cache_seqlens must be an int32 tensor or an int, got {type(cache_seqlens).__name__}")
    kp_core.check_same_device(
        OP, q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, block_table=block_table,
        cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
    )  # fmt: skip

    batch, _, hq, d = q.shape
    _, page, hkv, d_k = k_cache.shape
    if d_k != d:
        raise ValueError(
            f"{OP}: k_cache head dim must equal q's ({d}), got {d_k} (k_cache shape {tuple(k_cache.shape)})"
        )
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{OP}: head dim must be at most {MAX_HEAD_DIM}, got {d}")
    kp_core.check_shape(OP, "v_cache", v_cache, k_cache.shape)
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{OP}: q heads ({hq}) must be a multiple of k_cache heads ({hkv})")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"{OP}: k_cache batch ({k_cache.shape[0]}) must equal q's batch ({batch})")
        capacity = page
    else:
        if block_table.shape[0] != batch:
            raise ValueError(f"{OP}: block_table batch ({block_table.shape[0]}) must equal q's batch ({batch})")
        if page % PAGE_MULTIPLE != 0:
            raise ValueError(
                f"{OP}: paged k_cache block_size (dim 1) must be a multiple of {PAGE_MULTIPLE}, got {page}"
            )
        capacity = block_table.shape[1] * page
    if isinstance(cache_seqlens, torch.Tensor):
        kp_core.check_shape(OP, "cache_seqlens", cache_seqlens, (batch,))
    new = 0
    if k is not None:
        new = k.shape[1]
        kp_core.check_shape(OP, "k", k, (batch, new, hkv, d))
        kp_core.check_shape(OP, "v", v, (batch, new, hkv, d))
    if not isinstance(cache_seqlens, torch.Tensor) and not 0 <= cache_seqlens <= capacity - new:
        raise ValueError(
            f"{OP}: cache_seqlens ({cache_seqlens}) plus new tokens ({new}) must lie in [0, {capacity}] (the cache)"
        )
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(isinstance(w, int) for w in window)):
        raise TypeError(f"{OP}: window must be a pair of ints (left, right), got {window!r}")
    if min(window) < -1:
        raise ValueError(f"{OP}: window sizes must be >= -1 (-1: unbounded), got {tuple(window)}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"{OP}: softcap must be a float >= 0 (0: off), got {softcap!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"{OP}: num_splits must be an int >= 0 (0: auto), got {num_splits!r}")
    return capacity, new


def _check_values(cache_seqlens, new, capacity, block_table, page, num_blocks):
    """cache_seqlens + new within [0, capacity] and, paged, the block ids in use within the cache: one sync."""
    if not VALIDATE_VALUES or cache_seqlens.numel() == 0:
        return
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lens = cache_seqlens.long()
    stats = [lens.min(), lens.max()]
    if block_table is not None:
        used = torch.arange(block_table.shape[1], device=lens.device)[None, :] * page < (lens + new)[:, None]
        stats.append((used & ((block_table < 0) | (block_table >= num_blocks))).sum())
    stats = torch.stack(stats).tolist()
    if stats[0] < 0:
        raise ValueError(f"{OP}: cache_seqlens must be >= 0, got a minimum of {stats[0]}")
    if stats[1] + new > capacity:
        raise ValueError(
            f"{OP}: cache_seqlens ({stats[1]} at most) plus new tokens ({new}) exceed the cache's {capacity} slots"
        )
    if block_table is not None and stats[2]:
        raise ValueError(f"{OP}: block_table has {stats[2]} block ids in use outside [0, {num_blocks})")


# ---- the cache update and the reference path ----


def _append(k_cache, v_cache, cache_seqlens, k, v, block_table):
    """Write k, v (B, Sn, Hkv, D) into the caches at positions cache_seqlens[b] + (0 .. Sn - 1), in place.

    A torch scatter (one index_put_ per cache): no sync, CUDA-graph safe; ~B * Sn * Hkv * D elements, small
    next to the attention read."""
    batch, new = k.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(new, device=k.device)[None, :]
    if block_table is None:
        index = (torch.arange(batch, device=k.device)[:, None].expand(batch, new), pos)
    else:
        page = k_cache.shape[1]
        index = (block_table.long().gather(1, pos // page), pos % page)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def _reference(q, k_cache, v_cache, seqlens, block_table, causal, window_left, window_right, softcap, scale):
    """The formula in fp32 (fp64 is not accepted), one sequence at a time; fully masked rows give 0 / -inf."""
    batch, sq, hq, d = q.shape
    group = hq // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((batch, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
    right = 0 if causal else window_right
    for b, n in enumerate(seqlens.tolist()):
        idx = torch.arange(n, device=q.device)
        if block_table is None:
            kb, vb = k_cache[b, :n], v_cache[b, :n]
        else:
            page = k_cache.shape[1]
            blocks = block_table[b].long()[idx // page]
            kb, vb = k_cache[blocks, idx % page], v_cache[blocks, idx % page]
        kb = kb.float().repeat_interleave(group, dim=1)  # (n, Hq, D)
        vb = vb.float().repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b].float(), kb) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        diag = torch.arange(sq, device=q.device)[:, None] + n - sq
        ok = torch.ones(sq, n, dtype=torch.bool, device=q.device)
        if right >= 0:
            ok &= idx[None, :] <= diag + right
        if window_left >= 0:
            ok &= idx[None, :] >= diag - window_left
        s = s.masked_fill(~ok, float("-inf"))
        lse_b = torch.logsumexp(s, -1)  # (Hq, Sq)
        p = torch.exp(s - torch.where(lse_b.isinf(), 0.0, lse_b)[..., None])
        out[b] = torch.einsum("hqk,khd->qhd", p, vb).to(q.dtype)
        lse[b] = lse_b
    return out, lse


# ---- launcher ----


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def forward_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, window_left, window_right, softcap,
                 scale, num_splits):  # fmt: skip
    """(out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) fp32); writes k, v into the caches first."""
    batch, sq, hq, d = q.shape
    num_blocks, page, hkv, _ = k_cache.shape
    paged = block_table is not None
    capacity = block_table.shape[1] * page if paged else page
    new = 0 if k is None else k.shape[1]
    _check_values(cache_seqlens, new, capacity, block_table, page, num_blocks)
    if new:
        _append(k_cache, v_cache, cache_seqlens, k, v, block_table)
        seqlens = cache_seqlens + new
    else:
        seqlens = cache_seqlens
    backend = kp_core.choose_backend(OP, q)
    if backend == kp_core.REFERENCE or q.numel() == 0:
        kp_core.note_launch(OP, "reference", kp_core.REFERENCE)
        return _reference(q, k_cache, v_cache, seqlens, block_table, causal, window_left, window_right, softcap, scale)

    q = _unit_last(q)
    k_read, v_read = _unit_last(k_cache), _unit_last(v_cache)  # copies only for a cache with strided head dims
    seqlens = seqlens.contiguous()
    group = hq // hkv
    block_d = max(16, kp_core.next_power_of_2(d))
    block_n, num_warps, num_stages = _split_config(block_d, q.element_size())
    if paged:
        block_n = min(block_n, page & -page)  # the largest power of 2 dividing block_size (>= 16)
    rows = group * sq
    block_m = max(16, min(MAX_BLOCK_M, kp_core.next_power_of_2(rows)))
    m_blocks = triton.cdiv(rows, block_m)
    programs = batch * hkv * m_blocks
    max_blocks = triton.cdiv(capacity, block_n)
    splits = num_splits if num_splits > 0 else auto_num_splits(q.device, programs, max_blocks)
    splits = max(1, min(splits, max_blocks, 65535))
    out = torch.empty((batch, sq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, hq, sq), dtype=torch.float32, device=q.device)
    if splits > 1:
        o_part = torch.empty((batch * hq * sq, splits, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((batch * hq * sq, splits), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = lse  # never touched
    bt = _unit_last(block_table) if paged else seqlens
    right = 0 if causal else window_right
    _decode_split[(programs, splits)](
        q, q.stride(0), q.stride(1), q.stride(2),
        k_read, k_read.stride(0), k_read.stride(1), k_read.stride(2),
        v_read, v_read.stride(0), v_read.stride(1), v_read.stride(2),
        seqlens, bt, bt.stride(0) if paged else 0,
        out, out.stride(0), out.stride(1), out.stride(2), lse, o_part, lse_part,
        hkv, group, sq, splits, m_blocks, float(scale), float(softcap), window_left, right,
        D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, PAGE=page if paged else 1, PAGED=paged,
        HAS_LEFT=window_left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=softcap > 0, IEEE=q.dtype == torch.float32,
        ONE_SPLIT=splits == 1, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    kp_core.note_launch(OP, _decode_split.fn.__name__, backend)
    if splits > 1:
        block_d_c = kp_core.next_power_of_2(d)
        block_s = max(2, min(kp_core.next_power_of_2(splits), max(2, 4096 // block_d_c)))
        _decode_combine[(batch * hq * sq,)](
            o_part, lse_part, out, out.stride(0), out.stride(1), out.stride(2), lse, hq, sq, splits,
            D=d, BLOCK_S=block_s, BLOCK_D=block_d_c, num_warps=4 if block_s * block_d_c >= 2048 else 2,
        )  # fmt: skip
        kp_core.note_launch(OP, _decode_combine.fn.__name__, backend)
    return out, lse


# ---- torch.library op (what torch.compile sees) ----


def _fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, window_left, window_right, softcap, scale,
          num_splits):  # fmt: skip
    batch, sq, hq, d = q.shape
    return q.new_empty((batch, sq, hq, d)), q.new_empty((batch, hq, sq), dtype=torch.float32)


@kp_core.custom_op(OP, package=PACKAGE, spec=SPEC, dtypes=DTYPES, fake=_fake, mutates_args=("k_cache", "v_cache"))
def kvcache_op(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    k: Optional[torch.Tensor], v: Optional[torch.Tensor], block_table: Optional[torch.Tensor], causal: bool,
    window_left: int, window_right: int, softcap: float, scale: float, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse). Mutates k_cache / v_cache when k / v are given (the new tokens are written into them)."""
    return forward_impl(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, window_left, window_right,
                        softcap, scale, num_splits)  # fmt: skip


def opcheck_args(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None, causal=True,
                 window=(-1, -1), softcap=0.0, scale=None, num_splits=0) -> tuple:  # fmt: skip
    """kvcache_op's positional arguments for these inputs (for torch.library.opcheck)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return (q, k_cache, v_cache, cache_seqlens, k, v, block_table, bool(causal), int(window[0]), int(window[1]),
            float(softcap), scale, int(num_splits))  # fmt: skip


# ---- public API ----


def flash_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: Union[torch.Tensor, int],
    *,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    scale: Optional[float] = None,
    num_splits: int = 0,
    return_lse: bool = False,
):
    """Attention of a few new queries over a KV cache (FlashAttention's `flash_attn_with_kvcache`), inference only.

    q: (B, Sq, Hq, D), Sq small (1 for decoding). k_cache / v_cache: (B, S_max, Hkv, D), or paged
    (num_blocks, block_size, Hkv, D) with block_table (B, max_blocks_per_seq) int32 (block_size a multiple of 16).
    cache_seqlens: int32 (B,) or an int, the valid cached tokens per sequence. Hq % Hkv == 0, D <= 256.
    k, v: optional new tokens (B, Sq_new, Hkv, D), written IN PLACE into k_cache / v_cache at positions
    cache_seqlens[b] ... before attending (cache_seqlens itself is not changed); the sequence then has
    cache_seqlens + Sq_new keys. causal aligns the diagonal bottom-right and forces window right = 0;
    window (left, right) bounds the keys about the diagonal (-1: unbounded); softcap c > 0 applies
    c * tanh(s / c) to the scaled scores; scale defaults to 1 / sqrt(D). num_splits: key-length splits
    (flash-decoding), 0 = chosen from the GPU's SM count. Returns out (B, Sq, Hq, D) in q's dtype, and
    with return_lse the fp32 log-sum-exp (B, Hq, Sq). Rows that see no key give 0 (lse -inf).
    """
    _check_inputs(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window, softcap, num_splits)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = (q, k_cache, v_cache, cache_seqlens, k, v, block_table, bool(causal), int(window[0]), int(window[1]),
            float(softcap), scale, int(num_splits))  # fmt: skip
    # Eager calls skip the custom-op dispatch (tens of microseconds, as long as a whole decode step on a GPU).
    out, lse = kvcache_op(*args) if torch.compiler.is_compiling() else forward_impl(*args)
    return (out, lse) if return_lse else out
