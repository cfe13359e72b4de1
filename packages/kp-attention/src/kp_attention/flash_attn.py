"""FlashAttention 2's public functions with its signatures and return conventions, on kp's kernels:

    import kp_attention.flash_attn as flash_attn
    out = flash_attn.flash_attn_func(q, k, v, causal=True)

Each function takes FlashAttention's arguments in FlashAttention's order and with its defaults (note
`flash_attn_with_kvcache`'s `causal=False`, where kp's own `flash_attention_with_kvcache` defaults to True) and
returns what it returns: `out`, or with `return_attn_probs=True` the triple `(out, softmax_lse, S_dmask)`, where
S_dmask is None as FlashAttention's is without dropout, and with dropout, for tests as FlashAttention's, the
unnormalised probabilities exp(s - row max) of shape (batch, heads, seqlen_q, seqlen_k) (the varlen functions:
max_seqlen_q, max_seqlen_k, each sequence at the top left), negative where dropout dropped them (computed in PyTorch
from the call's inputs and its dropout seed, not by the kernel). softmax_lse is (batch, heads, seqlen), or (heads,
total_q) for the varlen functions. The packed forms read q, k and v as views of qkv / kv (no copy); their gradients
reach the packed tensor.

Supported here as in FlashAttention: causal (bottom-right), window_size, softcap, alibi_slopes, GQA/MQA,
deterministic (kp's backward is always deterministic), dropout (kp_attention.ops.dropout: Philox, seeded from
torch's generator per call, the same mask again in the backward), varlen, paged KV caches (block_table) and new
tokens appended in place in flash_attn_with_kvcache, rotary embedding there (rotary_cos / rotary_sin, interleaved or
not; applied with PyTorch ops before the kernel), and cache_batch_idx (the cache read as one page per sequence, so
new tokens still land in the cache itself), cache_leftpad (rotary positions stay the cache rows, as
FlashAttention's: a token at row r turns by angle r), and paged k/v in
flash_attn_varlen_func (block_table; forward only, as FlashAttention's).

Every function also takes a keyword `backend` (not FlashAttention's): "auto" (the default), "kp", "torch" or
"fa4", as kp_attention.flash_attention's (kp_attention.backend).
"""

from typing import Optional, Union

import torch

from kp_attention.functional import flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from kp_attention.ops import attention, decode, dropout

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _seed(q, dropout_p) -> Optional[torch.Tensor]:
    """This call's dropout seed (kept for S_dmask); the functions below check dropout_p's value."""
    ok = isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and 0 < dropout_p <= 1
    return dropout.draw_seed(q.device) if ok and isinstance(q, torch.Tensor) else None


def _signed_probs(q, k, seed, dropout_p, scale, causal, window, softcap, alibi, first_batch: int) -> torch.Tensor:
    """S_dmask (see the module docstring) of dense (B, S, H, D) q and k."""
    left, right = window
    p = attention.Params(
        attention.default_scale(q.shape[-1]) if scale is None else float(scale),
        float(softcap),
        int(left),
        0 if causal else int(right),
        dropout_p=float(dropout_p),
    )
    return attention.signed_exp_scores(q, k, alibi, seed, first_batch, p).to(q.dtype)


def _dense(
    fn, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, probs, backend
):
    seed = _seed(q, dropout_p)
    result = flash_attention(
        q,
        k,
        v,
        causal=causal,
        window=window_size,
        softcap=softcap,
        scale=softmax_scale,
        alibi_slopes=alibi_slopes,
        dropout_p=dropout_p,
        dropout_seed=seed,
        return_lse=probs,  # without lse torch's fused SDPA may take the call (backend "auto")
        deterministic=deterministic,
        backend=backend,
    )
    if not probs:
        return result
    out, lse = result
    if seed is None:
        return out, lse, None
    with torch.no_grad():
        s_dmask = _signed_probs(q, k, seed, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, 0)
    return out, lse, s_dmask


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend="auto",
):
    """q (batch, seqlen_q, heads, headdim), k and v (batch, seqlen_k, heads_k, headdim).

    float16, bfloat16 or float32, one dtype and device; heads a multiple of heads_k; headdim up to 256. Returns
    out (batch, seqlen_q, heads, headdim) in q's dtype, or with return_attn_probs (out, softmax_lse (batch, heads,
    seqlen_q) float32, S_dmask) (see the module docstring).

    Examples:
        >>> import torch
        >>> import kp_attention.flash_attn as flash_attn
        >>> q, k, v = torch.randn(2, 64, 8, 32), torch.randn(2, 64, 2, 32), torch.randn(2, 64, 2, 32)
        >>> flash_attn.flash_attn_func(q, k, v, causal=True).shape
        torch.Size([2, 64, 8, 32])
        >>> out, lse, s_dmask = flash_attn.flash_attn_func(q, k, v, return_attn_probs=True)
        >>> lse.shape, s_dmask is None  # no dropout: no S_dmask, as FlashAttention's
        (torch.Size([2, 8, 64]), True)
    """
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    return _dense("flash_attn_func", q, k, v, *args, backend)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend="auto",
):
    """q (batch, seqlen_q, heads, headdim), kv (batch, seqlen_k, 2, heads_k, headdim).

    Dtypes, heads and the result as in flash_attn_func; k and v are read as views of kv.

    Examples:
        >>> import torch
        >>> import kp_attention.flash_attn as flash_attn
        >>> q, kv = torch.randn(2, 64, 8, 32), torch.randn(2, 64, 2, 2, 32)
        >>> flash_attn.flash_attn_kvpacked_func(q, kv, causal=True).shape
        torch.Size([2, 64, 8, 32])
    """
    _packed("flash_attn_kvpacked_func", "kv", kv, 5, 2)
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    return _dense("flash_attn_kvpacked_func", q, kv[:, :, 0], kv[:, :, 1], *args, backend)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend="auto",
):
    """qkv (batch, seqlen, 3, heads, headdim).

    Dtypes and the result as in flash_attn_func; q, k and v are read as views of qkv, and their gradients reach it.

    Examples:
        >>> import torch
        >>> import kp_attention.flash_attn as flash_attn
        >>> qkv = torch.randn(2, 64, 3, 4, 32, requires_grad=True)
        >>> out = flash_attn.flash_attn_qkvpacked_func(qkv, causal=True)
        >>> out.sum().backward()
        >>> out.shape, qkv.grad.shape
        (torch.Size([2, 64, 4, 32]), torch.Size([2, 64, 3, 4, 32]))
    """
    _packed("flash_attn_qkvpacked_func", "qkv", qkv, 5, 3)
    q, k, v = qkv.unbind(2)
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    return _dense("flash_attn_qkvpacked_func", q, k, v, *args, backend)


def _packed(fn: str, name: str, t, ndim: int, parts: int) -> None:
    """A packed tensor: `ndim` dims, `parts` (2: kv, 3: qkv) at dim -3."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kp_attention.flash_attn.{fn}: {name} must be a tensor, got {type(t).__name__}")
    if t.dim() != ndim or t.shape[-3] != parts:
        raise ValueError(
            f"kp_attention.flash_attn.{fn}: {name} must have {ndim} dims with {parts} at dim -3, got shape "
            f"{tuple(t.shape)}"
        )


def _varlen(
    fn, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap, alibi, det, probs, pages, backend
):
    seed = _seed(q, dropout_p)
    out, lse = flash_attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        causal=causal,
        window=window,
        softcap=softcap,
        scale=scale,
        alibi_slopes=alibi,
        dropout_p=dropout_p,
        dropout_seed=seed,
        block_table=pages,
        return_lse=True,
        deterministic=det,
        backend=backend,
    )
    if not probs:
        return out
    if seed is None:
        return out, lse, None
    if pages is not None:
        k = attention._unpage(k, cu_k, pages)
    s_dmask = q.new_zeros((cu_q.shape[0] - 1, q.shape[1], max_q, max_k))
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    with torch.no_grad():
        for b in range(len(bounds_q) - 1):
            qb, kb = q[None, bounds_q[b] : bounds_q[b + 1]], k[None, bounds_k[b] : bounds_k[b + 1]]
            slopes = alibi[b : b + 1] if alibi is not None and alibi.dim() == 2 else alibi
            part = _signed_probs(qb, kb, seed, dropout_p, scale, causal, window, softcap, slopes, b)
            s_dmask[b, :, : qb.shape[1], : kb.shape[1]] = part[0]
    return out, lse, s_dmask


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    backend="auto",
):
    """Packed q (total_q, heads, headdim), k and v (total_k, heads_k, headdim); cu_seqlens int32 (batch + 1,).

    float16, bfloat16 or float32; sequence b is rows cu_seqlens[b]:cu_seqlens[b + 1]. block_table (int32, batch x
    pages) reads k and v as a paged cache (num_blocks, page, heads_k, headdim), forward only. Returns out
    (total_q, heads, headdim), or with return_attn_probs (out, softmax_lse (heads, total_q), S_dmask).

    Examples:
        >>> import torch
        >>> import kp_attention.flash_attn as flash_attn
        >>> q, k, v = torch.randn(16, 4, 32), torch.randn(16, 4, 32), torch.randn(16, 4, 32)
        >>> cu = torch.tensor([0, 5, 16], dtype=torch.int32)  # two sequences: 5 and 11 tokens
        >>> flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True).shape
        torch.Size([16, 4, 32])
    """
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    cu = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _varlen("flash_attn_varlen_func", q, k, v, *cu, *args, block_table, backend)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend="auto",
):
    """q (total_q, heads, headdim), kv (total_k, 2, heads_k, headdim).

    Dtypes, cu_seqlens and the result as in flash_attn_varlen_func; k and v are read as views of kv.

    Examples:
        >>> import torch
        >>> import kp_attention.flash_attn as flash_attn
        >>> q, kv = torch.randn(16, 4, 32), torch.randn(16, 2, 4, 32)
        >>> cu = torch.tensor([0, 5, 16], dtype=torch.int32)
        >>> flash_attn.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 11, 11).shape
        torch.Size([16, 4, 32])
    """
    fn = "flash_attn_varlen_kvpacked_func"
    _packed(fn, "kv", kv, 4, 2)
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    cu = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _varlen(fn, q, kv[:, 0], kv[:, 1], *cu, *args, None, backend)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend="auto",
):
    """qkv (total, 3, heads, headdim); one cu_seqlens and max_seqlen for queries and keys.

    Dtypes and the result as in flash_attn_varlen_func; q, k and v are read as views of qkv.

    Examples:
        >>> import torch
        >>> import kp_attention.flash_attn as flash_attn
        >>> qkv = torch.randn(16, 3, 4, 32)
        >>> cu = torch.tensor([0, 5, 16], dtype=torch.int32)
        >>> flash_attn.flash_attn_varlen_qkvpacked_func(qkv, cu, 11, causal=True).shape
        torch.Size([16, 4, 32])
    """
    fn = "flash_attn_varlen_qkvpacked_func"
    _packed(fn, "qkv", qkv, 4, 3)
    q, k, v = qkv.unbind(1)
    args = (dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)
    return _varlen(fn, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, *args, None, backend)


# ---- KV-cache decoding ----

KV_FN = "flash_attn_with_kvcache"


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, interleaved: bool):
    """x (B, S, H, D) with its first rotary_dim = 2 * cos.shape[1] dims rotated at positions (B, S): GPT-NeoX halves
    (interleaved=False) or pairs (0, 1), (2, 3), ... (interleaved=True); computed in fp32, rounded once to x's
    dtype, as FlashAttention's rotary kernel does."""
    half = cos.shape[1]
    positions = positions.clamp(0, cos.shape[0] - 1)  # never an out-of-bounds read (the caller checks values)
    c = cos.float()[positions][:, :, None]  # (B, S, 1, half)
    s = sin.float()[positions][:, :, None]
    xf = x.float()
    rot = xf[..., : 2 * half]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot, xf[..., 2 * half :]), dim=-1).to(x.dtype)


def _check_rotary(q, k, cos, sin) -> None:
    if (cos is None) != (sin is None):
        raise ValueError(f"kp_attention.flash_attn.{KV_FN}: rotary_cos and rotary_sin must be given together")
    if k is None:
        raise ValueError(f"kp_attention.flash_attn.{KV_FN}: rotary_cos/rotary_sin need the new tokens k and v")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise TypeError(
                f"kp_attention.flash_attn.{KV_FN}: {name} must be a 2-D float tensor (seqlen_ro, rotary_dim / 2)"
            )
        if t.device != q.device:
            raise ValueError(f"kp_attention.flash_attn.{KV_FN}: {name} is on {t.device}, q on {q.device}")
    if cos.shape != sin.shape or 2 * cos.shape[1] > q.shape[-1]:
        raise ValueError(
            f"kp_attention.flash_attn.{KV_FN}: rotary_cos and rotary_sin must share a shape (seqlen_ro, rotary_dim / 2)"
            f" with rotary_dim <= head dim {q.shape[-1]}, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )


def _check_rotary_reach(start: torch.Tensor, steps: int, rows: int) -> None:
    """Positions start + 0 .. steps - 1 within rotary_cos's rows (they are clamped regardless). With
    kp_attention.ops.decode.VALIDATE_VALUES = "sync": one host sync, ValueError here; by default the cache's
    bad-input flag is set on the device, reported as the cache's values are (decode.check_inputs)."""
    if not decode.VALIDATE_VALUES or start.numel() == 0 or torch.compiler.is_compiling():
        return
    if start.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if decode.VALIDATE_VALUES != "sync":
        flag = decode._flag(start.device).device
        flag.copy_(torch.maximum(flag, (start.max() + steps > rows).to(flag.dtype)))
        return
    last = int(start.max()) + steps - 1
    if last >= rows:
        raise ValueError(
            f"kp_attention.flash_attn.{KV_FN}: rotary_cos/rotary_sin have {rows} rows but positions reach {last} "
            "(cache_seqlens plus the new tokens)"
        )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: Optional[Union[int, torch.Tensor]] = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    backend="auto",
):
    """FlashAttention's incremental decoding call (inference only): k and v, when given, are written into the cache
    in place at cache_seqlens (which is not changed) before attending; see the module docstring.

    q (batch, seqlen_q, heads, headdim); k_cache / v_cache (batch_cache, seqlen_cache, heads_k, headdim), or paged
    (num_blocks, page, heads_k, headdim) with block_table int32 (batch, pages); k / v (batch, seqlen_new, heads_k,
    headdim), all float16, bfloat16 or float32 alike; cache_seqlens an int or int32 (batch,); rotary_cos /
    rotary_sin (seqlen_ro, rotary_dim / 2), a float dtype. Note causal defaults to False, as in FlashAttention.
    Returns out (batch, seqlen_q, heads, headdim), and with return_softmax_lse also the lse (batch, heads,
    seqlen_q) float32.

    Examples:
        >>> import torch
        >>> import kp_attention.flash_attn as flash_attn
        >>> k_cache, v_cache = torch.zeros(2, 64, 2, 32), torch.zeros(2, 64, 2, 32)
        >>> q, k, v = torch.randn(2, 1, 4, 32), torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
        >>> lengths = torch.tensor([5, 9], dtype=torch.int32)
        >>> out = flash_attn.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)
        >>> out.shape, torch.equal(v_cache[0, 5], v[0, 0])
        (torch.Size([2, 1, 4, 32]), True)
    """
    if not isinstance(q, torch.Tensor) or not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"kp_attention.flash_attn.{KV_FN}: q and k_cache must be tensors")
    window_size = attention.window_pair(window_size)
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError(f"kp_attention.flash_attn.{KV_FN}: cache_batch_idx cannot be used with block_table")
        if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dtype != torch.int32:
            raise TypeError(f"kp_attention.flash_attn.{KV_FN}: cache_batch_idx must be an int32 tensor (batch,)")
        if cache_batch_idx.dim() != 1:
            raise ValueError(
                f"kp_attention.flash_attn.{KV_FN}: cache_batch_idx must be 1-D (batch,), got shape "
                f"{tuple(cache_batch_idx.shape)}"
            )
        # each cache row is one page of a paged cache: sequence b reads and appends to row cache_batch_idx[b]
        block_table = cache_batch_idx.reshape(-1, 1)
    if cache_seqlens is None:  # the whole cache
        cache_seqlens = k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])
    if rotary_cos is not None or rotary_sin is not None:
        _check_rotary(q, k, rotary_cos, rotary_sin)
        start = cache_seqlens
        if not isinstance(start, torch.Tensor):
            start = torch.full((q.shape[0],), start, device=q.device)
        start = start.long()[:, None]
        _check_rotary_reach(start, max(k.shape[1], q.shape[1]), rotary_cos.shape[0])
        steps_k = torch.arange(k.shape[1], device=q.device)
        k = _rotate(k, rotary_cos, rotary_sin, start + steps_k, rotary_interleaved)
        # causal or local: query i sits at cache_seqlens + i; otherwise every query at cache_seqlens
        local = causal or tuple(window_size) != (-1, -1)
        steps_q = torch.arange(q.shape[1], device=q.device) * int(local)
        q = _rotate(q, rotary_cos, rotary_sin, start + steps_q, rotary_interleaved)
    return flash_attention_with_kvcache(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        k=k,
        v=v,
        block_table=block_table,
        causal=causal,
        window=tuple(window_size),
        softcap=softcap,
        scale=softmax_scale,
        alibi_slopes=alibi_slopes,
        cache_leftpad=cache_leftpad,
        num_splits=num_splits,
        return_lse=return_softmax_lse,
        backend=backend,
    )
