"""FlashAttention ops: launch settings, launchers, the PyTorch reference and the two op declarations.

kp::flash_attention takes dense (B, S, H, D) tensors with any strides, (B, H, S, D) views (SDPA) included, and an
optional mask; kp::flash_attention_varlen takes packed (total, H, D) tensors with cu_seqlens. One launcher pair
serves both; the maths and the shared Triton helpers are in kp_attention.ops.attention_blocks, the kernels in
attention_fwd_kernels and attention_bwd_kernels; the spec is conformance/specs/test_attention.py. Both ops take
`impl`: "triton" (kp's kernels, or the PyTorch reference off a GPU) or "fa4" (FlashAttention-4's CuTe DSL
kernels, kp_attention.ops.attention_fa4), behind the same checks, saved tensors and launch record.

fp16/bf16 use tensor-core dots with fp32 accumulation; fp32 inputs use exact products (no TF32) summed in fp64
per block (attention_blocks.dot; fp32 FMA chains on Triton < 3.5), a correctness path rather than a fast one.
"""

import dataclasses
import functools
import math
from typing import Optional

import torch

import kp_core
from kp_attention.ops import attention_fa4, decode, dropout

if kp_core.has_triton():
    from kp_attention.ops import attention_bwd_kernels as bwd_kernels
    from kp_attention.ops import attention_fwd_kernels as fwd_kernels

OP = "kp::flash_attention"
OP_BWD = f"{OP}_backward"
OP_VARLEN = "kp::flash_attention_varlen"
OP_VARLEN_BWD = f"{OP_VARLEN}_backward"
PACKAGE = "kp-attention"
SPEC = "attention"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
# Eager varlen calls check cu_seqlens' values (one host sync); set False to skip (values are then trusted).
VALIDATE_CU_SEQLENS = True
TRITON, FA4 = attention_fa4.TRITON, attention_fa4.FA4  # the ops' `impl`


@dataclasses.dataclass(frozen=True)
class Params:
    """Everything but the tensors: the structural mask, the score transform, and the layout."""

    scale: float
    softcap: float = 0.0
    window_left: int = -1  # -1: unbounded
    window_right: int = -1
    bottom_right: bool = True  # diagonal offset Sk - Sq (FlashAttention) or 0 (torch's is_causal)
    max_seqlen_q: int = 0  # varlen only
    max_seqlen_k: int = 0
    dropout_p: float = 0.0  # with a seed tensor (kp_attention.ops.dropout)
    impl: str = TRITON  # whose kernels run the call (attention_fa4.IMPLS)
    deterministic: bool = False  # FlashAttention-4's backward only: kp's is deterministic always


def window_pair(window):
    """An integer tensor of two as a (left, right) tuple (FlashAttention's tests draw window_size with
    torch.randint); anything else as it is, for the callers' checks."""
    if isinstance(window, torch.Tensor) and window.shape == (2,) and not window.is_floating_point():
        return tuple(window.tolist())
    return window


# Tile settings per kernel: (block_m, block_n, num_warps, num_stages). GPU values for fp16/bf16 were chosen so
# ptxas (sm_90a) reports no or few spills (bytes spilled: D64 0/4/0, D256 30/248/84 for fwd/dkdv/dq); D128's
# backward tiles are the fastest of `bench_attention.py --tune` (H100, triton 3.6, B4 S4096 H16, fwd+bwd).
_HALF = {
    64: {"_attn_fwd": (128, 64, 4, 3), "_attn_bwd_dkdv": (32, 128, 8, 3), "_attn_bwd_dq": (128, 32, 8, 3)},
    128: {"_attn_fwd": (128, 64, 8, 3), "_attn_bwd_dkdv": (64, 64, 4, 2), "_attn_bwd_dq": (128, 64, 8, 3)},
    256: {"_attn_fwd": (128, 32, 8, 2), "_attn_bwd_dkdv": (32, 32, 8, 2), "_attn_bwd_dq": (64, 32, 8, 2)},
}

# fp32 (dots summed in fp64, attention_blocks.dot): a correctness path, so small tiles that ptxas (sm_90a, Triton
# 3.6) compiles in about 2 s per kernel with no or few spills; larger ones compile slower and spill.
_FP32 = {
    64: {"_attn_fwd": (32, 32, 4, 2), "_attn_bwd_dkdv": (16, 32, 4, 1), "_attn_bwd_dq": (32, 32, 4, 1)},
    128: {"_attn_fwd": (32, 16, 4, 2), "_attn_bwd_dkdv": (16, 16, 4, 1), "_attn_bwd_dq": (32, 16, 4, 1)},
    256: {"_attn_fwd": (16, 16, 4, 2), "_attn_bwd_dkdv": (16, 16, 4, 1), "_attn_bwd_dq": (16, 32, 4, 1)},
}


def launch_tiles(kernel: str, block_d: int, element_size: int, device: torch.device) -> dict:
    return _tiles_for(kernel, block_d, element_size, device.type, kp_core.tuning.generation())


@functools.lru_cache(maxsize=256)
def _tiles_for(kernel: str, block_d: int, element_size: int, device_type: str, _generation: int) -> dict:
    """Launch settings of one kernel; `kp_core.pin(kernel, block_m=.., ...)` overrides them (benchmark sweeps).
    The interpreter gets 64 x 64 tiles: the specs' lengths (up to 257) still cross several block boundaries, and
    each interpreted step costs about the same at 64 as at 32 (numpy on a tile), so a call takes about a quarter
    of the steps."""
    if device_type != "cuda":
        tile = (64, 64, 4, 1)
    elif kernel == "_attn_bwd_preprocess":
        tile = (64, 1, 4, 1)
    elif element_size == 4:
        tile = _FP32[64 if block_d <= 64 else 128 if block_d <= 128 else 256][kernel]
    else:
        tile = _HALF[64 if block_d <= 64 else 128 if block_d <= 128 else 256][kernel]
    return kp_core.settings(kernel, **dict(zip(("block_m", "block_n", "num_warps", "num_stages"), tile)))


# The forward's Q/K/V tiles through TMA descriptors (attention_fwd_kernels, TMA): off until it is measured faster
# on a GPU; `kp_core.pin("_attn_fwd", tma=True)` turns it on where tma_ok allows it (tests, benchmark sweeps).
FWD_TMA = False


def tma_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool, paged: bool) -> bool:
    """Whether the forward may read q, k, v (B, S, H, D) through tensor descriptors: Triton >= 3.4, dense fp16/bf16
    with a power-of-2 head dim (no padded columns), unit dim strides and 16-byte aligned bases and strides (what
    TMA addresses), and not inside torch.compile's trace (its Triton wrapper takes pointer kernels)."""
    if varlen or paged or q.dtype not in (torch.float16, torch.bfloat16) or torch.compiler.is_compiling():
        return False
    import triton.language as tl  # here, not at the top: kp-attention imports without Triton (CPU torch)

    if not hasattr(tl, "make_tensor_descriptor") or q.shape[-1] != block_dim(q.shape[-1]):
        return False
    size = q.element_size()
    return all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in t.stride()[:-1])
        for t in (q, k, v)
    )


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _tma_allocator() -> None:
    """Descriptors made on a GPU need Triton's scratch allocator: kp's, unless the caller has set one."""
    import triton
    from triton.runtime import _allocation

    if type(_allocation._allocator.get()).__name__ == "NullAllocator":
        triton.set_allocator(_tma_scratch)


def block_dim(d: int) -> int:
    return max(16, kp_core.next_power_of_2(d))  # tl.dot needs K >= 16


def _bshd(t: torch.Tensor, varlen: bool) -> tuple:
    """(batch, seq, head, dim) strides; packed varlen tensors have no batch stride."""
    return (0, *t.stride()) if varlen else tuple(t.stride())


def _mask_args(mask: Optional[torch.Tensor], alibi: Optional[torch.Tensor], b: int, h: int, sq: int, sk: int, dtype):
    """(tensor, 4 broadcast strides, kind): kind 0 none, 1 boolean (read as uint8), 2 additive float, 3 ALiBi
    slopes (fp32, (H,) or (B, H): strides (batch, head, 0, 0); never with a mask, the public functions see to it).

    fp32 inputs take a boolean mask as the additive one it equals (0 / -inf; s + 0 is s exactly): Triton 3.6 fails
    to lower a uint8 tile into the fp64 dot layout of the fp32 path (attention_blocks.dot)."""
    if alibi is not None:
        return alibi, (alibi.stride(0) if alibi.dim() == 2 else 0, alibi.stride(-1), 0, 0), 3
    if mask is None:
        return None, (0, 0, 0, 0), 0
    if mask.dtype == torch.bool and dtype == torch.float32:
        mask = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    m = mask.expand(b, h, sq, sk)
    kind = 1 if m.dtype == torch.bool else 2
    if kind == 1:
        m = m.view(torch.uint8)
    return m, tuple(m.stride()), kind


def _score_args(p: Params, dtype: torch.dtype) -> tuple[float, float, float]:
    """(qk_scale, sc_in, sc_out): the scale in the scores' units (base 2, natural for fp32: attention_blocks.score_exp),
    and the softcap constants of attention_blocks.scores."""
    unit = 1.0 if dtype == torch.float32 else kp_core.LOG2E
    if p.softcap > 0:
        return p.scale * unit, 2.0 * kp_core.LOG2E * p.scale / p.softcap, p.softcap * unit
    return p.scale * unit, 1.0, 1.0


def _structure(p: Params, q, k, cu_q):
    """(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, varlen) of a call (paged k: heads at dim 2)."""
    if cu_q is not None:
        return cu_q.shape[0] - 1, p.max_seqlen_q, p.max_seqlen_k, q.shape[1], k.shape[-2], q.shape[2], True
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], False


def _lse_empty(q, b, hq, sq, varlen):
    return q.new_empty((hq, q.shape[0]) if varlen else (b, hq, sq), dtype=torch.float32)


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _switches(p: Params, d: int, varlen: bool, mask_kind: int, dtype: torch.dtype, tiles: dict) -> dict:
    """The kernels' compile-time switches in their signature order (one compiled variant per combination)."""
    return dict(
        HEAD_DIM=d,
        BLOCK_M=tiles["block_m"],
        BLOCK_N=tiles["block_n"],
        BLOCK_D=block_dim(d),
        PAD_D=d != block_dim(d),
        VARLEN=varlen,
        BOTTOM_RIGHT=p.bottom_right,
        HAS_LEFT=p.window_left >= 0,
        HAS_RIGHT=p.window_right >= 0,
        SOFTCAP=p.softcap > 0,
        MASK_KIND=mask_kind,
        DROPOUT=p.dropout_p > 0,
        IEEE=dtype == torch.float32,
    )


def check_cu_seqlens(
    op: str, cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, p: Params, block_table=None, page=0
) -> None:
    """Values of cu_seqlens: start at 0, non-decreasing, end at the packed length, max <= max_seqlen; with a paged
    k/v (block_table, pages of `page` keys, total_k pages), each length within the sequence's pages and the page ids
    in use within the cache (host sync)."""
    for name, cu, total, max_len in (
        ("cu_seqlens_q", cu_q, total_q, p.max_seqlen_q),
        ("cu_seqlens_k", cu_k, None if block_table is not None else total_k, p.max_seqlen_k),
    ):
        vals = cu.tolist()
        lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
        longest = max(lens, default=0)  # the last pass's, cu_seqlens_k's, is the paged check's
        if vals[0] != 0:
            raise ValueError(f"{op}: {name} must start at 0, got {vals[0]}")
        if any(n < 0 for n in lens):
            raise ValueError(f"{op}: {name} must be non-decreasing, got {vals}")
        if total is not None and vals[-1] != total:
            raise ValueError(f"{op}: {name}[-1] must equal the packed length {total}, got {vals[-1]}")
        if longest > max_len:
            name_max = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
            raise ValueError(f"{op}: {name_max}={max_len} is smaller than the longest sequence ({longest})")
    if block_table is None:
        return
    if longest > block_table.shape[1] * page:
        raise ValueError(
            f"{op}: a sequence of {longest} keys exceeds its block_table's {block_table.shape[1]} pages of {page}"
        )
    bad = int(decode.pages_outside(block_table, cu_k[1:] - cu_k[:-1], page, total_k))
    if bad:
        raise ValueError(f"{op}: block_table has {bad} page ids in use outside [0, {total_k}) (the paged k/v)")


# ---- reference path (CPU without the interpreter, or KP_BACKEND=reference) ----


def _alibi_bias(alibi: torch.Tensor, sq: int, sk: int, bottom_right: bool) -> torch.Tensor:
    """(B or 1, H, Sq, Sk) fp32: -slope * |j - i - diag| (FlashAttention's ALiBi bias)."""
    i = torch.arange(sq, device=alibi.device)[:, None]
    j = torch.arange(sk, device=alibi.device)[None, :]
    dist = (j - i - (sk - sq if bottom_right else 0)).abs().float()
    slopes = alibi.float().reshape(-1 if alibi.dim() == 2 else 1, alibi.shape[-1], 1, 1)
    return -slopes * dist


def _exp_scores(q, k, mask, alibi, p: Params):
    """(e, m), fp32 (B, Hq, Sq, Sk) and (B, Hq, Sq, 1), of (B, S, H, D) q and k: m is each row's largest score
    (0 for a row with no visible key) and e = exp(s - m), 0 where masked."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qf, kf = (t.float().transpose(1, 2) for t in (q, k))
    kf = kf.repeat_interleave(hq // hkv, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * p.scale
    if p.softcap > 0:
        s = p.softcap * torch.tanh(s / p.softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    if alibi is not None:
        s = s + _alibi_bias(alibi, sq, sk, p.bottom_right)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    rel = j - i - (sk - sq if p.bottom_right else 0)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if p.window_right >= 0:
        allowed &= rel <= p.window_right
    if p.window_left >= 0:
        allowed &= rel >= -p.window_left
    return exp_rows(s.masked_fill(~allowed, float("-inf")))


def exp_rows(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, m) of scores s (-inf where masked): m each row's largest score (0 for a row with no visible key) and
    e = exp(s - m)."""
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    return torch.exp(s - m), m


def softmax_lse(e: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(probabilities, lse) of exp_rows' (e, m): rows with no visible key give 0 and -inf."""
    denom = e.sum(-1, keepdim=True)
    has = denom > 0
    denom_safe = torch.where(has, denom, torch.ones_like(denom))
    lse = torch.where(has, torch.log(denom_safe) + m, torch.full_like(m, float("-inf")))
    return e / denom_safe, lse.squeeze(-1)


def _reference_dense(q, k, v, mask, alibi, keep, p: Params):
    """(out, lse) for (B, S, H, D) tensors, in fp32 from the formula; fully masked rows give 0 and -inf. keep:
    dropout's (B, H, Sq, Sk) mask, or None."""
    probs, lse = softmax_lse(*_exp_scores(q, k, mask, alibi, p))
    vf = v.float().transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], dim=1)
    if keep is not None:
        probs = probs * keep * dropout.keep_scale(p.dropout_p)
    return (probs @ vf).transpose(1, 2).to(q.dtype), lse


def signed_exp_scores(q, k, alibi, seed, first_batch: int, p: Params) -> torch.Tensor:
    """FlashAttention's S_dmask for (B, S, H, D) q and k: exp(s - row max), fp32 (B, Hq, Sq, Sk), negative where
    dropout dropped the probability (batches numbered from first_batch for dropout: a packed sequence's index)."""
    e, _ = _exp_scores(q, k, None, alibi, p)
    keep = _keep(seed, range(first_batch, first_batch + q.shape[0]), q.shape[2], q.shape[1], k.shape[1], p)
    return e if keep is None else torch.where(keep, e, -e)


def _unpage(t: torch.Tensor, cu_k: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Packed (total_k, H, D) keys (or values) of paged (num_blocks, page, H, D) ones: sequence b's key j from page
    block_table[b, j // page], slot j % page."""
    page, rows = t.shape[1], []
    for b, (start, end) in enumerate(zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
        j = torch.arange(end - start, device=t.device)
        rows.append(t[block_table[b].long()[j // page], j % page])
    return torch.cat(rows) if rows else t.new_zeros((0, *t.shape[2:]))


def _keep(seed, batches: range, heads: int, sq: int, sk: int, p: Params):
    """dropout's mask of these batches (or sequences), (len, heads, sq, sk); None without dropout."""
    if p.dropout_p == 0:
        return None
    bh = torch.arange(batches.start * heads, batches.stop * heads, device=seed.device)
    return dropout.keep_mask(seed, bh, sq, sk, p.dropout_p).view(len(batches), heads, sq, sk)


def _reference_forward(q, k, v, mask, alibi, seed, cu_q, cu_k, p: Params):
    if cu_q is None:
        keep = _keep(seed, range(q.shape[0]), q.shape[2], q.shape[1], k.shape[1], p)
        return _reference_dense(q, k, v, mask, alibi, keep, p)
    outs, lses = [], []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        sl_q = slice(bounds_q[i], bounds_q[i + 1])
        sl_k = slice(bounds_k[i], bounds_k[i + 1])
        slopes = alibi[i] if alibi is not None and alibi.dim() == 2 else alibi
        keep = _keep(seed, range(i, i + 1), q.shape[1], sl_q.stop - sl_q.start, sl_k.stop - sl_k.start, p)
        o, lse = _reference_dense(q[None, sl_q], k[None, sl_k], v[None, sl_k], None, slopes, keep, p)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1) if lses else _lse_empty(q, 0, q.shape[1], 0, True)


def _reference_backward(dout, dlse, q, k, v, mask, alibi, seed, cu_q, cu_k, p: Params):
    def outputs(q, k, v):
        out, lse = _reference_forward(q, k, v, mask, alibi, seed, cu_q, cu_k, p)
        return out if dlse is None else (out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))

    return kp_core.vjp(outputs, (q, k, v), dout if dlse is None else (dout, dlse))


# ---- launchers ----


def _check_devices(op: str, q, **others) -> None:
    """The ops are public torch ops too: a tensor on another device must not reach a kernel."""
    for name, t in others.items():
        if t is not None and t.device != q.device:
            kp_core.check_same_device(op, q=q, **{name: t})


def _check_dropout(op: str, seed, p: Params) -> None:
    """The ops are public: dropout needs its seed, and p in [0, 1]."""
    if not 0.0 <= p.dropout_p <= 1.0:
        raise ValueError(f"{op}: dropout_p must lie in [0, 1], got {p.dropout_p}")
    if p.dropout_p > 0 and (seed is None or seed.dtype != torch.int64 or seed.numel() != 1):
        raise ValueError(f"{op}: dropout_p > 0 needs dropout_seed, a one-element int64 tensor, got {seed!r}")


def _forward(op, q, k, v, mask, alibi, seed, cu_q, cu_k, p: Params, block_table=None):
    """(out, lse): out like q (contiguous, q's layout), lse fp32 (B, Hq, Sq), or (Hq, total_q) when packed.
    block_table (varlen): k and v are (num_blocks, page, Hkv, D) pages (the public function checks the shapes)."""
    _check_dropout(op, seed, p)
    attention_fa4.check(
        op,
        p.impl,
        q,
        k,
        v,
        alibi=alibi is not None,
        mask=mask is not None,
        dropout=p.dropout_p > 0,
        top_left=not p.bottom_right,
        causal=p.window_left >= 0 or p.window_right >= 0,
    )
    _check_devices(
        op,
        q,
        k=k,
        v=v,
        attn_mask=mask,
        alibi_slopes=alibi,
        dropout_seed=seed,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        block_table=block_table,
    )
    b, sq, sk, hq, hkv, d, varlen = _structure(p, q, k, cu_q)
    paged = block_table is not None
    page = k.shape[1] if paged else 0
    if varlen and VALIDATE_CU_SEQLENS and not torch.compiler.is_compiling():
        check_cu_seqlens(op, cu_q, cu_k, q.shape[0], k.shape[0], p, block_table, page)
    if q.numel() == 0 or k.shape[0] == 0 or b == 0 or sq == 0 or sk == 0:  # nothing to launch
        return q.new_zeros(q.shape), _lse_empty(q, b, hq, sq, varlen).fill_(float("-inf"))
    if p.impl == FA4:
        seqused_k = cu_k[1:] - cu_k[:-1] if paged else None  # pages come with key counts, not offsets
        bounds = (p.max_seqlen_q, p.max_seqlen_k) if varlen else (None, None)
        args = (p.scale, p.softcap, p.window_left, p.window_right, cu_q, cu_k, *bounds, block_table, seqused_k)
        return attention_fa4.forward(op, q, k, v, *args)
    backend = kp_core.choose_backend(op, q)
    if backend == kp_core.REFERENCE:
        kp_core.reference(op)
        if paged:  # the pages gathered into a packed k/v, as the sequences' keys
            k, v = _unpage(k, cu_k, block_table), _unpage(v, cu_k, block_table)
        out, lse = _reference_forward(q, k, v, mask, alibi, seed, cu_q, cu_k, p)
        return out.contiguous(), lse.contiguous()
    out = q.new_empty(q.shape)
    lse = _lse_empty(q, b, hq, sq, varlen)
    m, m_strides, mask_kind = _mask_args(mask, alibi, b, hq, sq, sk, q.dtype)
    tiles = launch_tiles("_attn_fwd", block_dim(d), q.element_size(), q.device)
    if paged:  # a block of keys in one page
        tiles = {**tiles, "block_n": min(tiles["block_n"], page & -page)}
    kv_strides = (*k.stride(), *v.stride()) if paged else (*_bshd(k, varlen), *_bshd(v, varlen))
    args = (
        q,
        k,
        v,
        out,
        lse,
        lse if m is None else m,
        lse if seed is None else seed,
        cu_q if varlen else lse,
        cu_k if varlen else lse,
        block_table if paged else lse,
        *_bshd(q, varlen),
        *kv_strides,
        *_bshd(out, varlen),
        *_lse_strides(lse, varlen),
        *m_strides,
        sq,
        sk,
        hq // hkv,
        *_score_args(p, q.dtype),
        p.window_left,
        p.window_right,
        *_dropout_args(p),
        block_table.stride(0) if paged else 0,
        k.shape[0] if paged else 1,
    )
    grid = (kp_core.cdiv(sq, tiles["block_m"]), hq, b)
    tma = tiles.get("tma", FWD_TMA) and tma_ok(q, k, v, varlen, paged)  # "tma" there when pinned
    if tma and q.is_cuda:
        _tma_allocator()
    switches = {**_switches(p, d, varlen, mask_kind, q.dtype, tiles), "PAGED": paged, "PAGE": max(page, 1)}
    kp_core.launch(
        op,
        backend,
        fwd_kernels._attn_fwd,
        grid,
        args,
        {**switches, "TMA": tma},
        tiles["num_warps"],
        tiles["num_stages"],
    )
    return out, lse


# fp16/bf16 head dims up to this take delta = sum_j P_ij dP_ij from a first pass of the dQ kernel (EXACT_DELTA in
# attention_bwd_kernels._attn_bwd_dq), where rowsum(dO * O) of the rounded O was 5-10x torch's dq error with large
# logits (PyTorch's op tests: head dim 8, values in [-9, 9]); small head dims make that pass cheap.
EXACT_DELTA_MAX_HEAD_DIM = 32


def exact_delta(dtype: torch.dtype, d: int) -> bool:
    return dtype != torch.float32 and d <= EXACT_DELTA_MAX_HEAD_DIM


def _dropout_args(p: Params) -> tuple[int, float]:
    return dropout.threshold(p.dropout_p), dropout.keep_scale(p.dropout_p)


def _backward(op, dout, dlse, q, k, v, out, lse, mask, alibi, seed, cu_q, cu_k, p: Params):
    """(dq, dk, dv), each laid out like its input (torch.empty_like: a (B, H, S, D) leaf's transposed view gets its
    gradient in the leaf's own layout, which autograd then takes without a copy). dlse (may be None) is the gradient
    that reached lse."""
    b, sq, sk, hq, hkv, d, varlen = _structure(p, q, k, cu_q)
    if q.numel() == 0 or k.numel() == 0 or b == 0 or sq == 0 or sk == 0:
        return tuple(torch.zeros_like(t) for t in (q, k, v))
    if p.impl == FA4:
        bounds = (p.max_seqlen_q, p.max_seqlen_k) if varlen else (None, None)
        args = (p.scale, p.softcap, p.window_left, p.window_right, cu_q, cu_k, *bounds)
        grads = _grads_like(q, k, v)
        return attention_fa4.backward(
            op, dout, dlse, q, k, v, out, lse, *args, deterministic=p.deterministic, grads=grads
        )
    if dout is None:  # only lse was used
        dout = out.new_zeros(out.shape)
    backend = kp_core.choose_backend(op, q)
    if backend == kp_core.REFERENCE:
        kp_core.reference(op)
        grads = _reference_backward(dout, dlse, q, k, v, mask, alibi, seed, cu_q, cu_k, p)
        return tuple(_like(g, layout) for g, layout in zip(grads, (q, k, v)))
    if dlse is not None:  # the kernels read dlse in lse's layout
        dlse = dlse.to(torch.float32).contiguous()
    dq, dk, dv = _grads_like(q, k, v)
    lse = lse.contiguous()
    ieee = q.dtype == torch.float32
    exact = exact_delta(q.dtype, d)
    # the fp32 path's delta is subtracted from fp64 dP (attention_bwd_kernels._attn_bwd_dq): kept in fp64
    delta = torch.empty_like(lse, dtype=torch.float64 if ieee else torch.float32)
    # and its lse, corrected by _attn_bwd_dq so each row's P sums to 1 (the dK/dV kernel reads that one)
    lse_fix = torch.empty_like(lse, dtype=torch.float64) if ieee else lse
    lse_strides = _lse_strides(lse, varlen)
    cu_qa, cu_ka = (cu_q, cu_k) if varlen else (lse, lse)
    block_d = block_dim(d)
    pre = launch_tiles("_attn_bwd_preprocess", block_d, q.element_size(), q.device)
    kp_core.launch(
        op,
        backend,
        bwd_kernels._attn_bwd_preprocess,
        (kp_core.cdiv(sq, pre["block_m"]), hq, b),
        (
            out,
            dout,
            lse if dlse is None else dlse,
            delta,
            cu_qa,
            *_bshd(out, varlen),
            *_bshd(dout, varlen),
            *lse_strides,
            sq,
        ),
        dict(
            HEAD_DIM=d,
            BLOCK_M=pre["block_m"],
            BLOCK_D=block_d,
            VARLEN=varlen,
            HAS_DLSE=dlse is not None,
            ROWSUM=not (ieee or exact),
        ),
        pre["num_warps"],
    )
    m, m_strides, mask_kind = _mask_args(mask, alibi, b, hq, sq, sk, q.dtype)
    m = lse if m is None else m
    scalars = (sq, sk, hq // hkv, p.scale, *_score_args(p, q.dtype), p.window_left, p.window_right, *_dropout_args(p))
    seed = lse if seed is None else seed
    strides_qkv = (*_bshd(q, varlen), *_bshd(k, varlen), *_bshd(v, varlen), *_bshd(dout, varlen))

    def launch_dkdv():
        tiles = launch_tiles("_attn_bwd_dkdv", block_d, q.element_size(), q.device)
        kp_core.launch(
            op,
            backend,
            bwd_kernels._attn_bwd_dkdv,
            (kp_core.cdiv(sk, tiles["block_n"]), hkv, b),
            (
                q,
                k,
                v,
                dout,
                lse_fix,
                delta,
                m,
                seed,
                dk,
                dv,
                cu_qa,
                cu_ka,
                *strides_qkv,
                *_bshd(dk, varlen),
                *_bshd(dv, varlen),
                *lse_strides,
                *m_strides,
                *scalars,
            ),
            _switches(p, d, varlen, mask_kind, q.dtype, tiles),
            tiles["num_warps"],
            tiles["num_stages"],
        )

    def launch_dq():
        tiles = launch_tiles("_attn_bwd_dq", block_d, q.element_size(), q.device)
        kp_core.launch(
            op,
            backend,
            bwd_kernels._attn_bwd_dq,
            (kp_core.cdiv(sq, tiles["block_m"]), hq, b),
            (
                q,
                k,
                v,
                dout,
                lse,
                delta,
                lse_fix,
                m,
                seed,
                dq,
                cu_qa,
                cu_ka,
                *strides_qkv,
                *_bshd(dq, varlen),
                *lse_strides,
                *m_strides,
                *scalars,
            ),
            {**_switches(p, d, varlen, mask_kind, q.dtype, tiles), "EXACT_DELTA": exact},
            tiles["num_warps"],
            tiles["num_stages"],
        )

    # The dQ kernel computes delta (sum_j P_ij dP_ij) for the dK/dV kernel on the fp32 and exact-delta paths: it goes
    # first there.
    for launch in (launch_dq, launch_dkdv) if ieee or exact else (launch_dkdv, launch_dq):
        launch()
    return dq, dk, dv


# ---- declarations ----


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    dropout_seed: Optional[torch.Tensor],
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    dropout_p: float,
    impl: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), lse (B, Hq, Sq); attn_mask broadcasts to (B, Hq, Sq, Sk);
    alibi_slopes fp32 (Hq,) or (B, Hq), not with attn_mask; dropout_p > 0 with dropout_seed (int64 (1,),
    kp_attention.ops.dropout.draw_seed); impl "triton" or "fa4" (attention_fa4.IMPLS); deterministic: FlashAttention-4's
    backward without atomics (kp's never has any)."""
    p = Params(
        scale,
        softcap,
        window_left,
        window_right,
        bottom_right,
        dropout_p=dropout_p,
        impl=impl,
        deterministic=deterministic,
    )
    return _forward(OP, q, k, v, attn_mask, alibi_slopes, dropout_seed, None, None, p)


def backward(
    dout: Optional[torch.Tensor],
    dlse: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    dropout_seed: Optional[torch.Tensor],
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    dropout_p: float,
    impl: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = Params(
        scale,
        softcap,
        window_left,
        window_right,
        bottom_right,
        dropout_p=dropout_p,
        impl=impl,
        deterministic=deterministic,
    )
    return _backward(OP_BWD, dout, dlse, q, k, v, out, lse, attn_mask, alibi_slopes, dropout_seed, None, None, p)


def forward_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    dropout_seed: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
    dropout_p: float,
    impl: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): packed q (total_q, Hq, D), k/v (total_k, Hkv, D), lse (Hq, total_q); alibi_slopes fp32 (Hq,)
    or (batch, Hq); dropout as in forward (sequence b numbered as batch b); with block_table (batch, pages) int32,
    k/v are (num_blocks, page, Hkv, D) pages (forward only); impl and deterministic as in forward."""
    p = Params(
        scale, softcap, window_left, window_right, True, max_seqlen_q, max_seqlen_k, dropout_p, impl, deterministic
    )
    cu = (cu_seqlens_q, cu_seqlens_k)
    return _forward(OP_VARLEN, q, k, v, None, alibi_slopes, dropout_seed, *cu, p, block_table)


def backward_varlen(
    dout: Optional[torch.Tensor],
    dlse: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    dropout_seed: Optional[torch.Tensor],
    block_table: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
    dropout_p: float,
    impl: str,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if block_table is not None:
        raise NotImplementedError(f"{OP_VARLEN}: paged k/v (block_table) has no backward (as FlashAttention's)")
    p = Params(
        scale, softcap, window_left, window_right, True, max_seqlen_q, max_seqlen_k, dropout_p, impl, deterministic
    )
    cu = (cu_seqlens_q, cu_seqlens_k)
    return _backward(OP_VARLEN_BWD, dout, dlse, q, k, v, out, lse, None, alibi_slopes, dropout_seed, *cu, p)


def _grads_like(*tensors) -> tuple:
    """The gradients' buffers, in the real and the fake backward alike (the strides torch.compile plans with)."""
    return tuple(torch.empty_like(t) for t in tensors)


def _like(g: torch.Tensor, layout: torch.Tensor) -> torch.Tensor:
    return g if g.stride() == layout.stride() else torch.empty_like(layout).copy_(g)


def _forward_fake(q, k, v, *rest):
    return q.new_empty(q.shape), _lse_empty(q, q.shape[0], q.shape[2], q.shape[1], False)


def _forward_varlen_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, dropout_seed, block_table, max_seqlen_q, *rest
):
    return q.new_empty(q.shape), _lse_empty(q, cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q, True)


FLASH = kp_core.op(
    OP,
    forward,
    _forward_fake,
    backward=backward,
    backward_fake=lambda dout, dlse, q, k, v, *rest: _grads_like(q, k, v),
    save=lambda args, outputs: (*args[:3], *outputs, *args[3:6]),  # q, k, v, out, lse, mask, alibi, dropout seed
    grad_inputs=("q", "k", "v"),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)

FLASH_VARLEN = kp_core.op(
    OP_VARLEN,
    forward_varlen,
    _forward_varlen_fake,
    backward=backward_varlen,
    backward_fake=lambda dout, dlse, q, k, v, *rest: _grads_like(q, k, v),
    save=lambda args, outputs: (*args[:3], *outputs, *args[3:8]),  # q, k, v, out, lse, cu_q/k, alibi, seed, pages
    grad_inputs=("q", "k", "v"),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d) if d > 0 else 1.0
