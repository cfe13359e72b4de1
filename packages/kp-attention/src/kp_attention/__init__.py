"""kp-attention: FlashAttention-style attention in Triton with torch's and FlashAttention's signatures."""

from kp_attention.functional import flash_attention, flash_attention_varlen, scaled_dot_product_attention
from kp_attention.ops.decode import flash_attention_with_kvcache
from kp_attention.patch import patch, unpatch

__version__ = "0.1.0"

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "patch",
    "scaled_dot_product_attention",
    "unpatch",
]
