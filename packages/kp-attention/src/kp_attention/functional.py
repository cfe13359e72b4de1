"""kp-attention's public functions: FlashAttention's and torch's signatures, argument checks, then the ops.

flash_attention and scaled_dot_product_attention run kp::flash_attention, flash_attention_varlen runs
kp::flash_attention_varlen (kp_attention.ops.attention); flash_attention_with_kvcache runs
kp::flash_attention_with_kvcache (kp_attention.ops.decode).
"""

import math
from typing import Optional, Union

import torch

import kp_core
from kp_attention import backend as backends
from kp_attention.ops import attention_fa4, dropout
from kp_attention.ops.attention import (
    DTYPES,
    FA4,
    FLASH,
    FLASH_VARLEN,
    MAX_HEAD_DIM,
    TRITON,
    Params,
    default_scale,
    window_pair,
)
from kp_attention.ops.decode import KVCACHE, PAGE_MULTIPLE

KV_FN = "kp_attention.flash_attention_with_kvcache"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_qkv(op: str, q, k, v, ndim: int, layout: str, names=("q", "k", "v"), kv_layout: Optional[tuple] = None):
    """Tensors, dtypes, devices, ndim, head dims, k/v shapes and head divisibility (heads at dim -2). kv_layout:
    (ndim, layout) of k and v where it differs from q's (paged caches)."""
    nq, nk, nv = names
    for name, t in zip(names, (q, k, v)):
        kp_core.check_tensor(op, name, t, dtypes=DTYPES)
    kp_core.check_same_dtype(op, nk, k, q, nq)
    kp_core.check_same_dtype(op, nv, v, q, nq)
    kp_core.check_same_device(op, **{nq: q, nk: k, nv: v})
    kv_ndim, kv_layout = kv_layout or (ndim, layout)
    for name, t, n, form in zip(names, (q, k, v), (ndim, kv_ndim, kv_ndim), (layout, kv_layout, kv_layout)):
        if t.dim() != n:
            raise ValueError(f"{op}: {name} must have {n} dimensions {form}, got shape {tuple(t.shape)}")
    d = q.shape[-1]
    for name, t in ((nk, k), (nv, v)):
        if t.shape[-1] != d:
            raise ValueError(f"{op}: head dims differ: {nq} has {d}, {name} has {t.shape[-1]}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head dim of {nq} must be between 1 and {MAX_HEAD_DIM}, got {d}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"{op}: {nk} and {nv} must agree in batch, seqlen and heads, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{op}: {nq}'s heads ({hq}) must be a multiple of {nk}/{nv}'s heads ({hkv})")


def _check_alibi(op: str, alibi_slopes, batch: int, heads: int, q: torch.Tensor) -> None:
    """FlashAttention's alibi_slopes: None, or fp32 of shape (heads,) or (batch, heads) on q's device."""
    if alibi_slopes is None:
        return
    kp_core.check_tensor(op, "alibi_slopes", alibi_slopes, dtypes=(torch.float32,))
    kp_core.check_same_device(op, q=q, alibi_slopes=alibi_slopes)
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"{op}: alibi_slopes must have shape ({heads},) or ({batch}, {heads}) (q heads; batch, q heads), got "
            f"{tuple(alibi_slopes.shape)}"
        )


def _dropout_seed(op: str, dropout_p, dropout_seed, q: torch.Tensor) -> Optional[torch.Tensor]:
    """The seed of this call's dropout (None without dropout): the one given, or one drawn from torch's generator."""
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{op}: dropout_p must be a number in [0, 1], got {dropout_p!r}")
    if dropout_seed is not None:
        kp_core.check_tensor(op, "dropout_seed", dropout_seed, dtypes=(torch.int64,))
        kp_core.check_same_device(op, q=q, dropout_seed=dropout_seed)
        if dropout_seed.numel() != 1:
            raise ValueError(f"{op}: dropout_seed must hold one value, got shape {tuple(dropout_seed.shape)}")
    if dropout_p == 0:
        return None
    return dropout.draw_seed(q.device) if dropout_seed is None else dropout_seed.reshape(1)


def _check_options(op: str, causal, window, softcap, scale, d: int) -> Params:
    kp_core.check_bool(op, "causal", causal)
    window = window_pair(window)
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(_is_int(w) for w in window)):
        raise ValueError(f"{op}: window must be a pair of ints (left, right), got {window!r}")
    left, right = window
    if left < -1 or right < -1:
        raise ValueError(f"{op}: window values must be >= -1 (-1 = unbounded), got {tuple(window)}")
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not (0 <= softcap < math.inf):
        raise ValueError(f"{op}: softcap must be a finite number >= 0, got {softcap!r}")
    if scale is not None and (
        not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale)
    ):
        raise ValueError(f"{op}: scale must be a finite number or None, got {scale!r}")
    if causal:
        right = 0  # as FlashAttention: causal is a window with right = 0
    return Params(float(default_scale(d) if scale is None else scale), float(softcap), int(left), int(right), True)


def _check_sink(op: str, sink, heads: int, q: torch.Tensor) -> None:
    """learnable_sink: None, or a float (Hq,) tensor on q's device."""
    if sink is None:
        return
    kp_core.check_tensor(op, "learnable_sink", sink, dtypes=(torch.float16, torch.bfloat16, torch.float32), ndim=1)
    kp_core.check_same_device(op, q=q, learnable_sink=sink)
    if sink.shape[0] != heads:
        raise ValueError(f"{op}: learnable_sink must have shape ({heads},) (q heads), got {tuple(sink.shape)}")


def _with_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor, heads_dim: int):
    """(out, lse) of attention whose softmax also counts one sink logit per head (gpt-oss' learnable sinks): the
    sink adds exp(sink) to each row's sum, so lse' = logaddexp(lse, sink) and out' = out * exp(lse - lse'). lse is
    (B, H, Sq) (heads_dim 1) or (H, total) (heads_dim 0); out has its heads at dim -2. Differentiable in all three;
    a row that sees no key gives 0 and lse' = sink."""
    shape = [1] * lse.dim()
    shape[heads_dim] = -1
    total = torch.logaddexp(lse, sink.float().view(shape))
    weight = torch.exp(lse - total)  # (..., H, S) -> out's (..., S, H, 1)
    weight = weight.movedim(heads_dim, -1).unsqueeze(-1)
    return (out.float() * weight).to(out.dtype), total


def _training(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _randn_like(tensors, training: bool) -> tuple:
    """Fresh N(0, 1) tensors of these shapes and dtypes (a backend's measurement), requiring grad when training."""
    g = torch.Generator(device=tensors[0].device).manual_seed(0)
    return tuple(
        torch.randn(t.shape, generator=g, device=t.device, dtype=t.dtype).requires_grad_(training) for t in tensors
    )


def _route_dense(op, backend, q, k, v, p: Params, *, mask, alibi, lse, dropout, deterministic, top_left, refuse):
    """The implementation of a dense call (kp_attention.backend.route): "kp", "fa4" or a torch kernel. refuse:
    why torch cannot take it beyond torch_refuses, or None."""
    training = _training(q, k, v)
    window = (p.window_left, p.window_right)
    causal = window == (-1, 0)
    flags = (alibi is None, mask is None, dropout, lse, top_left, deterministic, refuse)
    key = (q.shape, k.shape, v.shape, q.dtype, window, p.softcap, p.scale, p.bottom_right, *flags)

    def describe():
        options = dict(softcap=p.softcap, alibi=alibi, mask=mask, lse=lse, dropout=dropout, top_left=top_left)
        det = deterministic and training
        refused = {
            backends.TORCH: refuse
            or backends.torch_refuses(q, k, causal=causal, window=window, deterministic=det, **options),
            backends.FA4: attention_fa4.refuses(
                q,
                k,
                v,
                alibi=alibi is not None,
                mask=mask is not None,
                dropout=dropout,
                top_left=top_left,
                causal=window != (-1, -1),
            ),
        }
        if causal and q.shape[1] != k.shape[1]:  # top-left (else refused above): cuDNN takes it, FA2 does not
            refused["torch:flash"] = "causal with Sq != Sk (torch's FlashAttention-2 kernel needs Sq = Sk for it)"
        features = dict(dtype=q.dtype, head_dim=q.shape[-1], window=window, softcap=p.softcap, training=training)

        def run(name, q, k, v):
            if name.startswith(backends.TORCH):
                return backends.torch_attention(q, k, v, causal=causal, scale=p.scale, kernel=name)
            impl = FA4 if name == backends.FA4 else TRITON
            args = (p.scale, p.softcap, p.window_left, p.window_right, p.bottom_right, p.dropout_p, impl, deterministic)
            return FLASH(q, k, v, None, alibi, None, *args)[0]

        return refused, features, lambda: _randn_like((q, k, v), training), run

    return backends.route(op, backend, q.device, key, training, describe)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """FlashAttention's `flash_attn_func`: q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D), any strides.

    Hq must be a multiple of Hkv (GQA/MQA: q head h reads kv head h // (Hq // Hkv)). D from 1 to 256; fp16, bf16
    or fp32 (fp32 is computed with exact fp32 products). scale defaults to 1/sqrt(D).
    Masks are aligned to the bottom-right corner (FlashAttention >= 2.1): with off = Sk - Sq, query i sees key j
    iff  i + off - left <= j <= i + off + right  (window=(left, right), -1 = unbounded; causal=True sets right=0).
    softcap > 0: scores become softcap * tanh(scores / softcap) (Gemma-2), after scaling.
    alibi_slopes: fp32 (Hq,) or (B, Hq); the bias -slope * |i + Sk - Sq - j| is added to the score of query i and
    key j (after scale and softcap), as FlashAttention adds it.
    dropout_p: each probability is dropped with this chance and the rest scaled by 1 / (1 - p), FlashAttention's
    dropout, the same mask again in the backward (kp_attention.ops.dropout); it is drawn from dropout_seed, a
    one-element int64 tensor on q's device, by default drawn from torch's generator for each call (so
    torch.manual_seed reproduces it, and a captured CUDA graph draws anew on each replay).
    Returns out (B, Sq, Hq, D) in q's dtype, and with return_lse=True also lse (B, Hq, Sq) fp32: the natural-log
    logsumexp of the (scaled, softcapped) scores. lse is differentiable. Rows with no visible key (possible when
    Sq > Sk under causal/window masks) give out 0, lse -inf and zero gradients.
    deterministic: a backward without atomic adds (kp's always is; FlashAttention-4's is then run so; torch's
    fused kernels are not chosen).
    learnable_sink: (Hq,) float, one logit per head that joins every row's softmax without a value (gpt-oss'
    attention sinks, FlashAttention-4's learnable_sink): the output is scaled by exp(lse - lse') with
    lse' = logaddexp(lse, sink), the returned lse is lse', and the sink gets a gradient.
    backend: "auto" (per signature the fastest of kp's kernel, PyTorch's fused SDPA and FlashAttention-4 among
    those that can take the call, measured once), "kp", "torch" or "fa4" (ValueError where it cannot take the
    call): kp_attention.backend.

    Examples:
        >>> import torch
        >>> import kp_attention
        >>> q = torch.randn(2, 128, 8, 64)  # (B, Sq, Hq, D)
        >>> k, v = torch.randn(2, 128, 2, 64), torch.randn(2, 128, 2, 64)  # GQA: 2 kv heads
        >>> out, lse = kp_attention.flash_attention(q, k, v, causal=True, return_lse=True)
        >>> out.shape, lse.shape, lse.dtype
        (torch.Size([2, 128, 8, 64]), torch.Size([2, 8, 128]), torch.float32)
        >>> kp_attention.flash_attention(q, k, v, window=(32, 0), softcap=50.0).shape
        torch.Size([2, 128, 8, 64])
    """
    op = "kp_attention.flash_attention"
    backends.check(op, backend)
    _check_qkv(op, q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: batch sizes differ: q has {q.shape[0]}, k/v have {k.shape[0]}")
    p = _check_options(op, causal, window, softcap, scale, q.shape[-1])
    _check_alibi(op, alibi_slopes, q.shape[0], q.shape[2], q)
    _check_sink(op, learnable_sink, q.shape[2], q)
    kp_core.check_bool(op, "deterministic", deterministic)
    seed = _dropout_seed(op, dropout_p, dropout_seed, q)
    sink = learnable_sink is not None
    impl = backends.KP
    backend = kp_core.settings("attention_backend", backend=backend)["backend"]
    if backend != backends.KP:  # kp's kernel needs no look at the call (the default: no host cost added)
        options = dict(mask=None, alibi=alibi_slopes, lse=return_lse or sink, dropout=seed is not None)
        impl = _route_dense(
            op, backend, q, k, v, p, deterministic=deterministic, top_left=False, refuse=None, **options
        )
        if impl.startswith(backends.TORCH):
            return backends.torch_attention(q, k, v, causal=p.window_right == 0, scale=p.scale, kernel=impl)
    args = (p.scale, p.softcap, p.window_left, p.window_right, True, float(dropout_p))
    out, lse = FLASH(q, k, v, None, alibi_slopes, seed, *args, FA4 if impl == backends.FA4 else TRITON, deterministic)
    if sink:
        out, lse = _with_sink(out, lse, learnable_sink, 1)
    return (out, lse) if return_lse else out


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    scale: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    dropout_seed: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """FlashAttention's `flash_attn_varlen_func`: packed q (total_q, Hq, D), k and v (total_k, Hkv, D).

    Sequence b is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v;
    cu_seqlens_* are int32 of shape (batch + 1,), start at 0, are non-decreasing and end at total_*.
    max_seqlen_* must be >= the longest sequence. Masks, softcap, scale, ALiBi (alibi_slopes (Hq,) or
    (batch, Hq)), dropout and GQA as in flash_attention, per sequence (bottom-right aligned; dropout numbers
    sequence b as batch b). lse has shape (Hq, total_q).
    Checked on the host: dtypes, shapes and lengths always; the values of cu_seqlens (start, order, end,
    max_seqlen) in eager mode, which reads them back once (set kp_attention.ops.attention.VALIDATE_CU_SEQLENS = False
    to skip that sync).
    block_table, int32 (batch, pages per sequence): k and v are a paged cache (num_blocks, page, Hkv, D), page a
    multiple of 16; key j of sequence b is slot j % page of page block_table[b, j // page] (cu_seqlens_k still
    gives the lengths). Forward only, as FlashAttention's (NotImplementedError when a gradient is wanted); the
    page ids in use are checked with cu_seqlens' values.
    deterministic, learnable_sink and backend as in flash_attention ("torch" takes no packed sequences).

    Examples:
        Two sequences of 5 and 11 tokens packed into 16 rows:

        >>> import torch
        >>> import kp_attention
        >>> q, k, v = torch.randn(16, 4, 32), torch.randn(16, 4, 32), torch.randn(16, 4, 32)
        >>> cu = torch.tensor([0, 5, 16], dtype=torch.int32)
        >>> out, lse = kp_attention.flash_attention_varlen(q, k, v, cu, cu, 11, 11, causal=True, return_lse=True)
        >>> out.shape, lse.shape
        (torch.Size([16, 4, 32]), torch.Size([4, 16]))
    """
    op = "kp_attention.flash_attention_varlen"
    paged = block_table is not None
    kv_layout = (4, "(num_blocks, page, heads, head_dim)") if paged else None
    _check_qkv(op, q, k, v, 3, "(total, heads, head_dim)", kv_layout=kv_layout)
    if paged:
        kp_core.check_tensor(op, "block_table", block_table, dtypes=(torch.int32,), ndim=2)
        kp_core.check_same_device(op, q=q, block_table=block_table)
        if block_table.shape[0] != cu_seqlens_q.shape[0] - 1:
            raise ValueError(
                f"{op}: block_table must have one row per sequence ({cu_seqlens_q.shape[0] - 1}), got shape "
                f"{tuple(block_table.shape)}"
            )
        if k.shape[1] % PAGE_MULTIPLE != 0:
            raise ValueError(
                f"{op}: the page size of k/v (dim 1) must be a multiple of {PAGE_MULTIPLE}, got {k.shape[1]}"
            )
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise NotImplementedError(f"{op}: paged k/v (block_table) has no backward (as FlashAttention's)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        kp_core.check_tensor(op, name, cu, dtypes=(torch.int32,), ndim=1)
        kp_core.check_same_device(op, q=q, **{name: cu})
        if cu.shape[0] < 1:
            raise ValueError(f"{op}: {name} must have batch + 1 >= 1 entries, got shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"{op}: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    for name, val in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not _is_int(val) or val < 0:
            raise ValueError(f"{op}: {name} must be an int >= 0, got {val!r}")
    p = _check_options(op, causal, window, softcap, scale, q.shape[-1])
    _check_alibi(op, alibi_slopes, cu_seqlens_q.shape[0] - 1, q.shape[1], q)
    _check_sink(op, learnable_sink, q.shape[1], q)
    kp_core.check_bool(op, "deterministic", deterministic)
    backends.check(op, backend)
    seed = _dropout_seed(op, dropout_p, dropout_seed, q)
    # the kernels index these with unit stride
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    table = None if block_table is None else block_table.contiguous()
    scores = (p.scale, p.softcap, p.window_left, p.window_right, float(dropout_p))

    def run(name, q, k, v):
        impl = FA4 if name == backends.FA4 else TRITON
        return FLASH_VARLEN(
            q, k, v, cu_q, cu_k, alibi_slopes, seed, table, max_seqlen_q, max_seqlen_k, *scores, impl, deterministic
        )

    impl = backends.KP
    backend = kp_core.settings("attention_backend", backend=backend)["backend"]
    if backend != backends.KP:
        training = _training(q, k, v)
        window = (p.window_left, p.window_right)
        flags = (alibi_slopes is None, seed is None, table is None, deterministic)
        key = (q.shape, k.shape, q.dtype, window, p.softcap, p.scale, cu_q.shape, max_seqlen_q, max_seqlen_k, *flags)

        def describe():
            refused = {
                backends.TORCH: "packed sequences (torch's fused SDPA takes none)",
                backends.FA4: attention_fa4.refuses(
                    q, k, v, alibi=alibi_slopes is not None, dropout=seed is not None, causal=window != (-1, -1)
                ),
            }
            features = dict(dtype=q.dtype, head_dim=q.shape[-1], window=window, softcap=p.softcap, training=training)
            features["varlen"] = True
            sample = lambda: _randn_like((q, k, v), training)  # noqa: E731
            return refused, features, sample, lambda name, *t: run(name, *t)[0]

        impl = backends.route(op, backend, q.device, key, training, describe)
    out, lse = run(impl, q, k, v)
    if learnable_sink is not None:
        out, lse = _with_sink(out, lse, learnable_sink, 0)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    softcap: float = 0.0,
    backend: str = "auto",
) -> torch.Tensor:
    """Drop-in for `torch.nn.functional.scaled_dot_product_attention`: query (..., L, E), key (..., S, E), value
    (..., S, Ev), any strides, the leading dimensions broadcast against each other as in torch (dim -3 is the heads
    dimension; enable_gqa: query's heads a multiple of key/value's there). The output is (..., L, Ev).

    is_causal is top-left aligned as in torch (`ones(L, S).tril()`). attn_mask: boolean (True = attend) or an
    additive float mask, broadcastable to (..., L, S); it gets no gradient (an attn_mask that requires grad is an
    error). dropout_p > 0: FlashAttention's dropout of the probabilities (see flash_attention; torch draws its mask
    differently, so the values differ from torch's for the same seed). Differences from torch: rows whose keys are
    all masked give 0 (torch gives NaN); a NaN or inf in a key or value that a boolean mask hides does not reach
    the output (torch's math path adds the mask to the scores and gives NaN). The usual (B, H, L, E) inputs are
    read in place (no copies) and give a (B, H, L, E) view of a (B, L, H, E)-contiguous tensor; broadcast batch
    dimensions that cannot be merged into one, and Ev != E (the shorter head dim is zero-padded), cost a copy.
    softcap (keyword only, not torch's): softcap * tanh(s / softcap) of the scaled scores before the mask is
    added, as Hugging Face's eager attention does for Gemma 2.
    backend (keyword only): "auto", "kp", "torch" or "fa4", as in flash_attention (torch's fused kernels and
    FlashAttention-4 take no mask or dropout, nor softcap for torch's). query, key and value: float16, bfloat16 or
    float32, one dtype and device; head dims up to 256.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> import kp_attention
        >>> q, k, v = torch.randn(2, 8, 128, 64), torch.randn(2, 8, 128, 64), torch.randn(2, 8, 128, 64)
        >>> out = kp_attention.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
        True
        >>> mask = torch.rand(128, 128) > 0.2  # True: attend
        >>> kp_attention.scaled_dot_product_attention(q, k, v, attn_mask=mask, softcap=30.0).shape
        torch.Size([2, 8, 128, 64])
    """
    op = "kp_attention.scaled_dot_product_attention"
    backends.check(op, backend)
    if not isinstance(softcap, (int, float)) or isinstance(softcap, bool) or not (0 <= softcap < math.inf):
        raise ValueError(f"{op}: softcap must be a finite float >= 0 (0: off), got {softcap!r}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        kp_core.check_tensor(op, name, t, dtypes=DTYPES)
        if t.dim() < 2:
            raise ValueError(
                f"{op}: {name} must have at least 2 dimensions (..., seqlen, head_dim), got {tuple(t.shape)}"
            )
    kp_core.check_same_dtype(op, "key", key, query, "query")
    kp_core.check_same_dtype(op, "value", value, query, "query")
    kp_core.check_same_device(op, query=query, key=key, value=value)
    e, ev, lq, s = query.shape[-1], value.shape[-1], query.shape[-2], key.shape[-2]
    if key.shape[-1] != e:
        raise ValueError(f"{op}: query and key head dims differ: {e} and {key.shape[-1]}")
    if value.shape[-2] != s:
        raise ValueError(f"{op}: key and value sequence lengths differ: {s} and {value.shape[-2]}")
    for name, dim in (("query/key", e), ("value", ev)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{op}: head dim of {name} must be between 1 and {MAX_HEAD_DIM}, got {dim}")
    seed = _dropout_seed(op, dropout_p, None, query)
    kp_core.check_bool(op, "is_causal", is_causal)
    if is_causal and attn_mask is not None:
        raise ValueError(f"{op}: attn_mask and is_causal=True cannot be set together (as in torch)")
    if scale is not None and (
        not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale)
    ):
        raise ValueError(f"{op}: scale must be a finite number or None, got {scale!r}")
    scale = float(default_scale(e) if scale is None else scale)
    q, k, v, batch, hq, hkv = _sdpa_layout(op, query, key, value, enable_gqa)
    two_d = max(query.dim(), key.dim(), value.dim()) == 2  # _sdpa_layout added a heads dim of 1: dropped again
    mask = None
    if attn_mask is not None:
        # torch's rule: bool, float32, or the query's dtype
        kp_core.check_tensor(op, "attn_mask", attn_mask, dtypes=(torch.bool, torch.float32, query.dtype))
        kp_core.check_same_device(op, query=query, attn_mask=attn_mask)
        if attn_mask.requires_grad:
            raise ValueError(f"{op}: attn_mask requires grad, but gradients w.r.t. the mask are not supported")
        target = (*batch, hq, lq, s)
        try:
            if torch.broadcast_shapes(attn_mask.shape, target) != torch.Size(target):
                raise RuntimeError
        except RuntimeError:
            shown = target[1:] if two_d else target
            raise ValueError(
                f"{op}: attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {shown}"
            ) from None
        mask = attn_mask.expand(target).reshape(q.shape[0], hq, lq, s)  # a view where the batch dims merge
    d = max(e, ev)  # one head dim for the kernel: zeros added to q.k or to v change nothing
    if e < d:
        q, k = torch.nn.functional.pad(q, (0, d - e)), torch.nn.functional.pad(k, (0, d - e))
    if ev < d:
        v = torch.nn.functional.pad(v, (0, d - ev))
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    args = (scale, float(softcap), -1, 0 if is_causal else -1, False, float(dropout_p))
    impl = backends.KP
    backend = kp_core.settings("attention_backend", backend=backend)["backend"]
    if backend != backends.KP:
        p = Params(*args[:5], dropout_p=float(dropout_p))
        options = dict(mask=mask, alibi=None, lse=False, dropout=seed is not None, deterministic=False)
        refuse = "key and value head dims differ" if e != ev else None
        impl = _route_dense(op, backend, qt, kt, vt, p, top_left=True, refuse=refuse, **options)
        if impl.startswith(backends.TORCH):  # on the 4-D views: torch's fused kernels take no other rank
            out = backends.sdpa(q, k, v, impl, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
            out = out.reshape(*batch, hq, lq, ev)
            return out.squeeze(0) if two_d else out
    out = FLASH(qt, kt, vt, mask, None, seed, *args, FA4 if impl == backends.FA4 else TRITON, False)[0]
    out = out.transpose(1, 2)[..., :ev].reshape(*batch, hq, lq, ev)
    return out.squeeze(0) if two_d else out


def _sdpa_layout(op: str, query, key, value, enable_gqa: bool):
    """(q, k, v as (B, H, S, E) views where possible, the broadcast batch shape, q heads, k/v heads): torch's
    broadcasting of the dimensions before (seqlen, head_dim), with dim -3 as the heads."""
    nd = max(3, query.dim(), key.dim(), value.dim())
    q, k, v = (t[(None,) * (nd - t.dim())] for t in (query, key, value))  # leading 1s, as broadcasting reads it
    shapes = f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    try:
        batch = tuple(torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3]))
    except RuntimeError:
        raise ValueError(f"{op}: the batch dimensions of {shapes} do not broadcast") from None
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if enable_gqa:
        if hk != hv or hk == 0 or hq % hk != 0:
            raise ValueError(
                f"{op}: with enable_gqa, key and value need the same heads (dim -3) and query's heads a multiple of "
                f"them; got {shapes}"
            )
        hkv = hk
    elif hk == hv == 1:  # one key/value head broadcast over query's heads: multi-query attention
        hkv = 1
    else:
        try:
            hq = hkv = torch.broadcast_shapes((hq,), (hk,), (hv,))[0]
        except RuntimeError:
            raise ValueError(
                f"{op}: the heads (dim -3) of {shapes} do not broadcast; pass enable_gqa=True for GQA"
            ) from None
    b = math.prod(batch)
    q, k, v = (
        t.expand(*batch, h, *t.shape[-2:]).reshape(b, h, *t.shape[-2:]) for t, h in ((q, hq), (k, hkv), (v, hkv))
    )
    return q, k, v, batch, hq, hkv


# ---- KV-cache decoding ----


def _check_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window, softcap, num_splits):
    """The capacity (keys a sequence can hold) and the number of new tokens."""
    kp_core.check_tensor(KV_FN, "q", q, dtypes=DTYPES, ndim=4)
    kp_core.check_tensor(KV_FN, "k_cache", k_cache, dtypes=DTYPES, ndim=4)
    kp_core.check_tensor(KV_FN, "v_cache", v_cache, dtypes=DTYPES, ndim=4)
    kp_core.check_same_dtype(KV_FN, "k_cache", k_cache, q, "q")
    kp_core.check_same_dtype(KV_FN, "v_cache", v_cache, q, "q")
    if (k is None) != (v is None):
        raise ValueError(
            f"{KV_FN}: k and v (the new tokens) must be given together, got only {'k' if v is None else 'v'}"
        )
    if k is not None:
        kp_core.check_tensor(KV_FN, "k", k, dtypes=DTYPES, ndim=4)
        kp_core.check_tensor(KV_FN, "v", v, dtypes=DTYPES, ndim=4)
        kp_core.check_same_dtype(KV_FN, "k", k, q, "q")
        kp_core.check_same_dtype(KV_FN, "v", v, q, "q")
    if block_table is not None:
        kp_core.check_tensor(KV_FN, "block_table", block_table, dtypes=(torch.int32,), ndim=2)
    if isinstance(cache_seqlens, torch.Tensor):
        kp_core.check_tensor(KV_FN, "cache_seqlens", cache_seqlens, dtypes=(torch.int32,), ndim=1)
    elif isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, int):
        raise TypeError(f"{KV_FN}: cache_seqlens must be an int32 tensor or an int, got {type(cache_seqlens).__name__}")
    kp_core.check_same_device(
        KV_FN,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        k=k,
        v=v,
        block_table=block_table,
        cache_seqlens=cache_seqlens if isinstance(cache_seqlens, torch.Tensor) else None,
    )

    batch, _, hq, d = q.shape
    _, page, hkv, d_k = k_cache.shape
    if d_k != d:
        raise ValueError(
            f"{KV_FN}: k_cache head dim must equal q's ({d}), got {d_k} (k_cache shape {tuple(k_cache.shape)})"
        )
    if d > MAX_HEAD_DIM:
        raise ValueError(f"{KV_FN}: head dim must be at most {MAX_HEAD_DIM}, got {d}")
    kp_core.check_shape(KV_FN, "v_cache", v_cache, k_cache.shape)
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"{KV_FN}: q heads ({hq}) must be a multiple of k_cache heads ({hkv})")
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"{KV_FN}: k_cache batch ({k_cache.shape[0]}) must equal q's batch ({batch})")
        capacity = page
    else:
        if block_table.shape[0] != batch:
            raise ValueError(f"{KV_FN}: block_table batch ({block_table.shape[0]}) must equal q's batch ({batch})")
        if page % PAGE_MULTIPLE != 0 and block_table.shape[1] > 1:
            raise ValueError(
                f"{KV_FN}: paged k_cache block_size (dim 1) must be a multiple of {PAGE_MULTIPLE} where block_table "
                f"has more than one page per sequence, got {page}"
            )
        capacity = block_table.shape[1] * page
    if isinstance(cache_seqlens, torch.Tensor):
        kp_core.check_shape(KV_FN, "cache_seqlens", cache_seqlens, (batch,))
    new = 0
    if k is not None:
        new = k.shape[1]
        kp_core.check_shape(KV_FN, "k", k, (batch, new, hkv, d))
        kp_core.check_shape(KV_FN, "v", v, (batch, new, hkv, d))
        kp_core.check_no_overlap(KV_FN, "k_cache", k_cache, "v_cache", v_cache)  # both get the new tokens
    if not isinstance(cache_seqlens, torch.Tensor) and not 0 <= cache_seqlens <= capacity - new:
        raise ValueError(
            f"{KV_FN}: cache_seqlens ({cache_seqlens}) plus new tokens ({new}) must lie in [0, {capacity}] (the cache)"
        )
    if not (isinstance(window, (tuple, list)) and len(window) == 2 and all(isinstance(w, int) for w in window)):
        raise TypeError(f"{KV_FN}: window must be a pair of ints (left, right), got {window!r}")
    if min(window) < -1:
        raise ValueError(f"{KV_FN}: window sizes must be >= -1 (-1: unbounded), got {tuple(window)}")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        raise ValueError(f"{KV_FN}: softcap must be a float >= 0 (0: off), got {softcap!r}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"{KV_FN}: num_splits must be an int >= 0 (0: auto), got {num_splits!r}")
    return capacity, new


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
    alibi_slopes: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_lse: bool = False,
    learnable_sink: Optional[torch.Tensor] = None,
    backend: str = "auto",
):
    """Attention of a few new queries over a KV cache (FlashAttention's `flash_attn_with_kvcache`), inference only.

    q: (B, Sq, Hq, D), Sq small (1 for decoding). k_cache / v_cache: (B, S_max, Hkv, D), or paged
    (num_blocks, block_size, Hkv, D) with block_table (B, max_blocks_per_seq) int32 (block_size a multiple of 16,
    or any size with one page per sequence).
    cache_seqlens: int32 (B,) or an int, the valid cached tokens per sequence. Hq % Hkv == 0, D <= 256.
    k, v: optional new tokens (B, Sq_new, Hkv, D), written IN PLACE into k_cache / v_cache at positions
    cache_seqlens[b] ... before attending (cache_seqlens itself is not changed); the sequence then has
    cache_seqlens + Sq_new keys. causal aligns the diagonal bottom-right and forces window right = 0;
    window (left, right) bounds the keys about the diagonal (-1: unbounded); softcap c > 0 applies
    c * tanh(s / c) to the scaled scores; scale defaults to 1 / sqrt(D); alibi_slopes fp32 (Hq,) or (B, Hq)
    adds -slope * |i + L - Sq - j| for L keys (after softcap, as FlashAttention); cache_leftpad int32 (B,): the
    cache row each sequence starts at (keys before it are not attended; 0 <= cache_leftpad <= cache_seqlens).
    num_splits: key-length splits
    (flash-decoding), 0 = chosen from the GPU's SM count. Returns out (B, Sq, Hq, D) in q's dtype, and
    with return_lse the fp32 log-sum-exp (B, Hq, Sq). Rows that see no key give 0 (lse -inf).
    q, the caches and k / v: float16, bfloat16 or float32, one dtype and device. learnable_sink as in
    flash_attention. backend as in flash_attention: "torch" takes a call of one query per sequence (or none
    causal), a contiguous cache and cache_seqlens given as an int (its kernels need the length on the host),
    without ALiBi, softcap, window, cache_leftpad or lse; "fa4" one without ALiBi or cache_leftpad, and num_splits
    is not used there (no split-KV on SM 9.0).

    Examples:
        One decoding step: each sequence's new token goes into the cache at its length, then attends to it all.

        >>> import torch
        >>> import kp_attention
        >>> k_cache, v_cache = torch.zeros(2, 64, 2, 32), torch.zeros(2, 64, 2, 32)  # (B, S_max, Hkv, D)
        >>> lengths = torch.tensor([5, 9], dtype=torch.int32)
        >>> q, k, v = torch.randn(2, 1, 4, 32), torch.randn(2, 1, 2, 32), torch.randn(2, 1, 2, 32)
        >>> out = kp_attention.flash_attention_with_kvcache(q, k_cache, v_cache, lengths, k=k, v=v)
        >>> out.shape, torch.equal(k_cache[1, 9], k[1, 0])
        (torch.Size([2, 1, 4, 32]), True)
    """
    window = window_pair(window)
    chosen = kp_core.settings("attention_backend", backend=backend)["backend"]
    signature = None
    compiling = torch.compiler.is_compiling()  # traced: the checks are traced too, nothing kept
    if not compiling and alibi_slopes is None and cache_leftpad is None and learnable_sink is None:
        # a call being captured has a route of its own (backend.route's replayed choice)
        capturing = isinstance(q, torch.Tensor) and backends.capturing(q.device)
        extra = (causal, window, softcap, scale, num_splits, return_lse, backend, chosen, capturing)
        signature = _kv_signature(q, k_cache, v_cache, cache_seqlens, k, v, block_table, extra)
    try:
        known = backends.CALLS.get(signature) if signature is not None else None
    except TypeError:  # an unhashable option: the checks below name it
        known = signature = None
    if known is None:
        backends.check(KV_FN, backend)
        capacity, new = _check_kvcache(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table, window, softcap, num_splits
        )
        _check_alibi(KV_FN, alibi_slopes, q.shape[0], q.shape[2], q)
        _check_sink(KV_FN, learnable_sink, q.shape[2], q)
        if cache_leftpad is not None:
            kp_core.check_tensor(KV_FN, "cache_leftpad", cache_leftpad, dtypes=(torch.int32,), ndim=1)
            kp_core.check_same_device(KV_FN, q=q, cache_leftpad=cache_leftpad)
            kp_core.check_shape(KV_FN, "cache_leftpad", cache_leftpad, (q.shape[0],))
        scale = default_scale(q.shape[-1]) if scale is None else float(scale)
        options = (alibi_slopes, cache_leftpad, bool(causal), int(window[0]), int(window[1]), float(softcap), scale)
        impl = backends.KP
        if chosen != backends.KP:
            lse = return_lse or learnable_sink is not None
            impl = _route_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, chosen, options, lse)
        # kept once routed for good: not while traced, nor while a graph captures (route may defer "auto" then)
        if signature is not None and not capturing:
            if len(backends.CALLS) >= backends.MAX_CALLS:  # caches made per request would grow it unbounded
                backends.CALLS.clear()
            backends.CALLS[signature] = (capacity, new, options, impl)
    else:  # a signature checked before: only an int length's value is new
        capacity, new, options, impl = known
        if not isinstance(cache_seqlens, torch.Tensor) and not 0 <= cache_seqlens <= capacity - new:
            _check_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window, softcap, num_splits)
        scale = options[-1]
    if impl.startswith(backends.TORCH):
        return _torch_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, impl)
    if not isinstance(cache_seqlens, torch.Tensor):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    kernel = FA4 if impl == backends.FA4 else TRITON
    out, lse = KVCACHE(q, k_cache, v_cache, cache_seqlens, k, v, block_table, *options, int(num_splits), kernel)
    if learnable_sink is not None:
        out, lse = _with_sink(out, lse, learnable_sink, 1)
    return (out, lse) if return_lse else out


def _kv_signature(q, k_cache, v_cache, cache_seqlens, k, v, block_table, extra: tuple) -> Optional[tuple]:
    """What _check_kvcache and the route depend on in a call without ALiBi, cache_leftpad or sink (an int length's
    type, not its value), or None where an argument is not what it should be (the checks then say so). extra: the
    options, num_splits fifth."""
    key = [extra, cache_seqlens.__class__, extra[4].__class__]  # num_splits: True == 1 in a key, and is refused
    for t in (q, k_cache, v_cache, k, v, block_table, cache_seqlens):
        if isinstance(t, torch.Tensor):
            key.append((t.shape, t.dtype, t.device))
        elif t is None or t is cache_seqlens:
            key.append(None)
        else:
            return None
    if k is not None:  # the new tokens go into both caches: check_no_overlap's answer depends on where they are
        key.append((k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(), v_cache.stride()))
    return tuple(key)


def _torch_refuses_kvcache(q, cache_seqlens, block_table, options, lse: bool) -> Optional[str]:
    alibi, leftpad, causal, left, right, softcap, _ = options
    why = backends.torch_refuses(q, q, causal=False, window=(-1, -1), softcap=softcap, alibi=alibi, mask=None, lse=lse)
    if why:
        return why
    for what, present in (
        ("a paged cache", block_table is not None),
        (
            "per-sequence lengths in a tensor (torch's kernels need one length, on the host)",
            isinstance(cache_seqlens, torch.Tensor),
        ),
        ("cache_leftpad", leftpad is not None),
        ("a sliding window", (left, -1 if causal else right) != (-1, -1)),
        ("causal with several queries (torch's diagonal is top-left)", causal and q.shape[1] > 1),
    ):
        if present:
            return f"{what} (torch's fused SDPA)"
    return None


def _route_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, backend, options, lse: bool) -> str:
    """The implementation of a KV-cache call (kp_attention.backend.route), per signature (the lengths' values
    aside: a decode step's length grows every step). Measured on the call's own tensors: every candidate writes
    the same new tokens to the same slots, and the cache is otherwise only read."""
    alibi, leftpad, causal, left, right, softcap, scale = options
    window = (left, 0 if causal else right)
    host = isinstance(cache_seqlens, int)
    new = None if k is None else k.shape
    key = (q.shape, k_cache.shape, q.dtype, window, softcap, scale, host, block_table is None, new, lse)
    key += (alibi is None, leftpad is None)

    def describe():
        refused = {
            backends.TORCH: _torch_refuses_kvcache(q, cache_seqlens, block_table, options, lse),
            backends.FA4: attention_fa4.refuses(
                q, k_cache, v_cache, alibi=alibi is not None, leftpad=leftpad is not None, causal=causal or right >= 0
            ),
        }
        features = dict(dtype=q.dtype, head_dim=q.shape[-1], window=window, softcap=softcap, training=False)
        features["decode"] = True
        seqlens = cache_seqlens
        if host:
            seqlens = torch.full((q.shape[0],), seqlens, dtype=torch.int32, device=q.device)

        def run(name, q, k_cache, v_cache):
            if name.startswith(backends.TORCH):
                return _torch_kvcache(q, k_cache, v_cache, cache_seqlens, k, v, causal, scale, name)
            impl = FA4 if name == backends.FA4 else TRITON
            return KVCACHE(q, k_cache, v_cache, seqlens, k, v, block_table, *options, 0, impl)[0]

        return refused, features, lambda: (q, k_cache, v_cache), run

    return backends.route(KV_FN, backend, q.device, key, False, describe)


def _torch_kvcache(q, k_cache, v_cache, cache_seqlens: int, k, v, causal: bool, scale: float, kernel: str):
    """torch's SDPA over the first cache_seqlens + new keys of a contiguous cache, after writing the new tokens
    (one query per sequence when causal: it sees every key, as bottom-right alignment says)."""
    n = cache_seqlens
    if k is not None:
        index = (slice(None), slice(n, n + k.shape[1]))
        k_cache[index], v_cache[index] = k, v
        n += k.shape[1]
    t = [x.transpose(1, 2) for x in (q, k_cache.narrow(1, 0, n), v_cache.narrow(1, 0, n))]
    gqa = q.shape[2] != k_cache.shape[2]
    return backends.sdpa(*t, kernel, scale=scale, enable_gqa=gqa).transpose(1, 2)
