"""Hypothesis strategies that favour awkward sizes: primes, block sizes +- 1, 1, zero-size batches."""

from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from kp_conformance.tiers import Tier
from kp_core import cdiv

# Block-size neighbours, primes and the widths real models use.
AWKWARD_COLS = (
    1,
    2,
    3,
    5,
    7,
    13,
    31,
    32,
    33,
    63,
    64,
    65,
    97,
    127,
    128,
    129,
    255,
    256,
    257,
    509,
    1023,
    1024,
    1025,
    2047,
    2048,
    2049,
    3001,
    4095,
    4096,
    4097,
    5120,
    8191,
    8192,
    8193,
    14336,
    16383,
    16384,
    16385,
    19997,
    32768,
    65535,
    65536,
    65537,
    131072,
    262144,
)
AWKWARD_ROWS = (0, 1, 2, 3, 5, 7, 16, 31, 33, 127, 257, 1024, 1031, 4096, 8192, 16384, 65536)
LAYOUTS = ("contiguous", "row_strided", "transposed")


def cols(tier: Tier) -> st.SearchStrategy[int]:
    fixed = [c for c in AWKWARD_COLS if c <= tier.max_cols]
    return st.one_of(st.sampled_from(fixed), st.integers(1, tier.max_cols))


@st.composite
def row_shapes(draw, tier: Tier, max_rows: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(full input shape, normalized_shape): 0-2 leading dims and a 1- or 2-dim normalised part; `max_rows` caps
    the rows (the leading dims' product) below what the tier's element budget allows."""
    n = draw(cols(tier))
    norm: tuple[int, ...] = (n,)
    if n > 1 and draw(st.booleans()):
        split = [d for d in range(2, min(n, 64) + 1) if n % d == 0]
        if split:
            d = draw(st.sampled_from(split))
            norm = (d, n // d)
    cap = max(1, tier.max_numel // n if max_rows is None else min(tier.max_numel // n, max_rows))
    rows = draw(st.one_of(st.sampled_from([r for r in AWKWARD_ROWS if r <= cap]), st.integers(1, cap)))
    lead: tuple[int, ...] = (rows,)
    if rows > 1 and draw(st.booleans()):
        for d in (2, 3, 5, 7):
            if rows % d == 0:
                lead = (d, rows // d)
                break
    if draw(st.integers(0, 9)) == 0:
        lead = lead + (0,)  # a zero-size batch now and then
    return lead + norm, norm


# Value families beyond N(0, 1), per row (the last dim): where a norm's statistics or a softmax's range are
# hard. "offset": a large common offset with small noise (mean and variance cancel); "ramp": a linear ramp;
# "near_constant": one value plus noise 1e-3 of it; "one_huge": one element per row 1e3 times the rest; "tiny":
# values around 1e-6 (fp16 subnormals); "zero_rows": every third row all zeros; "mixed": rows of alternating sign
# and scale.
FAMILIES = ("normal", "offset", "ramp", "near_constant", "one_huge", "tiny", "zero_rows", "mixed")
# Elementwise activations (GLU gates): "large": magnitudes 10..50 of either sign, where silu and gelu saturate and
# a naive exp(-g) or g^3 overflows in fp16; "tiny" as above.
GLU_FAMILIES = ("normal", "large", "tiny")


def _family(x: torch.Tensor, family: str, g: torch.Generator) -> torch.Tensor:
    """x (float64, drawn from N(0, scale^2)) reshaped into `family`'s values."""
    if family == "normal" or x.numel() == 0:
        return x
    n = x.shape[-1]
    if family == "offset":
        return 1e3 * (1 + torch.rand(x.shape[:-1] + (1,), generator=g, dtype=x.dtype, device=x.device)) + 0.01 * x
    if family == "ramp":
        return torch.linspace(-2.0, 3.0, n, dtype=x.dtype, device=x.device).expand(x.shape) + 0.01 * x
    if family == "near_constant":
        return 3.0 + 3e-3 * x
    if family == "one_huge":
        x = x.contiguous().clone()
        x[..., torch.randint(n, (1,), generator=g, device=x.device).item()] *= 1e3
        return x
    if family == "tiny":
        return 1e-6 * x
    if family == "large":  # ignores the scale: the saturated range is what matters
        sign = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
        return sign * (10 + 40 * torch.rand(x.shape, generator=g, dtype=x.dtype, device=x.device))
    if family == "zero_rows":
        x = x.contiguous().clone()
        if x.dim() > 1:
            x.view(-1, n)[::3] = 0.0
        return x
    if family == "mixed":
        signs = torch.where(torch.arange(n, device=x.device) % 2 == 0, 1.0, -1.0).to(x.dtype)
        return x.abs() * signs * torch.logspace(-2, 2, n, dtype=x.dtype, device=x.device)
    raise ValueError(family)


# Attention families, on float64 (B, S, H, D) q and k: where a softmax is hard. "large_range": q rescaled per head
# so the largest |logit| its queries see (after the softmax scale, before any softcap) is 30..80; "identical_keys":
# a head's keys all equal up to 1e-4 noise (which fp16 mostly rounds away), so the softmax is uniform and the
# output the mean of V; "one_dominant": each query row a multiple of one key it may see, its logit 60 and the
# others 60 cos(k_j, k_l) |k_l| / |k_j|: a margin of tens of nats (median ~30 at head dim 16, ~45 at 64; at 16 a
# few rows have a near rival), so the running max jumps where that key's block comes.
ATTENTION_FAMILIES = ("normal", "large_range", "identical_keys", "one_dominant")


def alibi_slopes(kind: str | None, batch: int, heads: int, seed: int, device) -> torch.Tensor | None:
    """ALiBi slopes for the attention and decode specs: None (kind None), (heads,) ("head") or (batch, heads)
    ("batch"), fp32 random in (0, 1], so some rows' biases span hundreds of logits and some barely move them."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(seed)
    shape = (heads,) if kind == "head" else (batch, heads)
    return (1.0 - torch.rand(shape, generator=g)).to(device)


def attention_family(q, k, family: str, g: torch.Generator, *, scale: float, visible: torch.Tensor | None = None):
    """(q, k), float64 (B, S, H, D) with kv heads dividing q heads, reshaped into `family`'s values. scale: the
    softmax scale; visible: (Sq, Sk) or (B, Sq, Sk) bool, the keys each query may see (default all)."""
    if family == "normal" or q.numel() == 0 or k.numel() == 0:
        return q, k
    if family == "identical_keys":
        return q, k[:, :1] + 1e-4 * k
    (b, sq, hq, d), sk = q.shape, k.shape[1]
    kr = k.repeat_interleave(hq // k.shape[2], dim=2)  # each q head's keys
    vis = torch.ones(sq, sk, dtype=torch.bool) if visible is None else visible.cpu()
    vis = vis.expand(b, sq, sk)[:, None]  # (B, 1, Sq, Sk): the same for every head
    if family == "large_range":
        s = scale * torch.einsum("bqhd,bkhd->bhqk", q, kr)
        top = s.masked_fill(~vis, 0.0).abs().amax(dim=(2, 3))  # (B, Hq)
        want = 30 + 50 * torch.rand(b, hq, generator=g, dtype=q.dtype)
        factor = (want / top).clamp(max=1e3)  # finite in fp16 where a head's queries see almost no logit
        return q * factor[:, None, :, None], k
    if family == "one_dominant":
        # each row's key: uniform among those it sees (any, where it sees none)
        pick = torch.rand(b, hq, sq, sk, generator=g, dtype=q.dtype).masked_fill(~vis, -1.0).argmax(-1)
        kj = torch.gather(kr.transpose(1, 2), 2, pick[..., None].expand(-1, -1, -1, d))  # (B, Hq, Sq, D)
        alpha = 60 / (scale * kj.pow(2).sum(-1, keepdim=True).clamp_min(1e-30))
        return (alpha * kj).transpose(1, 2), k
    raise ValueError(family)


def make_input(
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device,
    layout: str,
    *,
    scale: float = 1.0,
    seed: int = 0,
    family: str = "normal",
):
    """A tensor of `shape` in the requested memory layout: values from a seeded normal, shaped by `family`
    (FAMILIES) along the last dim of `shape`. Drawn on `device` (a seed gives other values on a GPU than on the
    CPU): made on the host, a GPU run's large inputs cost more than its kernels."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(s, swapped=False):  # swapped: s is the transposed layout's storage, its last two dims swapped
        x = torch.randn(s, generator=g, dtype=torch.float64, device=device) * scale
        if swapped:
            x = _family(x.transpose(-1, -2).contiguous(), family, g).transpose(-1, -2).contiguous()
        else:
            x = _family(x, family, g)
        if family != "normal" and dtype.is_floating_point:  # finite in the dtype (fp16's max is 65504)
            lim = torch.finfo(dtype).max / 4
            x = x.clamp(-lim, lim)
        return x.to(dtype=dtype, device=device)

    if layout == "contiguous" or len(shape) == 0:
        return randn(shape)
    if layout == "row_strided":  # rows are a slice of wider rows: stride(-2) > shape(-1)
        wide = randn(shape[:-1] + (shape[-1] + 3,))
        return wide[..., 1 : 1 + shape[-1]]
    if layout == "transposed":  # last dim is not unit-stride
        if len(shape) < 2:
            return randn(shape)
        t = randn(shape[:-2] + (shape[-1], shape[-2]), swapped=True)
        return t.transpose(-1, -2)
    raise ValueError(layout)


def numel(shape) -> int:
    return math.prod(shape)


def randn(*shape, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """A seeded standard normal tensor (drawn in float64 on the CPU, then cast and moved: the same values on every
    device)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)


def kv_cache(batch, capacity, heads, head_dim, dtype, device, *, paged: bool, seed: int, page: int = 16):
    """(k_cache, v_cache, block_table) holding `capacity` tokens per sequence: (batch, capacity, heads, head_dim),
    or paged (blocks, page, heads, head_dim) with shuffled pages plus spare ones and an int32 block table."""
    if not paged:
        shape = (batch, capacity, heads, head_dim)
        return (
            randn(*shape, dtype=dtype, device=device, seed=seed),
            randn(*shape, dtype=dtype, device=device, seed=seed + 1),
            None,
        )
    per_seq = cdiv(capacity, page)
    num_blocks = batch * per_seq + 3
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 2))
    table = order[: batch * per_seq].view(batch, per_seq).to(torch.int32).to(device)
    shape = (num_blocks, page, heads, head_dim)
    return (
        randn(*shape, dtype=dtype, device=device, seed=seed),
        randn(*shape, dtype=dtype, device=device, seed=seed + 1),
        table,
    )
