"""kp-attention: FlashAttention-style attention in Triton with torch's and FlashAttention's signatures."""

from kp_attention.functional import (
    flash_attention,
    flash_attention_varlen,
    flash_attention_with_kvcache,
    scaled_dot_product_attention,
)
from kp_attention.patch import patch, register, unpatch

__version__ = "0.2.0"

__all__ = [
    "flash_attention",
    "flash_attention_varlen",
    "flash_attention_with_kvcache",
    "patch",
    "register",
    "scaled_dot_product_attention",
    "unpatch",
]
