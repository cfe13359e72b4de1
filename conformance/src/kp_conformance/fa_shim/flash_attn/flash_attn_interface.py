"""What FlashAttention's tests import from its interface module besides the public functions."""

from kp_attention.flash_attn import *  # noqa: F401,F403

USE_TRITON_ROCM = False


def _get_block_size_n(device, head_dim, is_dropout, is_causal) -> int:
    """The key block FlashAttention's tests normalise S_dmask by. kp's S_dmask holds exp(s - the row's max) over the
    whole row (kp_attention.flash_attn), so one block spans every key."""
    return 1 << 30
