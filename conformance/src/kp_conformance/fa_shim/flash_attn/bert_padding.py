"""FlashAttention's padding helpers, in plain PyTorch: (batch, seqlen, ...) <-> packed (total, ...)."""

import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(packed rows, their flat indices, cu_seqlens int32, the longest sequence, tokens used per sequence)."""
    masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """The packed rows back at their indices of a zero (batch, seqlen, ...) tensor."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
