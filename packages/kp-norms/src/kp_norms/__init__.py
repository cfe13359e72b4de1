"""kp-norms: normalisation kernels in Triton with torch.nn.functional's signatures."""

from kp_norms.modules import RMSNorm
from kp_norms.ops.rms_norm import rms_norm
from kp_norms.patch import patch, unpatch

__version__ = "0.1.0"

__all__ = ["RMSNorm", "patch", "rms_norm", "unpatch"]
