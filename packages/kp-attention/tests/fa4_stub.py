"""A stand-in for FlashAttention-4's interface (`flash_attn.cute.interface`) for tests off a GPU: its
`_flash_attn_fwd` and `_flash_attn_bwd` with FlashAttention-4's argument conventions, computed in float64 from
the formula as its README states it (window (left, right) about the bottom-right diagonal, None unbounded,
causal = (None, 0); softcap c * tanh(s / c); lse per (batch, head, query), or (head, total_q) when packed;
seqused_k the keys a sequence uses; page_table pages of the keys). Written from those conventions, not from kp's
code, so that kp's adapter (kp_attention.ops.attention_fa4) is checked against FlashAttention-4's meaning of its
arguments. Every call's keyword arguments are kept in `calls`."""

from __future__ import annotations

import torch

calls: list[tuple[str, dict]] = []


def _one(q, k, v, scale, softcap, left, right, causal):
    """(out, lse) of one sequence, float64: q (Sq, Hq, D), k/v (Sk, Hkv, D)."""
    sq, sk = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        right = 0
    offset = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq)  # key minus the query's diagonal
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if right is not None:
        keep &= offset <= right
    if left is not None:
        keep &= offset >= -left
    s = s.masked_fill(~keep.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, -1)  # (Hq, Sq)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.einsum("hqk,khd->qhd", p, v), lse


def _forward64(q, k, v, options):
    scale = options.get("softmax_scale") or q.shape[-1] ** -0.5
    args = (
        scale,
        options.get("softcap") or 0.0,
        options.get("window_size_left"),
        options.get("window_size_right"),
        options.get("causal", False),
    )
    cu_q, cu_k = options.get("cu_seqlens_q"), options.get("cu_seqlens_k")
    used, table = options.get("seqused_k"), options.get("page_table")
    if cu_q is None:  # (B, S, H, D) queries
        outs, lses = [], []
        for b in range(q.shape[0]):
            kb, vb = (_keys(t, b, table, used, cu_k) for t in (k, v))
            o, lse = _one(q[b], kb, vb, *args)
            outs.append(o)
            lses.append(lse)
        return torch.stack(outs), torch.stack(lses)
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        qb = q[int(cu_q[b]) : int(cu_q[b + 1])]
        kb, vb = (_keys(t, b, table, used, cu_k) for t in (k, v))
        o, lse = _one(qb, kb, vb, *args)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def _keys(t, b, table, used, cu_k):
    if cu_k is not None:
        return t[int(cu_k[b]) : int(cu_k[b + 1])]
    if table is not None:
        n, page = int(used[b]), t.shape[1]
        j = torch.arange(n, device=t.device)
        return t[table[b].long()[j // page], j % page]
    return t[b] if used is None else t[b, : int(used[b])]


def _flash_attn_fwd(q, k, v, **options):
    calls.append(("fwd", options))
    out, lse = _forward64(q.double(), k.double(), v.double(), options)
    return out.to(q.dtype), lse.float(), None, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, dq=None, dk=None, dv=None, **options):
    calls.append(
        ("bwd", dict(options, softmax_scale=softmax_scale, causal=causal, softcap=softcap, dq=dq, dk=dk, dv=dv))
    )
    dlse = options.get("dlse")
    fwd_options = dict(options, softmax_scale=softmax_scale, causal=causal, softcap=softcap)

    def f(q, k, v):
        o, lse = _forward64(q, k, v, fwd_options)
        return o, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)

    primals = [t.double() for t in (q, k, v)]
    cot = (dout.double(), torch.zeros_like(lse, dtype=torch.float64) if dlse is None else dlse.double())
    _, pull = torch.func.vjp(f, *primals)
    # into the buffers given (FlashAttention-4 checks their shape, dtype and device, and writes them in their own
    # layout), else in q's, k's and v's own layouts (its torch.empty_like)
    given = (dq, dk, dv)
    for buf, t, name in zip(given, (q, k, v), ("dq", "dk", "dv")):
        if buf is not None:
            assert buf.shape == t.shape and buf.dtype == t.dtype and buf.device == t.device, name
    grads = pull(cot)
    return tuple((torch.empty_like(t) if b is None else b).copy_(g) for g, t, b in zip(grads, (q, k, v), given))
