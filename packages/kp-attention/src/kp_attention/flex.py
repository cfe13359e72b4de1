"""FlexAttention's API on kp's kernels: change the import, keep the code.

    from kp_attention.flex import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S - 1]      # bias: a (H, 2S - 1) tensor, learnable

    mask = create_block_mask(causal, None, None, S, S, device="cuda")
    out = flex_attention(q, k, v, score_mod=rel_bias, block_mask=mask)

The mods are traced (torch.fx) into Triton functions that kp's flex kernels call, once per function (its code and
the constants it closes over); tensors the mods read are loaded inside the kernels and get gradients when they
require them. Partial blocks evaluate mask_mod, full blocks skip it, empty blocks are never visited. Runs eagerly
and under torch.compile(fullgraph=True). Beyond FlexAttention: `dropout_p` (Philox, as kp's flash attention).

What a mod may use: arithmetic, comparisons, & | ^ ~, torch.where, abs, tanh, exp, log, sqrt, sigmoid, sin,
cos, minimum/maximum/clamp, // and % (rounded as PyTorch does), dtype conversions, and reads of captured
tensors (up to four per mod, up to 4-D, every dimension indexed). An index outside a captured tensor is clamped
into it (PyTorch would raise). A Python `if` on a traced value raises a ValueError naming the function.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Optional, Union

import torch

import kp_core
from kp_attention.ops import dropout, flex, flex_codegen
from kp_attention.ops.attention import DTYPES, MAX_HEAD_DIM, default_scale
from kp_attention.ops.flex import BLOCKS, FLEX

_MAX_BLOCK = 1024


@dataclasses.dataclass
class BlockMask:
    """Which (query block, key block) pairs attention visits, as FlexAttention's BlockMask holds them.

    kv_num_blocks (B', H', q blocks) int32 and kv_indices (B', H', q blocks, kv blocks) int32 list each query
    block's partial key blocks (mask_mod evaluated there); full_kv_* the blocks mask_mod keeps whole; q_* and
    full_q_* the same by key block (the backward's order). B' and H' are 1 where the mask does not depend on
    the batch or head (broadcast).

    Made by `create_block_mask` or `BlockMask.from_kv_blocks`; `seq_lengths` is (Q_LEN, KV_LEN), `BLOCK_SIZE` the
    (query, key) block sizes, `mask_mod` the function partial blocks evaluate.

    Examples:
        >>> import torch
        >>> from kp_attention.flex import BlockMask, create_block_mask
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> mask = create_block_mask(causal, None, None, 256, 256, device="cpu")
        >>> mask
        BlockMask(shape=(1, 1, 256, 256), BLOCK_SIZE=(128, 128), sparsity=25.00%, mask_mod=causal)
        >>> mask.to_dense()[0, 0]
        tensor([[1, 0],
                [1, 1]], dtype=torch.int32)
        >>> num, idx = torch.tensor([[[1, 2]]]), torch.tensor([[[[0, 0], [0, 1]]]])  # query block 1: key blocks 0, 1
        >>> BlockMask.from_kv_blocks(num, idx, mask_mod=causal).shape
        (1, 1, 256, 256)
    """

    seq_lengths: tuple
    kv_num_blocks: torch.Tensor
    kv_indices: torch.Tensor
    full_kv_num_blocks: Optional[torch.Tensor]
    full_kv_indices: Optional[torch.Tensor]
    q_num_blocks: torch.Tensor
    q_indices: torch.Tensor
    full_q_num_blocks: Optional[torch.Tensor]
    full_q_indices: Optional[torch.Tensor]
    BLOCK_SIZE: tuple
    mask_mod: Optional[Callable]

    @property
    def shape(self) -> tuple:
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    def to(self, device) -> "BlockMask":
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)
            },
        )

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        full_kv_num_blocks: Optional[torch.Tensor] = None,
        full_kv_indices: Optional[torch.Tensor] = None,
        BLOCK_SIZE: Union[int, tuple] = 128,
        mask_mod: Optional[Callable] = None,
        seq_lengths: Optional[tuple] = None,
    ) -> "BlockMask":
        """FlexAttention's constructor from the forward's lists: kv_num_blocks (B', H', q blocks) and kv_indices
        (B', H', q blocks, n) of the blocks where mask_mod is evaluated, optionally the full ones; the backward's
        lists are derived. seq_lengths defaults to the blocks' extent. The counts and indices are checked (one
        device sync): an index outside the key blocks would address memory outside the keys."""
        sizes = _block_size(BLOCK_SIZE)
        lists = (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices)
        if (full_kv_num_blocks is None) != (full_kv_indices is None):
            raise ValueError("BlockMask.from_kv_blocks: give full_kv_num_blocks and full_kv_indices together")
        n_q = kv_num_blocks.shape[-1] if kv_num_blocks.dim() == 3 else 0
        seq = tuple(seq_lengths) if seq_lengths is not None else (n_q * sizes[0], kv_indices.shape[-1] * sizes[1])
        n_kv = -(-seq[1] // sizes[1])
        for num, idx in zip(lists[::2], lists[1::2]):
            if num is None:
                continue
            if num.dim() != 3 or idx.dim() != 4 or tuple(idx.shape[:3]) != tuple(num.shape):
                raise ValueError(
                    f"BlockMask.from_kv_blocks: num_blocks (B, H, q blocks) and indices (B, H, q blocks, n) expected, "
                    f"got {tuple(num.shape)} and {tuple(idx.shape)}"
                )
            if num.is_floating_point() or idx.is_floating_point():
                raise TypeError("BlockMask.from_kv_blocks: block counts and indices must be integer tensors")
            if num.shape[-1] != -(-seq[0] // sizes[0]):
                raise ValueError(f"BlockMask.from_kv_blocks: {num.shape[-1]} query blocks for Q_LEN {seq[0]}")
            used = torch.arange(idx.shape[-1], device=idx.device) < num[..., None].long()
            bad = bool(((num < 0) | (num > idx.shape[-1])).any()) or bool((used & ((idx < 0) | (idx >= n_kv))).any())
            if bad:
                raise ValueError(
                    f"BlockMask.from_kv_blocks: counts must be in [0, {idx.shape[-1]}], indices in [0, {n_kv})"
                )
        classes = flex.dense_classes(*(None if t is None else t.to(torch.int32) for t in lists), n_kv)
        return _from_classes(classes, seq, sizes, mask_mod)

    def to_dense(self) -> torch.Tensor:
        """(B', H', q blocks, kv blocks) int32: 1 where the block is visited (partial or full)."""
        n_kv = -(-self.seq_lengths[1] // self.BLOCK_SIZE[1])
        lists = (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices)
        return (flex.dense_classes(*lists, n_kv) > 0).to(torch.int32)

    def sparsity(self) -> float:
        """Percent of blocks never visited."""
        dense = self.to_dense()
        return 100.0 * (1.0 - dense.sum().item() / max(dense.numel(), 1))

    def __repr__(self) -> str:
        return (
            f"BlockMask(shape={self.shape}, BLOCK_SIZE={self.BLOCK_SIZE}, sparsity={self.sparsity():.2f}%, "
            f"mask_mod={getattr(self.mask_mod, '__name__', self.mask_mod)})"
        )


def noop_mask(b, h, q_idx, kv_idx):
    """Keeps everything: the mask_mod of a block mask that hides nothing.

    Examples:
        >>> import torch
        >>> from kp_attention.flex import noop_mask
        >>> noop_mask(0, 0, torch.tensor(3), torch.tensor(7))
        tensor(True)
    """
    return q_idx >= 0


def and_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod keeping what every one of mask_mods keeps.

    Examples:
        >>> import torch
        >>> from kp_attention.flex import and_masks
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> def recent(b, h, q_idx, kv_idx):
        ...     return q_idx - kv_idx < 4
        >>> sliding = and_masks(causal, recent)
        >>> sliding(0, 0, torch.tensor(10), torch.arange(12))
        tensor([False, False, False, False, False, False, False,  True,  True,  True,
                 True, False])
    """
    if not all(callable(m) for m in mask_mods):
        raise TypeError("and_masks: every argument must be a mask_mod function")

    def and_mask(b, h, q_idx, kv_idx):
        result = q_idx >= 0
        for mod in mask_mods:
            result = result & mod(b, h, q_idx, kv_idx)
        return result

    return and_mask


def or_masks(*mask_mods: Callable) -> Callable:
    """A mask_mod keeping what any one of mask_mods keeps.

    Examples:
        >>> import torch
        >>> from kp_attention.flex import or_masks
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> def first_token(b, h, q_idx, kv_idx):
        ...     return kv_idx == 0
        >>> or_masks(causal, first_token)(0, 0, torch.tensor(1), torch.arange(4))
        tensor([ True,  True, False, False])
    """
    if not all(callable(m) for m in mask_mods):
        raise TypeError("or_masks: every argument must be a mask_mod function")

    def or_mask(b, h, q_idx, kv_idx):
        result = q_idx < 0
        for mod in mask_mods:
            result = result | mod(b, h, q_idx, kv_idx)
        return result

    return or_mask


def _block_size(block_size) -> tuple:
    sizes = (block_size, block_size) if isinstance(block_size, int) else tuple(block_size)
    if len(sizes) != 2 or not all(
        isinstance(s, int) and not isinstance(s, bool) and 16 <= s <= _MAX_BLOCK and s & (s - 1) == 0 for s in sizes
    ):
        raise ValueError(
            f"BLOCK_SIZE must be a power of two in [16, {_MAX_BLOCK}] or a pair of them, got {block_size!r}"
        )
    return sizes


def _lists(cls: torch.Tensor) -> tuple:
    """(num, indices) of the partial (class 1) and full (class 2) blocks along the last dimension, in order."""
    out = []
    for value in (1, 2):
        sel = cls == value
        num = sel.sum(-1, dtype=torch.int32)
        idx = torch.argsort((~sel).to(torch.uint8), dim=-1, stable=True).to(torch.int32)
        out += [num.contiguous(), idx.contiguous()]
    return tuple(out)


def _from_classes(cls: torch.Tensor, seq_lengths: tuple, sizes: tuple, mask_mod) -> BlockMask:
    kv_num, kv_idx, full_kv_num, full_kv_idx = _lists(cls)
    q_num, q_idx, full_q_num, full_q_idx = _lists(cls.transpose(-1, -2))
    return BlockMask(
        seq_lengths, kv_num, kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx, sizes, mask_mod
    )


def _positive(name: str, value, allow_none: bool = False) -> int:
    if value is None and allow_none:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"create_block_mask: {name} must be a positive int{' or None' if allow_none else ''}, got {value!r}"
        )
    return value


def _trace(fn, kind: str) -> tuple:
    """(key, capture paths) of a mod ('' and () for none): a constant to torch.compile, which calls this once
    while it traces (the mark below)."""
    if fn is None:
        return "", ()
    mod = flex_codegen.trace(fn, kind)
    return mod.key, mod.paths


# what torch._dynamo.assume_constant_result does, without importing torch._dynamo (seconds) with this module
_trace._dynamo_marked_constant = True


def _capture_slots(fn, paths: tuple, device: torch.device, what: str) -> tuple:
    caps = flex_codegen.captures(fn, paths) if paths else ()
    for c in caps:
        if c.device != device:
            raise ValueError(f"{what} reads a tensor on {c.device}; the attention runs on {device}: move it there")
    return (*caps, *([None] * (flex_codegen.MAX_CAPTURES - len(caps))))


def create_block_mask(
    mask_mod: Callable,
    B: Optional[int],
    H: Optional[int],
    Q_LEN: int,
    KV_LEN: int,
    device: Union[str, torch.device] = "cuda",
    BLOCK_SIZE: Union[int, tuple] = 128,
    _compile: bool = False,
) -> BlockMask:
    """FlexAttention's create_block_mask: the blocks mask_mod(b, h, q_idx, kv_idx) keeps, classified on the
    device by one kernel (B or H None: the mask does not depend on it). `_compile` is accepted and unused.

    Args:
        mask_mod: (b, h, q_idx, kv_idx) -> a bool tensor (see the module docstring for what it may use).
        B: the batch size, or None.
        H: the number of query heads, or None.
        Q_LEN: the query length.
        KV_LEN: the key length.
        device: where the block lists are made (the attention's device).
        BLOCK_SIZE: an int or a (query, key) pair.

    Examples:
        >>> from kp_attention.flex import create_block_mask
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> mask = create_block_mask(causal, None, None, 512, 512, device="cpu")
        >>> mask.shape, mask.kv_num_blocks.dtype
        ((1, 1, 512, 512), torch.int32)
    """
    if not callable(mask_mod):
        raise TypeError(f"create_block_mask: mask_mod must be a function (b, h, q_idx, kv_idx), got {mask_mod!r}")
    batch, heads = _positive("B", B, True), _positive("H", H, True)
    q_len, kv_len = _positive("Q_LEN", Q_LEN), _positive("KV_LEN", KV_LEN)
    sizes = _block_size(BLOCK_SIZE)
    device = torch.device(device)
    key, paths = _trace(mask_mod, "mask")
    anchor = torch.empty(0, device=device)
    caps = _capture_slots(mask_mod, paths, anchor.device, f"mask_mod {getattr(mask_mod, '__name__', mask_mod)}")
    cls = BLOCKS(anchor, *caps, key, batch, heads, q_len, kv_len, *sizes)
    return _from_classes(cls, (q_len, kv_len), sizes, mask_mod)


_FULL: dict = {}


def _full_mask(sq: int, sk: int, device: torch.device) -> BlockMask:
    """Every block full: what no block mask means (cached per shape outside torch.compile)."""
    key = (sq, sk, device)
    hit = _FULL.get(key) if not torch.compiler.is_compiling() else None
    if hit is None:
        sizes = (128, 128)
        n_q, n_kv = -(-sq // sizes[0]), -(-sk // sizes[1])
        cls = torch.full((1, 1, n_q, n_kv), 2, dtype=torch.int8, device=device)
        hit = _from_classes(cls, (sq, sk), sizes, None)
        if not torch.compiler.is_compiling():
            _FULL[key] = hit
    return hit


def _check(q, k, v, block_mask, scale, enable_gqa, dropout_p) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flex_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flex_attention: {name} must be 4-D (batch, heads, seq, head_dim), got {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"flex_attention: {name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"flex_attention: {name} must have query's dtype and device ({q.dtype}, {q.device})")
    (b, hq, _, d), (bk, hkv, sk, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
    if not (b == bk == bv) or hkv != hv or sk != sv:
        raise ValueError(f"flex_attention: key {tuple(k.shape)} and value {tuple(v.shape)} must match query's batch")
    if not (d == dk == dv) or not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"flex_attention: head dims must be equal and in [1, {MAX_HEAD_DIM}], got {d}, {dk}, {dv}")
    kp_core.check_bool("flex_attention", "enable_gqa", enable_gqa)
    if hkv == 0 or hq % hkv or (hq != hkv and not enable_gqa):
        raise ValueError(
            f"flex_attention: query has {hq} heads, key {hkv}: equal, or enable_gqa=True with a multiple of them"
        )
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError(
                f"flex_attention: block_mask must be a kp_attention.flex.BlockMask, got {type(block_mask).__name__}"
            )
        if tuple(block_mask.seq_lengths) != (q.shape[2], sk):
            raise ValueError(
                f"flex_attention: block_mask was made for (Q_LEN, KV_LEN) {tuple(block_mask.seq_lengths)}, the inputs "
                f"have {(q.shape[2], sk)}"
            )
        lists = (block_mask.kv_num_blocks, block_mask.kv_indices, block_mask.q_num_blocks, block_mask.q_indices)
        if any(t is None or t.dim() != n for t, n in zip(lists, (3, 4, 3, 4))) or any(
            full is not None and full.shape != part.shape
            for full, part in (
                (block_mask.full_kv_num_blocks, lists[0]),
                (block_mask.full_kv_indices, lists[1]),
                (block_mask.full_q_num_blocks, lists[2]),
                (block_mask.full_q_indices, lists[3]),
            )
        ):
            raise ValueError(
                "flex_attention: block_mask's lists have the wrong ranks or shapes (make it with "
                "create_block_mask or BlockMask.from_kv_blocks)"
            )
        mb, mh = block_mask.kv_num_blocks.shape[:2]
        if mb not in (1, b) or mh not in (1, hq):
            raise ValueError(f"flex_attention: block_mask's (B, H) {(mb, mh)} must be 1 or the query's {(b, hq)}")
        if block_mask.kv_num_blocks.device != q.device:
            raise ValueError(f"flex_attention: block_mask is on {block_mask.kv_num_blocks.device}, query on {q.device}")
    if scale is not None and (
        not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale)
    ):
        raise ValueError(f"flex_attention: scale must be a finite number or None, got {scale!r}")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"flex_attention: dropout_p must be in [0, 1], got {dropout_p!r}")


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Optional[Callable] = None,
    block_mask: Optional[BlockMask] = None,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: Optional[dict] = None,
    *,
    dropout_p: float = 0.0,
):
    """FlexAttention's flex_attention on (B, H, S, D) query, key, value: softmax(score_mod(scale * q k^T) masked by
    block_mask) @ v, and with return_lse the fp32 (B, H, Sq) log-sum-exp. dropout_p drops probabilities as
    FlashAttention does (pass 0.0 in evaluation). kernel_options (FlexAttention's tuning knobs) is accepted and
    not used: kp picks its tiles itself. Rows that see no key give 0 (lse -inf).

    Args:
        query: (B, Hq, Sq, D), float16, bfloat16 or float32, D up to 256.
        key: (B, Hkv, Sk, D), query's dtype and device; Hkv = Hq, or a divisor of it with enable_gqa=True.
        value: key's shape.
        score_mod: (score, b, h, q_idx, kv_idx) -> the new score, or None.
        block_mask: a BlockMask for (Sq, Sk) on query's device, or None (every block visited).
        scale: defaults to 1 / sqrt(D).

    Returns:
        out (B, Hq, Sq, D) in query's dtype; with return_lse also lse (B, Hq, Sq) float32.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from kp_attention.flex import create_block_mask, flex_attention
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> q, k, v = torch.randn(1, 2, 256, 32), torch.randn(1, 2, 256, 32), torch.randn(1, 2, 256, 32)
        >>> mask = create_block_mask(causal, None, None, 256, 256, device="cpu")
        >>> out = flex_attention(q, k, v, block_mask=mask)
        >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5)
        True
        >>> bias = torch.randn(2)  # one per head: read inside the kernel
        >>> out = flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h], block_mask=mask)
    """
    _check(query, key, value, block_mask, scale, enable_gqa, dropout_p)
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise TypeError(f"flex_attention: kernel_options must be a dict or None, got {type(kernel_options).__name__}")
    sq, sk = query.shape[2], key.shape[2]
    block_mask = _full_mask(sq, sk, query.device) if block_mask is None else block_mask
    score_key, score_paths = _trace(score_mod, "score")
    mask_key, mask_paths = _trace(block_mask.mask_mod, "mask")
    device = query.device
    score_caps = _capture_slots(score_mod, score_paths, device, "score_mod")
    mask_caps = _capture_slots(block_mask.mask_mod, mask_paths, device, "mask_mod")
    seed = dropout.draw_seed(device) if dropout_p > 0 else None
    out, lse = FLEX(
        query,
        key,
        value,
        block_mask.kv_num_blocks,
        block_mask.kv_indices,
        block_mask.full_kv_num_blocks,
        block_mask.full_kv_indices,
        block_mask.q_num_blocks,
        block_mask.q_indices,
        block_mask.full_q_num_blocks,
        block_mask.full_q_indices,
        seed,
        *score_caps,
        *mask_caps,
        score_key,
        mask_key,
        *block_mask.BLOCK_SIZE,
        float(default_scale(query.shape[-1]) if scale is None else scale),
        float(dropout_p),
    )
    return (out, lse) if return_lse else out


__all__ = ["BlockMask", "and_masks", "create_block_mask", "flex_attention", "noop_mask", "or_masks"]
