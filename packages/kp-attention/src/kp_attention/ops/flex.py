"""Flex attention ops: launchers, the PyTorch reference and the two op declarations.

kp::flex_attention takes (B, H, S, D) q, k, v (any strides), a block mask as its lists (kp_attention.flex.
BlockMask), the captured tensors of the score and mask mods and the mods' keys (flex_codegen: the op's handle on
the generated Triton functions, a string, so torch.compile keeps one graph node); kp::flex_block_mask evaluates a
mask_mod over the blocks. The kernels are in kp_attention.ops.flex_kernels; the spec is
conformance/specs/test_flex_attention.py.
"""

import functools
from typing import Optional

import torch

import kp_core
from kp_attention.ops import decode, dropout, flex_codegen
from kp_attention.ops.attention import (
    DTYPES,
    MAX_HEAD_DIM,
    PACKAGE,
    block_dim,
    exact_delta,
    exp_rows,
    launch_tiles,
    softmax_lse,
)

if kp_core.has_triton():
    from kp_attention.ops import attention_bwd_kernels
    from kp_attention.ops import flex_kernels as kernels

OP = "kp::flex_attention"
OP_BWD = f"{OP}_backward"
OP_BLOCKS = "kp::flex_block_mask"
SPEC = "flex_attention"


def _bshd(t: torch.Tensor) -> tuple:
    """(batch, seq, head, dim) strides of a (B, H, S, D) tensor."""
    return t.stride(0), t.stride(2), t.stride(1), t.stride(3)


_META: dict = {}


def _meta(captures: tuple, device: torch.device) -> torch.Tensor:
    """int64 sizes and strides of the captures (flex_codegen.META_STRIDE a capture), cached per layout."""
    key = (device, *((tuple(c.shape), c.stride()) for c in captures if c is not None))
    hit = _META.get(key)
    if hit is None:
        values = []
        for c in captures:
            if c is None:
                values += [1] * 4 + [0] * 4
                continue
            shape = list(c.shape) + [1] * (4 - c.dim())
            stride = list(c.stride()) + [0] * (4 - c.dim())
            values += shape + stride
        values += [1] * 4 + [0] * 4  # a spare row: unused slots read it
        if len(_META) > 256:
            _META.clear()
        hit = _META[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return hit


def _slots(caps: tuple, anchor: torch.Tensor) -> tuple:
    """The kernels' four capture pointers: the captures, then `anchor` in the unused slots (never read)."""
    caps = [c for c in caps if c is not None]
    return (*caps, *([anchor] * (flex_codegen.MAX_CAPTURES - len(caps))))


def _mods(score_key: str, mask_key: str):
    score = flex_codegen.by_key(score_key)
    mask = flex_codegen.by_key(mask_key)
    return score, mask


def _fns(mod, name: str):
    return None if mod is None else getattr(mod.module, name)


def _block_lists(kv_num, kv_idx, full_num, full_idx) -> tuple:
    """The lists as the kernels read them (int32, contiguous) and their strides; full ones may be absent."""
    kv_num, kv_idx = kv_num.contiguous(), kv_idx.contiguous()
    has_full = full_num is not None
    full_num = full_num.contiguous() if has_full else kv_num
    full_idx = full_idx.contiguous() if has_full else kv_idx

    def bcast(t, dim):  # a size-1 batch or head dimension is broadcast: stride 0
        return 0 if t.shape[dim] == 1 else t.stride(dim)

    strides = (bcast(kv_num, 0), bcast(kv_num, 1), bcast(kv_idx, 0), bcast(kv_idx, 1), kv_idx.stride(2))
    return (kv_num, kv_idx, full_num, full_idx), strides, has_full


def _tile(kernel: str, q: torch.Tensor, q_block: int, kv_block: int, sq: int) -> dict:
    t = launch_tiles(kernel, block_dim(q.shape[-1]), q.element_size(), q.device)
    block_m = min(t["block_m"], q_block, max(16, kp_core.next_power_of_2(sq)))
    return {**t, "block_m": block_m, "block_n": min(t["block_n"], kv_block)}


# ---- reference ----


def dense_classes(kv_num, kv_idx, full_num, full_idx, n_kv: int) -> torch.Tensor:
    """(B', H', q blocks, kv blocks) int8: 2 for a full block, 1 partial, 0 skipped, from the lists."""
    cls = torch.zeros((*kv_num.shape, n_kv + 1), dtype=torch.int8, device=kv_num.device)
    for num, idx, value in ((kv_num, kv_idx, 1), (full_num, full_idx, 2)):
        if num is None:
            continue
        valid = torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()
        where = torch.where(valid, idx.long(), n_kv)  # entries past the count go to a spare column
        cls.scatter_(-1, where, torch.full(where.shape, value, dtype=torch.int8, device=cls.device))
    return cls[..., :n_kv]


def _indices(b: int, h: int, sq: int, sk: int, device) -> tuple:
    ar = functools.partial(torch.arange, dtype=torch.int32, device=device)
    return ar(b).view(-1, 1, 1, 1), ar(h).view(1, -1, 1, 1), ar(sq).view(1, 1, -1, 1), ar(sk).view(1, 1, 1, -1)


def _reference_forward(q, k, v, lists, seed, score_caps, mask_caps, score_key, mask_key, blocks, scale, dropout_p):
    """(out, lse) in PyTorch: fp32 for fp16/bf16 inputs, else q's dtype; what the kernels compute, block lists and
    partial-only mask_mod included."""
    score, mask = _mods(score_key, mask_key)
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    bsz, hq, sq, _ = q.shape
    sk, group = k.shape[2], hq // k.shape[1]
    qf = q.to(work)
    kf = k.to(work).repeat_interleave(group, dim=1)
    vf = v.to(work).repeat_interleave(group, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    b, h, i, j = _indices(bsz, hq, sq, sk, q.device)
    if score is not None:
        s = score.evaluate(score_caps, s, b, h, i, j).to(work)
    q_block, kv_block = blocks
    cls = dense_classes(*lists, -(-sk // kv_block))
    cls = cls.repeat_interleave(q_block, dim=2)[:, :, :sq].repeat_interleave(kv_block, dim=3)[..., :sk]
    keep = cls == 2
    if mask is not None:
        keep = keep | ((cls == 1) & mask.evaluate(mask_caps, b, h, i, j).bool())
    else:
        keep = keep | (cls == 1)
    probs, lse = softmax_lse(*exp_rows(s.masked_fill(~keep, float("-inf"))))
    if dropout_p > 0:
        bh = torch.arange(bsz * hq, device=q.device)
        keep_d = dropout.keep_mask(seed, bh, sq, sk, dropout_p).view(bsz, hq, sq, sk)
        probs = probs * keep_d * dropout.keep_scale(dropout_p)
    return (probs @ vf).to(q.dtype), lse.float()


# ---- launchers ----


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_kv_num_blocks: Optional[torch.Tensor],
    full_kv_indices: Optional[torch.Tensor],
    q_num_blocks: torch.Tensor,
    q_indices: torch.Tensor,
    full_q_num_blocks: Optional[torch.Tensor],
    full_q_indices: Optional[torch.Tensor],
    dropout_seed: Optional[torch.Tensor],
    sc0: Optional[torch.Tensor],
    sc1: Optional[torch.Tensor],
    sc2: Optional[torch.Tensor],
    sc3: Optional[torch.Tensor],
    mc0: Optional[torch.Tensor],
    mc1: Optional[torch.Tensor],
    mc2: Optional[torch.Tensor],
    mc3: Optional[torch.Tensor],
    score_key: str,
    mask_key: str,
    q_block: int,
    kv_block: int,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse): q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), out (B, Hq, Sq, D) contiguous, lse fp32 (B, Hq, Sq). The
    block lists are those of kp_attention.flex.BlockMask (q_* unused here; the backward walks them)."""
    bsz, hq, sq, d = q.shape
    sk = k.shape[2]
    out = q.new_empty(q.shape)
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or sk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    score_caps, mask_caps = (sc0, sc1, sc2, sc3), (mc0, mc1, mc2, mc3)
    lists = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    backend = kp_core.choose_backend(OP, q)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP)
        caps = tuple(c for c in score_caps if c is not None), tuple(c for c in mask_caps if c is not None)
        o, lse = _reference_forward(
            q, k, v, lists, dropout_seed, *caps, score_key, mask_key, (q_block, kv_block), scale, dropout_p
        )
        return o.contiguous(), lse.contiguous()
    score, mask = _mods(score_key, mask_key)
    lists, list_strides, has_full = _block_lists(*lists)
    tiles = _tile("_attn_fwd", q, q_block, kv_block, sq)
    q_blocks = kp_core.cdiv(sq, tiles["block_m"])
    splits = _splits(q, q_blocks * hq * bsz, kp_core.cdiv(sk, kv_block))
    o_part = l_part = lse
    if splits > 1:
        o_part = torch.empty((splits, bsz, hq, sq, d), dtype=torch.float32, device=q.device)
        l_part = torch.empty((splits, bsz, hq, sq), dtype=torch.float32, device=q.device)
    args = (
        q,
        k,
        v,
        out,
        lse,
        *lists,
        lse if dropout_seed is None else dropout_seed,
        *_slots(score_caps, lse),
        _meta(score_caps, q.device),
        *_slots(mask_caps, lse),
        _meta(mask_caps, q.device),
        o_part,
        l_part,
        *_bshd(q),
        *_bshd(k),
        *_bshd(v),
        *_bshd(out),
        *list_strides,
        sq,
        sk,
        hq // k.shape[1],
        scale,
        dropout.threshold(dropout_p),
        dropout.keep_scale(dropout_p),
        splits,
    )
    consts = dict(
        HEAD_DIM=d,
        BLOCK_M=tiles["block_m"],
        BLOCK_N=tiles["block_n"],
        BLOCK_D=block_dim(d),
        Q_BLOCK=q_block,
        KV_BLOCK=kv_block,
        SCORE_MOD=_fns(score, "fwd"),
        MASK_MOD=_fns(mask, "fwd"),
        HAS_FULL=has_full,
        DROPOUT=dropout_p > 0,
        IEEE=q.dtype == torch.float32,
        SPLIT=splits > 1,
    )
    grid = (q_blocks * splits, hq, bsz)
    kp_core.launch(OP, backend, kernels._flex_fwd, grid, args, consts, tiles["num_warps"], tiles["num_stages"])
    if splits > 1:
        block_m = min(64, max(16, kp_core.next_power_of_2(sq)))
        kp_core.launch(
            OP,
            backend,
            kernels._flex_combine,
            (kp_core.cdiv(sq, block_m), hq, bsz),
            (o_part, l_part, out, lse, *_bshd(out), sq, splits),
            dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=block_dim(d)),
            4,
        )
    return out, lse


def _splits(q: torch.Tensor, programs: int, kv_blocks: int) -> int:
    """Splits of each row's block list (flash-decoding) when the query blocks alone leave the GPU idle:
    decode.auto_num_splits' rule, per mask block; fp32 never splits (its two-pass exactness is per row).
    `kp_core.pin("_flex_fwd", splits=n)` fixes the count (tests, benchmark sweeps)."""
    pinned = kp_core.settings("_flex_fwd", splits=0)["splits"]
    if q.dtype == torch.float32:
        return 1
    if pinned:
        return max(1, min(pinned, kv_blocks))
    return decode.auto_num_splits(q.device, programs, kv_blocks)


def backward(
    dout: Optional[torch.Tensor],
    dlse: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv_num_blocks: torch.Tensor,
    kv_indices: torch.Tensor,
    full_kv_num_blocks: Optional[torch.Tensor],
    full_kv_indices: Optional[torch.Tensor],
    q_num_blocks: torch.Tensor,
    q_indices: torch.Tensor,
    full_q_num_blocks: Optional[torch.Tensor],
    full_q_indices: Optional[torch.Tensor],
    dropout_seed: Optional[torch.Tensor],
    sc0: Optional[torch.Tensor],
    sc1: Optional[torch.Tensor],
    sc2: Optional[torch.Tensor],
    sc3: Optional[torch.Tensor],
    mc0: Optional[torch.Tensor],
    mc1: Optional[torch.Tensor],
    mc2: Optional[torch.Tensor],
    mc3: Optional[torch.Tensor],
    score_key: str,
    mask_key: str,
    q_block: int,
    kv_block: int,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, and the gradients of the score_mod's four capture slots: None where a slot is empty or its
    tensor needs none)."""
    score_caps, mask_caps = (sc0, sc1, sc2, sc3), (mc0, mc1, mc2, mc3)
    kv_lists = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
    q_lists = (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices)
    if dout is None:
        dout = out.new_zeros(out.shape)
    backend = kp_core.choose_backend(OP_BWD, q)
    if backend == kp_core.REFERENCE or q.numel() == 0 or k.shape[2] == 0:
        if q.numel() and k.shape[2]:
            kp_core.reference(OP_BWD)
        return _reference_backward(
            dout,
            dlse,
            q,
            k,
            v,
            kv_lists,
            dropout_seed,
            score_caps,
            mask_caps,
            score_key,
            mask_key,
            q_block,
            kv_block,
            scale,
            dropout_p,
        )
    score, mask = _mods(score_key, mask_key)
    bsz, hq, sq, d = q.shape
    sk, hkv = k.shape[2], k.shape[1]
    ieee = q.dtype == torch.float32
    (q, dq), (k, dk), (v, dv) = (_with_grad_buffer(t) for t in (q, k, v))
    # the generated backward adds into the captures that needed a gradient when traced (flex_codegen.Mod)
    wants = [kind[2] for kind in score.capture_kinds] if score is not None else []
    # fp64 sums for fp32 inputs: fp32 atomics over every score drift past PyTorch's reduction (the 2x rule)
    acc = torch.float64 if ieee else torch.float32
    grads = tuple(
        torch.zeros(c.shape, dtype=acc, device=c.device) if c is not None and wants[i] else None
        for i, c in enumerate(score_caps)
    )
    # A capture's gradient sums P (dP - delta) over whole rows, where the exact sum is 0 for a per-row constant:
    # delta must be the same sum as dP (EXACT_DELTA), not rowsum(dO * O) in another order, whose one-ulp misses at
    # |dP| add up across rows instead of cancelling (one key per row: 0 in float64 and PyTorch, 3.5e-6 without).
    exact = exact_delta(q.dtype, d) or (not ieee and any(g is not None for g in grads))
    lse = lse.contiguous()
    delta = torch.empty_like(lse, dtype=torch.float64 if ieee else torch.float32)
    lse_fix = torch.empty_like(lse, dtype=torch.float64) if ieee else lse
    block_d = block_dim(d)
    pre = launch_tiles("_attn_bwd_preprocess", block_d, q.element_size(), q.device)
    if dlse is not None:
        dlse = dlse.to(torch.float32).contiguous()
    kp_core.launch(
        OP_BWD,
        backend,
        attention_bwd_kernels._attn_bwd_preprocess,
        (kp_core.cdiv(sq, pre["block_m"]), hq, bsz),
        (
            out,
            dout,
            lse if dlse is None else dlse,
            delta,
            lse,
            *_bshd(out),
            *_bshd(dout),
            lse.stride(0),
            lse.stride(1),
            sq,
        ),
        dict(
            HEAD_DIM=d,
            BLOCK_M=pre["block_m"],
            BLOCK_D=block_d,
            VARLEN=False,
            HAS_DLSE=dlse is not None,
            ROWSUM=not (ieee or exact),
        ),
        pre["num_warps"],
    )
    seed = lse if dropout_seed is None else dropout_seed
    smeta, mmeta = _meta(score_caps, q.device), _meta(mask_caps, q.device)
    common = (*_bshd(q), *_bshd(k), *_bshd(v), *_bshd(dout))
    scalars = (sq, sk, hq // hkv, scale, dropout.threshold(dropout_p), dropout.keep_scale(dropout_p))
    fns = dict(SCORE_MOD=_fns(score, "fwd"), SCORE_BWD=_fns(score, "bwd"), MASK_MOD=_fns(mask, "fwd"))

    def consts(tiles: dict, has_full: bool) -> dict:
        return dict(
            HEAD_DIM=d,
            BLOCK_M=tiles["block_m"],
            BLOCK_N=tiles["block_n"],
            BLOCK_D=block_d,
            Q_BLOCK=q_block,
            KV_BLOCK=kv_block,
            **fns,
            HAS_FULL=has_full,
            DROPOUT=dropout_p > 0,
            IEEE=ieee,
        )

    lists, list_strides, has_full = _block_lists(*kv_lists)
    t = _tile("_attn_bwd_dq", q, q_block, kv_block, sq)
    kp_core.launch(
        OP_BWD,
        backend,
        kernels._flex_bwd_dq,
        (kp_core.cdiv(sq, t["block_m"]), hq, bsz),
        (
            q,
            k,
            v,
            dout,
            lse,
            delta,
            lse_fix,
            dq,
            *lists,
            seed,
            *_slots(score_caps, lse),
            smeta,
            *_slots(grads, lse),
            *_slots(mask_caps, lse),
            mmeta,
            *common,
            *list_strides,
            *scalars,
        ),
        {**consts(t, has_full), "EXACT_DELTA": exact},
        t["num_warps"],
        t["num_stages"],
    )
    lists, list_strides, has_full = _block_lists(*q_lists)
    t = _tile("_attn_bwd_dkdv", q, q_block, kv_block, sq)
    kp_core.launch(
        OP_BWD,
        backend,
        kernels._flex_bwd_dkdv,
        (kp_core.cdiv(sk, t["block_n"]), hkv, bsz),
        (
            q,
            k,
            v,
            dout,
            lse_fix,
            delta,
            dk,
            dv,
            *lists,
            seed,
            *_slots(score_caps, lse),
            smeta,
            *_slots(mask_caps, lse),
            mmeta,
            *common,
            *list_strides,
            *scalars,
        ),
        consts(t, has_full),
        t["num_warps"],
        t["num_stages"],
    )
    cap_grads = tuple(None if g is None else g.to(c.dtype) for g, c in zip(grads, score_caps))
    return (dq, dk, dv, *cap_grads)


def _with_grad_buffer(t: torch.Tensor) -> tuple:
    """(t, its gradient's buffer) with the same strides (the kernels address both with t's)."""
    g = torch.empty_like(t)
    if g.stride() != t.stride():
        t = t.contiguous()
        g = torch.empty_like(t)
    return t, g


def _reference_backward(
    dout, dlse, q, k, v, kv_lists, seed, score_caps, mask_caps, score_key, mask_key, q_block, kv_block, scale, p
):
    """(dq, dk, dv, and the four score capture slots' gradients: None where the trace wanted none)."""
    score = flex_codegen.by_key(score_key)
    wants = [c is not None and score.capture_kinds[i][2] for i, c in enumerate(score_caps)]
    masks = tuple(c for c in mask_caps if c is not None)

    def outputs(q, k, v, *wanted):
        wanted, caps = iter(wanted), []
        for c, w in zip(score_caps, wants):
            if c is not None:
                caps.append(next(wanted) if w else c)
        out, lse = _reference_forward(
            q, k, v, kv_lists, seed, tuple(caps), masks, score_key, mask_key, (q_block, kv_block), scale, p
        )
        return out if dlse is None else (out, torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))

    primals = (q, k, v, *[c for c, w in zip(score_caps, wants) if w])
    grads = kp_core.vjp(outputs, primals, dout if dlse is None else (dout, dlse))
    rest = iter(grads[3:])
    dqkv = (_with_grad_buffer(t)[1].copy_(g) for t, g in zip((q, k, v), grads))  # the fake's layout
    return (*dqkv, *(next(rest).to(c.dtype).contiguous() if w else None for c, w in zip(score_caps, wants)))


# ---- the block mask ----


def block_classes(
    anchor: torch.Tensor,
    mc0: Optional[torch.Tensor],
    mc1: Optional[torch.Tensor],
    mc2: Optional[torch.Tensor],
    mc3: Optional[torch.Tensor],
    mask_key: str,
    batch: int,
    heads: int,
    q_len: int,
    kv_len: int,
    q_block: int,
    kv_block: int,
) -> torch.Tensor:
    """(batch, heads, q blocks, kv blocks) int8 on anchor's device: 0 no element of the block kept by the
    mask_mod, 2 every in-bounds element kept, 1 otherwise."""
    n_q, n_kv = kp_core.cdiv(q_len, q_block), kp_core.cdiv(kv_len, kv_block)
    cls = torch.empty((batch, heads, n_q, n_kv), dtype=torch.int8, device=anchor.device)
    if cls.numel() == 0:
        return cls
    mask = flex_codegen.by_key(mask_key)
    caps = (mc0, mc1, mc2, mc3)
    backend = kp_core.choose_backend(OP_BLOCKS, anchor)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP_BLOCKS)
        b, h, i, j = _indices(batch, heads, q_len, kv_len, anchor.device)
        keep = mask.evaluate(tuple(c for c in caps if c is not None), b, h, i, j).bool()
        keep = keep.expand(batch, heads, q_len, kv_len)
        pad = torch.zeros((batch, heads, n_q * q_block, n_kv * kv_block), dtype=torch.int8, device=anchor.device)
        inb = pad.clone()
        pad[..., :q_len, :kv_len] = keep.to(torch.int8)
        inb[..., :q_len, :kv_len] = 1
        blocks = (batch, heads, n_q, q_block, n_kv, kv_block)
        held = pad.view(blocks).sum((3, 5), dtype=torch.int32)
        seen = inb.view(blocks).sum((3, 5), dtype=torch.int32)
        return torch.where(held == 0, 0, torch.where(held == seen, 2, 1)).to(torch.int8)
    sub_m, sub_n = min(32, q_block), min(64, kv_block)
    kp_core.launch(
        OP_BLOCKS,
        backend,
        kernels._flex_block_classes,
        (n_q, heads, batch),
        (cls, *_slots(caps, cls), _meta(caps, anchor.device), q_len, kv_len, n_kv),
        dict(Q_BLOCK=q_block, KV_BLOCK=kv_block, SUB_M=sub_m, SUB_N=sub_n, MASK_MOD=mask.module.fwd),
        4,
    )
    return cls


def _forward_fake(q, k, v, *rest):
    b, h, s, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, h, s), dtype=torch.float32)


def _backward_fake(dout, dlse, q, k, v, out, lse, *rest):
    caps, score = rest[9:13], flex_codegen.by_key(rest[17])  # the slots, the score_mod's key
    wants = [c is not None and score.capture_kinds[i][2] for i, c in enumerate(caps)]
    return (
        *(_with_grad_buffer(t)[1] for t in (q, k, v)),
        *(c.new_empty(c.shape) if w else None for c, w in zip(caps, wants)),
    )


def _classes_fake(anchor, mc0, mc1, mc2, mc3, mask_key, batch, heads, q_len, kv_len, q_block, kv_block):
    shape = (batch, heads, -(-q_len // q_block), -(-kv_len // kv_block))
    return anchor.new_empty(shape, dtype=torch.int8)


FLEX = kp_core.op(
    OP,
    forward,
    _forward_fake,
    backward=backward,
    backward_fake=_backward_fake,
    # q, k, v, out, lse, the 8 block lists, the seed, the 8 capture slots
    save=lambda args, outputs: (*args[:3], *outputs, *args[3:20]),
    grad_inputs=("q", "k", "v", "sc0", "sc1", "sc2", "sc3"),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)

BLOCKS = kp_core.op(OP_BLOCKS, block_classes, _classes_fake, package=PACKAGE, spec=SPEC, dtypes=DTYPES)

__all__ = ["BLOCKS", "FLEX", "MAX_HEAD_DIM", "OP", "SPEC"]
