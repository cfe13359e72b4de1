"""kp-attention: FlashAttention-style attention in Triton with torch's and FlashAttention's signatures."""

__version__ = "0.1.0"

__all__: list[str] = []
