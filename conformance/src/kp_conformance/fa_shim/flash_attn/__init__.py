"""`flash_attn` for FlashAttention's own test suite, resolved to kp_attention.flash_attn (nox -s fa-suite puts this
package's parent folder first on sys.path). Besides the public functions the tests import three helper modules of
FlashAttention's, which this package provides in plain PyTorch: bert_padding, layers.rotary, flash_attn_interface."""

from kp_attention.flash_attn import (  # noqa: F401
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__version__ = "2.8.0+kp"
