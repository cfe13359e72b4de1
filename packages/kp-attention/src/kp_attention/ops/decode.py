"""KV-cache attention for decoding (FlashAttention's `flash_attn_with_kvcache`), forward only.

For batch b with L = cache_seqlens[b] + Sq_new valid keys (the new k/v, if any, are first written into the cache
at positions cache_seqlens[b] ...), query i of Sq sits on the diagonal p_i = i + L - Sq (bottom-right) and sees
key cache_leftpad[b] <= j < L (cache_leftpad 0 when not given) when
    causal:       j <= p_i                    window left  >= 0: j >= p_i - left
    window right >= 0 (non-causal): j <= p_i + right
    s = scale * q . k;  s = c * tanh(s / c) when softcap c > 0;  s -= slope_bh * |j - p_i| with ALiBi slopes;
    out = softmax(s) V;  lse = logsumexp(s)
Rows that see no key give out = 0 and lse = -inf.

Flash-decoding: program (b, kv head, row block, split) loads the queries of all the q heads of its GQA group as
one (group * Sq, D) tile, so K/V are read once per group, and walks its share of the visible key range (each
sequence's own range [lo, L) is cut into `num_splits` equal runs of BLOCK_N blocks, so nothing past L or left of
the window is read). With one split it writes the output directly; otherwise it writes a partial (out, lse) in
fp32 and a second kernel merges the splits: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
Paged caches (num_blocks, block_size, Hkv, D) are read through block_table; BLOCK_N divides block_size, so a
block of keys lies in one page and costs one block_table load.

impl="fa4" runs the attention with FlashAttention-4's kernel instead (kp_attention.ops.attention_fa4; no split-KV
on SM 9.0, so num_splits is not used), after kp's append kernel has written the new tokens. It reads whatever
lengths and page ids it is given, so this launcher clamps them into the cache first, and a value that needed it
sets the bad-input flag as kp's split kernel does (the row is then computed on the clamped length, not NaN).
"""

from typing import NamedTuple, Optional

import torch

import kp_core
from kp_attention.ops import attention_fa4
from kp_core import tuning

if kp_core.has_triton():
    from kp_attention.ops import decode_kernels as kernels

OP = "kp::flash_attention_with_kvcache"
FN = "kp_attention.flash_attention_with_kvcache"  # errors name the function the user called
PACKAGE = "kp-attention"
SPEC = "decode"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
PAGE_MULTIPLE = 16  # paged block_size must be a multiple of this (the smallest BLOCK_N tl.dot takes)
# A table of one page per sequence (FlashAttention's cache_batch_idx) takes any block_size: the kernels see this
# page size, so every key's page index is 0 and its slot its position (one compiled kernel for any cache length).
ONE_PAGE = 1 << 30
TRITON, FA4 = attention_fa4.TRITON, attention_fa4.FA4  # the op's `impl`, as kp::flash_attention's


def kernel_page(k_cache: torch.Tensor, block_table: torch.Tensor) -> int:
    """The PAGE the kernels are given for this paged cache (see ONE_PAGE)."""
    return ONE_PAGE if block_table.shape[1] == 1 else k_cache.shape[1]


MAX_SPLITS = 256
# The values of cache_seqlens, cache_leftpad and block_table. The kernels stay in bounds for any value: a sequence
# with a bad length, start or block id gets NaN rows, its new k / v are not written, and the split kernel sets a
# flag on the device. True (the default): no host sync; the flag is copied back without blocking and reported by a
# later call (ValueError) once the copy has landed, or at once by check_inputs(). "sync": every call reads the
# values back first and raises before launching (one device sync a call: at batch 1 more than the attention
# costs; a debug mode). False: no flag copied back either. Graph capture and torch.compile skip the host side.
VALIDATE_VALUES = True
# Eager calls per flag copy: the first call and every REPORT_EVERY-th after it look at the last copy and copy the
# flag back again; the calls between add no host work (at batch 1 a copy and its event cost about as much host time
# as the attention itself). A bad value is so reported within about REPORT_EVERY calls, or by check_inputs().
REPORT_EVERY = 16
# auto num_splits: one split where the programs fill FULL_WAVES per SM already, else ~WAVES per SM with splits
# (B * Hkv * splits ~ WAVES * SMs). H200, B1 L8k, CUDA-graph replay: 4 waves 3184 GB/s against 2631 at 3 (and 2 stages
# against 3 in _split_settings), `bench_decode.py --tune`.
FULL_WAVES = 3
WAVES = 4
MAX_BLOCK_M = 64  # query rows (group * Sq) per program; more rows take several programs
COMBINE_BLOCK_D = 32  # head-dim slice per combine program (up to 128 splits merged in one load)


LONG_STREAM = 2048  # keys per program from which the small-tile setting below streams faster


def _split_settings(block_d: int, element_size: int, keys_per_program: int) -> dict:
    """The split kernel's settings; `kp_core.pin("_decode_split", block_n=.., ...)` overrides them. Paged caches
    still cap block_n at the largest power of 2 dividing block_size."""
    if element_size == 2 and block_d <= 128 and keys_per_program >= LONG_STREAM:
        # Long runs of keys per program (B >= 16, or one split): small tiles, so that more programs share an SM
        # (H100, bf16 D 128: 3069 GB/s at B16 L32k and 3090 at B64 L8k against 2852 and 2764 with the tiles below).
        return kp_core.settings("_decode_split", block_n=32, num_warps=2, num_stages=2)
    # ~16 KiB of K per block: enough bytes in flight per stage to stream, no spills for the (M, D) accumulator.
    block_n = max(16, min(128, 8192 // (block_d * element_size) * 2))
    return kp_core.settings("_decode_split", block_n=block_n, num_warps=4, num_stages=2)


def auto_num_splits(device: torch.device, programs: int, max_blocks: int) -> int:
    """Splits so that programs * splits fills ~WAVES programs per SM (a small count off-GPU, where the
    interpreter runs programs one after another), never more than the key blocks a sequence can have. The rule,
    and how it differs from FlashAttention's num_splits_heuristic: docs/ops/decode.md, "The split count"."""
    if device.type == "cuda":
        sms = kp_core.sm_count(device.index if device.index is not None else torch.cuda.current_device())
        full, slots = FULL_WAVES * sms, WAVES * sms
    else:
        full = slots = 4
    if programs >= full:
        return 1
    return max(1, min(kp_core.cdiv(slots, programs), max_blocks, MAX_SPLITS))


class _Flag:
    """A device's bad-input flag (set by the split kernel), its pinned host copy and the copy's event."""

    def __init__(self, device: torch.device):
        cuda = device.type == "cuda"
        self.device = torch.zeros(1, dtype=torch.int32, device=device)
        self.ignored = torch.zeros(1, dtype=torch.int32, device=device)  # the kernels' target when nobody reads it
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.pending = False
        self.calls = 0

    def turn(self) -> bool:
        """Whether this eager call reports the landed copy and copies the flag back (see REPORT_EVERY)."""
        self.calls += 1
        return (self.calls - 1) % REPORT_EVERY == 0


_FLAGS: dict = {}


def _key(device: torch.device) -> tuple:
    if device.type != "cuda":
        return (device.type, None)
    return (device.type, device.index if device.index is not None else torch.cuda.current_device())


def _flag(device: torch.device) -> _Flag:
    key = _key(device)
    if key not in _FLAGS:
        _FLAGS[key] = _Flag(device)
    return _FLAGS[key]


def _bad_input_flag(q: torch.Tensor) -> tuple[Optional[_Flag], torch.Tensor]:
    """(the flag this call reports through, or None, and the device buffer the split kernel sets). Traced by
    torch.compile, the call gets a buffer of its own (the flag stays inside the graph); captured into a CUDA graph,
    the device's flag if it exists, reported by a later eager call."""
    if torch.compiler.is_compiling():
        return None, q.new_zeros(1, dtype=torch.int32)
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        flag = _FLAGS.get(_key(q.device))
        if flag is None:
            return None, q.new_zeros(1, dtype=torch.int32)
        return None, flag.device if VALIDATE_VALUES is True else flag.ignored
    flag = _flag(q.device)
    return (flag, flag.device) if VALIDATE_VALUES is True else (None, flag.ignored)


def _report(flag: _Flag) -> None:
    """Raise if the flag's landed copy says an earlier call had bad values (and clear it); never blocks."""
    if not flag.pending or (flag.event is not None and not flag.event.query()):
        return
    flag.pending = False
    if int(flag.host[0]):
        flag.host.zero_()
        flag.device.zero_()
        raise ValueError(
            f"{FN}: an earlier call had cache_seqlens, cache_leftpad or block_table values outside the cache (its "
            "rows came out NaN, its new k / v were not written) or, through kp_attention.flash_attn, rotary "
            "positions past rotary_cos's rows (clamped); set kp_attention.ops.decode.VALIDATE_VALUES = "
            '"sync" to raise in that call'
        )


def _copy_back(flag: _Flag) -> None:
    flag.host.copy_(flag.device, non_blocking=flag.event is not None)
    if flag.event is not None:
        flag.event.record()
    flag.pending = True


def check_inputs(device: Optional[torch.device] = None) -> None:
    """Raise ValueError if a call on `device` (default: the current CUDA device, else the CPU) since the last
    report had bad cache_seqlens, cache_leftpad or block_table values. Waits for those calls' flag: one sync."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    flag = _flag(device)
    _copy_back(flag)
    if flag.event is not None:
        flag.event.synchronize()
    _report(flag)


def pages_outside(block_table: torch.Tensor, lengths: torch.Tensor, page: int, num_blocks: int) -> torch.Tensor:
    """How many page ids that sequences of these lengths use (pages of `page` keys through block_table) lie outside
    [0, num_blocks): a device scalar, for a value check to read back."""
    used = torch.arange(block_table.shape[1], device=lengths.device)[None, :] * page < lengths.long()[:, None]
    return (used & ((block_table < 0) | (block_table >= num_blocks))).sum()


def _check_values(cache_seqlens, new, capacity, block_table, page, num_blocks, leftpad=None):
    """cache_seqlens + new within [0, capacity], cache_leftpad within [0, cache_seqlens] and, paged, the block ids
    in use within the cache: one sync (VALIDATE_VALUES = "sync", and the reference path)."""
    if not VALIDATE_VALUES or cache_seqlens.numel() == 0:
        return
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lo, hi = torch.aminmax(cache_seqlens)
    stats = [lo, hi]
    if block_table is not None:
        stats.append(pages_outside(block_table, cache_seqlens.long() + new, page, num_blocks).to(lo.dtype))
    if leftpad is not None:
        stats.append(((leftpad < 0) | (leftpad > cache_seqlens)).sum().to(lo.dtype))
    stats = torch.stack(stats).tolist()
    if stats[0] < 0:
        raise ValueError(f"{FN}: cache_seqlens must be >= 0, got a minimum of {stats[0]}")
    if stats[1] + new > capacity:
        raise ValueError(
            f"{FN}: cache_seqlens ({stats[1]} at most) plus new tokens ({new}) exceed the cache's {capacity} slots"
        )
    if block_table is not None and stats[2]:
        raise ValueError(f"{FN}: block_table has {stats[2]} block ids in use outside [0, {num_blocks})")
    if leftpad is not None and stats[-1]:
        raise ValueError(f"{FN}: cache_leftpad has {stats[-1]} values outside [0, cache_seqlens]")


# ---- the cache update and the reference path ----


def _append(k_cache, v_cache, cache_seqlens, k, v, block_table):
    """Write k, v (B, Sn, Hkv, D) into the caches at positions cache_seqlens[b] + (0 .. Sn - 1), in place.

    The reference path's form (one index_put_ per cache; an index out of range raises in torch); the kernel
    path writes through _launch_append."""
    batch, new = k.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(new, device=k.device)[None, :]
    if block_table is None:
        index = (torch.arange(batch, device=k.device)[:, None].expand(batch, new), pos)
    else:
        page = k_cache.shape[1]
        index = (block_table.long().gather(1, pos // page), pos % page)
    k_cache.index_put_(index, k)
    v_cache.index_put_(index, v)


def _launch_append(backend, k_cache, v_cache, cache_seqlens, k, v, block_table, capacity):
    """The kernel form of _append: bounds-checked on the device, so it is safe with the value check off."""
    batch, new, hkv, d = k.shape
    paged = block_table is not None
    bt = block_table if paged else cache_seqlens
    block_d = kp_core.next_power_of_2(d)
    kp_core.launch(
        OP,
        backend,
        kernels._decode_append,
        (batch * new,),
        (k, *k.stride(), v, *v.stride(), k_cache, *k_cache.stride(), v_cache, *v_cache.stride(), cache_seqlens, bt)
        + (bt.stride(0) if paged else 0, new, hkv, capacity, k_cache.shape[0]),
        dict(
            D=d,
            BLOCK_H=max(1, min(kp_core.next_power_of_2(hkv), 4096 // block_d)),
            BLOCK_D=block_d,
            PAGE=kernel_page(k_cache, block_table) if paged else 1,
            PAGED=paged,
        ),
        4,
    )


def _reference(
    q, k_cache, v_cache, seqlens, block_table, alibi, leftpad, causal, window_left, window_right, softcap, scale
):
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
        if alibi is not None:
            slopes = (alibi[b] if alibi.dim() == 2 else alibi).float()
            s = s - slopes[:, None, None] * (idx[None, :] - diag).abs().float()
        ok = torch.ones(sq, n, dtype=torch.bool, device=q.device)
        if right >= 0:
            ok &= idx[None, :] <= diag + right
        if window_left >= 0:
            ok &= idx[None, :] >= diag - window_left
        if leftpad is not None:
            ok &= idx[None, :] >= int(leftpad[b])
        s = s.masked_fill(~ok, float("-inf"))
        lse_b = torch.logsumexp(s, -1)  # (Hq, Sq)
        p = torch.exp(s - torch.where(lse_b.isinf(), 0.0, lse_b)[..., None])
        out[b] = torch.einsum("hqk,khd->qhd", p, vb).to(q.dtype)
        lse[b] = lse_b
    return out, lse


# ---- launcher and declaration ----


def _fa4(q, k_cache, v_cache, seqlens, block_table, causal, left, right, softcap, scale, capacity, bad):
    """(out, lse) by FlashAttention-4, lengths clamped into [0, capacity] and page ids into the pool (see the
    module docstring); with VALIDATE_VALUES, a value outside sets `bad`."""
    lengths = seqlens.clamp(0, capacity)
    table, num_blocks = block_table, k_cache.shape[0]
    if block_table is not None:
        table = block_table.clamp(0, num_blocks - 1)
    if VALIDATE_VALUES:
        wrong = (lengths != seqlens).any()
        if block_table is not None:
            wrong = wrong | (pages_outside(block_table, lengths, k_cache.shape[1], num_blocks) > 0)
        bad.copy_(torch.maximum(bad, wrong.to(bad.dtype).reshape(1)))
    right = 0 if causal else right
    return attention_fa4.forward(
        OP, q, k_cache, v_cache, scale, softcap, left, right, block_table=table, seqused_k=lengths.to(torch.int32)
    )


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: Optional[torch.Tensor],
    v: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor],
    causal: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
    num_splits: int,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Sq, Hq, D) in q's dtype, lse (B, Hq, Sq) fp32); writes k, v into the caches first. impl: "triton"
    (kp's kernels) or "fa4" (see the module docstring)."""
    leftpad, diagonal = cache_leftpad is not None, causal or window_right >= 0
    attention_fa4.check(FN, impl, q, k_cache, v_cache, alibi=alibi_slopes is not None, leftpad=leftpad, causal=diagonal)
    for name, t in (
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("cache_seqlens", cache_seqlens),
        ("k", k),
        ("v", v),
        ("block_table", block_table),
        ("alibi_slopes", alibi_slopes),
        ("cache_leftpad", cache_leftpad),
    ):
        if t is not None and t.device != q.device:
            kp_core.check_same_device(FN, q=q, **{name: t})
    batch, sq, hq, d = q.shape
    num_blocks, page, hkv, _ = k_cache.shape
    paged = block_table is not None
    capacity = block_table.shape[1] * page if paged else page
    new = 0 if k is None else k.shape[1]
    seqlens = cache_seqlens + new if new else cache_seqlens
    backend = kp_core.choose_backend(OP, q)
    reference = backend == kp_core.REFERENCE or q.numel() == 0
    if reference or VALIDATE_VALUES == "sync":  # the reference path indexes with the values: checked first
        _check_values(cache_seqlens, new, capacity, block_table, page, num_blocks, cache_leftpad)
    flag, bad = _bad_input_flag(q)
    flag = flag if flag is not None and flag.turn() else None  # this call's turn to report and copy back
    if flag is not None:
        _report(flag)
    if reference:
        kp_core.reference(OP)
        if new:
            _append(k_cache, v_cache, cache_seqlens, k, v, block_table)
        args = (causal, window_left, window_right, softcap, scale)
        return _reference(q, k_cache, v_cache, seqlens, block_table, alibi_slopes, cache_leftpad, *args)
    if new:
        _launch_append(backend, k_cache, v_cache, cache_seqlens.contiguous(), k, v, block_table, capacity)
    if impl == FA4:
        out, lse = _fa4(
            q, k_cache, v_cache, seqlens, block_table, causal, window_left, window_right, softcap, scale, capacity, bad
        )
        if flag is not None and not flag.pending:
            _copy_back(flag)
        return out, lse

    q = _unit_last(q)
    k_read, v_read = _unit_last(k_cache), _unit_last(v_cache)  # copies only for a cache with strided head dims
    seqlens = seqlens.contiguous()
    plan = _plan(
        q,
        k_cache,
        block_table,
        alibi_slopes,
        cache_leftpad,
        causal,
        window_left,
        window_right,
        softcap,
        num_splits,
        capacity,
    )
    splits = plan.splits
    out = q.new_empty((batch, sq, hq, d))
    lse = q.new_empty((batch, hq, sq), dtype=torch.float32)
    if splits > 1:
        # The splits' partials live only between the two kernels of this call: reused buffers.
        o_part = kp_core.workspace(q, (batch * hq * sq, splits, d), torch.float32)
        lse_part = kp_core.workspace(q, (batch * hq * sq, splits), torch.float32)
    else:
        o_part = lse_part = lse  # never touched
    bt = _unit_last(block_table) if paged else seqlens
    qs, ks, vs, os = q.stride(), k_read.stride(), v_read.stride(), out.stride()
    alibi_strides = (0, 0)
    if alibi_slopes is not None:
        alibi_strides = (alibi_slopes.stride(0) if alibi_slopes.dim() == 2 else 0, alibi_slopes.stride(-1))
    args = (
        q,
        qs[0],
        qs[1],
        qs[2],
        k_read,
        ks[0],
        ks[1],
        ks[2],
        v_read,
        vs[0],
        vs[1],
        vs[2],
        seqlens,
        bt,
        bt.stride(0) if paged else 0,
        seqlens if alibi_slopes is None else alibi_slopes,
        *alibi_strides,
        seqlens if cache_leftpad is None else cache_leftpad.contiguous(),
        out,
        os[0],
        os[1],
        os[2],
        lse,
        o_part,
        lse_part,
        hkv,
        hq // hkv,
        sq,
        splits,
        plan.m_blocks,
        float(scale),
        float(softcap),
        window_left,
        0 if causal else window_right,
        capacity,
        num_blocks,
        new,
        bad,
    )
    kp_core.launch(OP, backend, kernels._decode_split, plan.grid, args, plan.consts, plan.num_warps, plan.num_stages)
    if splits > 1:
        kp_core.launch(
            OP,
            backend,
            kernels._decode_combine,
            plan.combine_grid,
            (o_part, lse_part, out, os[0], os[1], os[2], lse, hq, sq, splits),
            plan.combine_consts,
            plan.combine_warps,
        )
    if flag is not None and not flag.pending:
        _copy_back(flag)
    return out, lse


class _Plan(NamedTuple):
    """A call signature's launch settings (everything but the tensors and the per-call scalars)."""

    splits: int
    m_blocks: int
    grid: tuple
    consts: kp_core.Constexprs
    num_warps: int
    num_stages: int
    combine_grid: tuple
    combine_consts: Optional[kp_core.Constexprs]
    combine_warps: int


_PLANS: dict = {}


def _plan(q, k_cache, block_table, alibi, leftpad, causal, left, right, softcap, num_splits, capacity) -> _Plan:
    """The launch settings of this signature, worked out once (an eager decoding step is host-bound at batch 1:
    every microsecond of Python here is one of the step's). Pins and WAVES are part of the key."""
    paged = block_table is not None
    key = (q.shape, q.dtype, q.device, k_cache.shape, block_table.shape[1] if paged else None, alibi is None)
    key += (leftpad is None, causal, left, right, softcap > 0, num_splits, WAVES, FULL_WAVES, tuning.generation())
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 1024:  # a signature per cache length (contiguous caches of many sizes): bounded
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(
            q, k_cache, block_table, alibi, leftpad, causal, left, right, softcap, num_splits, capacity
        )
    return plan


def _make_plan(q, k_cache, block_table, alibi, leftpad, causal, left, right, softcap, num_splits, capacity) -> _Plan:
    batch, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    paged = block_table is not None
    block_d = max(16, kp_core.next_power_of_2(d))
    rows = hq // hkv * sq
    block_m = max(16, min(MAX_BLOCK_M, kp_core.next_power_of_2(rows)))
    m_blocks = kp_core.cdiv(rows, block_m)
    programs = batch * hkv * m_blocks
    # Splits are counted in blocks of the smallest BLOCK_N (16) and capped again once the tile is known.
    splits = num_splits if num_splits > 0 else auto_num_splits(q.device, programs, kp_core.cdiv(capacity, 16))
    tiles = _split_settings(block_d, q.element_size(), capacity // max(1, splits))
    kpage = kernel_page(k_cache, block_table) if paged else ONE_PAGE
    block_n = min(tiles["block_n"], kpage & -kpage)  # a block of keys in one page
    splits = max(1, min(splits, kp_core.cdiv(capacity, block_n), 65535))
    ieee = q.dtype == torch.float32
    consts = kp_core.Constexprs(
        D=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PAGE=kpage if paged else 1,
        PAGED=paged,
        HAS_LEFT=left >= 0,
        HAS_RIGHT=(0 if causal else right) >= 0,
        SOFTCAP=softcap > 0,
        HAS_ALIBI=alibi is not None,
        HAS_LEFTPAD=leftpad is not None,
        IEEE=ieee,
        ONE_SPLIT=splits == 1,
    )
    combine_grid, combine_consts, combine_warps = (), None, 0
    if splits > 1:
        block_d_c = min(COMBINE_BLOCK_D, kp_core.next_power_of_2(d))
        block_s = max(2, min(kp_core.next_power_of_2(splits), max(2, 4096 // block_d_c)))
        combine_grid = (batch * hq * sq, kp_core.cdiv(d, block_d_c))
        combine_consts = kp_core.Constexprs(D=d, BLOCK_S=block_s, BLOCK_D=block_d_c, IEEE=ieee)
        combine_warps = 4 if block_s * block_d_c >= 2048 else 2
    grid = (programs, splits)
    return _Plan(
        splits,
        m_blocks,
        grid,
        consts,
        tiles["num_warps"],
        tiles["num_stages"],
        combine_grid,
        combine_consts,
        combine_warps,
    )


def _forward_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, *rest):
    batch, sq, hq, d = q.shape
    return q.new_empty((batch, sq, hq, d)), q.new_empty((batch, hq, sq), dtype=torch.float32)


KVCACHE = kp_core.op(
    OP,
    forward,
    _forward_fake,
    mutates_args=("k_cache", "v_cache"),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)
