"""FlashAttention's apply_rotary_emb in plain PyTorch (fp32 maths rounded once to x's dtype, as its kernel): the
reference its kvcache test rotates with, written apart from kp_attention's own rotation."""

import torch


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None):
    """x (batch, seqlen, heads, dim); cos, sin (rows, rotary_dim / 2). Token t of sequence b takes row
    t + seqlen_offsets (an int or a (batch,) tensor); its first rotary_dim dims rotate in halves (GPT-NeoX) or
    in pairs (interleaved)."""
    if cu_seqlens is not None:
        raise NotImplementedError("apply_rotary_emb: cu_seqlens (packed x) is not provided by kp's test shim")
    batch, seqlen = x.shape[:2]
    offsets = torch.as_tensor(seqlen_offsets, device=x.device).reshape(-1, 1)
    rows = (torch.arange(seqlen, device=x.device)[None, :] + offsets).expand(batch, seqlen)
    c, s = cos.float()[rows][:, :, None], sin.float()[rows][:, :, None]  # (batch, seqlen, 1, rotary_dim / 2)
    half = cos.shape[-1]
    xf = x.float()
    part = xf[..., : 2 * half]
    if interleaved:
        even, odd = part[..., 0::2], part[..., 1::2]
        part = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    else:
        first, second = part[..., :half], part[..., half:]
        part = torch.cat((first * c - second * s, first * s + second * c), dim=-1)
    out = torch.cat((part, xf[..., 2 * half :]), dim=-1).to(x.dtype)
    if inplace:
        x.copy_(out)
        return x
    return out
