"""kp-attention: FlashAttention-style attention in Triton with torch's and FlashAttention's signatures."""

from kp_attention.flex import BlockMask, and_masks, create_block_mask, flex_attention, noop_mask, or_masks
from kp_attention.functional import (
    flash_attention,
    flash_attention_varlen,
    flash_attention_with_kvcache,
    scaled_dot_product_attention,
)
from kp_attention.patch import patch, register, unpatch

__version__ = "0.2.2"

__all__ = [
    "BlockMask",
    "and_masks",
    "create_block_mask",
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "flex_attention",
    "noop_mask",
    "or_masks",
    "patch",
    "register",
    "scaled_dot_product_attention",
    "unpatch",
]
