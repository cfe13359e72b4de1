"""Attention dropout as FlashAttention defines it: out = ((softmax(s) * keep) / (1 - p)) @ v, lse unchanged.

keep is drawn per (batch b, q head h, query row i, key j) of each sequence from Philox-4x32-10 (Salmon et al.,
SC'11, the generator of torch's CUDA RNG and Triton's tl.philox) keyed by a 64-bit seed, with the counter
(j, i, b * Hq + h, 0); an element is kept when the top 24 bits of the first output word are >= round(p * 2^24).
The kernels (attention_blocks.dropout_keep) draw it in the forward and again in the backward, so no mask is stored.

The seed is a one-element int64 tensor drawn from torch's generator on the inputs' device (draw_seed) before the
op runs: `torch.manual_seed` reproduces it, and a CUDA graph that captured the draw draws a new seed on each
replay, as torch's own dropout does. keep_mask is the same draw in PyTorch, for the reference path and for the
probabilities FlashAttention's `return_attn_probs` hands to tests.
"""

import torch

KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85  # Weyl increments of the key
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57  # round multipliers
MASK32 = 0xFFFFFFFF
BITS = 24  # the uniform's bits compared with the threshold


def draw_seed(device: torch.device) -> torch.Tensor:
    return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)


def threshold(p: float) -> int:
    """keep iff the 24-bit draw >= this: p = 0 keeps all, p = 1 none."""
    return round(p * (1 << BITS))


def keep_scale(p: float) -> float:
    """1 / (1 - p), and 0 for p = 1 (everything dropped: out 0, as torch's dropout gives)."""
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product a * b (b's values in [0, 2^32)), in int64 without overflow:
    16-bit limbs."""
    a1, a0 = a >> 16, a & 0xFFFF
    b1, b0 = b >> 16, b & 0xFFFF
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    lo = ((mid & 0xFFFF) << 16) | (p00 & 0xFFFF)
    hi = (p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)) & MASK32
    return hi, lo


def philox(seed: int, c0, c1, c2, c3, rounds: int = 10) -> tuple[torch.Tensor, ...]:
    """Philox-4x32 of counters c0..c3 (int64 tensors of 32-bit values, broadcast together) under the 64-bit key
    `seed`: the four output words as int64 tensors in [0, 2^32)."""
    device = next((c.device for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)), None)
    c0, c1, c2, c3 = torch.broadcast_tensors(
        *(torch.as_tensor(c, dtype=torch.int64, device=device) & MASK32 for c in (c0, c1, c2, c3))
    )
    k0, k1 = seed & MASK32, (seed >> 32) & MASK32
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + KEY_A) & MASK32, (k1 + KEY_B) & MASK32
    return c0, c1, c2, c3


def keep_mask(seed: torch.Tensor, bh: torch.Tensor, sq: int, sk: int, p: float) -> torch.Tensor:
    """(len(bh), sq, sk) bool: which probabilities dropout keeps (the kernels' draw) for the (batch, q head)s
    numbered bh = b * Hq + h (a 1-D tensor on seed's device; b is the sequence's index when packed)."""
    i = torch.arange(sq, device=seed.device).view(1, sq, 1)
    j = torch.arange(sk, device=seed.device).view(1, 1, sk)
    word = philox(int(seed.reshape(-1)[0]), j, i, bh.view(-1, 1, 1), 0)[0]
    return (word >> (32 - BITS)) >= threshold(p)
