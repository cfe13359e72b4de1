"""kp-losses: cross-entropy and fused linear + cross-entropy in Triton, with torch.nn.functional's signature."""

from kp_losses.functional import cross_entropy, fused_linear_cross_entropy
from kp_losses.modules import CrossEntropyLoss, LinearCrossEntropyLoss
from kp_losses.patch import patch, patchable, unpatch

__version__ = "0.1.0"

__all__ = [
    "CrossEntropyLoss",
    "LinearCrossEntropyLoss",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "patch",
    "patchable",
    "unpatch",
]
