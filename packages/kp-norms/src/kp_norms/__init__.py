"""kp-norms: normalisation kernels in Triton with torch.nn.functional's signatures."""

from kp_norms.functional import (
    GLUFloat8,
    NormFloat8,
    add_layer_norm,
    add_rms_norm,
    geglu,
    geglu_packed,
    glu_float8,
    layer_norm,
    norm_float8,
    rms_norm,
    swiglu,
    swiglu_packed,
)
from kp_norms.modules import GatedMLP, LayerNorm, RMSNorm
from kp_norms.patch import patch, unpatch

__version__ = "0.2.1"

__all__ = [
    "GLUFloat8",
    "GatedMLP",
    "LayerNorm",
    "NormFloat8",
    "RMSNorm",
    "add_layer_norm",
    "add_rms_norm",
    "geglu",
    "geglu_packed",
    "glu_float8",
    "layer_norm",
    "norm_float8",
    "patch",
    "rms_norm",
    "swiglu",
    "swiglu_packed",
    "unpatch",
]
