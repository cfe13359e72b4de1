"""nn.Module forms of kp_losses' functions: torch.nn.CrossEntropyLoss's, and a loss that owns the head."""

from __future__ import annotations

from typing import Optional

import torch

from kp_losses import functional as F


class CrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss (class-index targets) with kp's kernels, plus z_loss and softcap
    (kp_losses.cross_entropy)."""

    def __init__(
        self,
        weight: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
    ):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap = z_loss, softcap

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(
            input,
            target,
            self.weight,
            self.ignore_index,
            self.reduction,
            self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"z_loss={self.z_loss}, softcap={self.softcap}"
        )


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of a linear head over hidden states, without the full logits (kp_losses.fused_linear_cross_entropy):
    `loss = LinearCrossEntropyLoss(model.lm_head)(hidden, target)` shares the head's weight and bias."""

    def __init__(
        self,
        head: torch.nn.Linear,
        ce_weight: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        *,
        z_loss: float = 0.0,
        softcap: Optional[float] = None,
        chunk_size: Optional[int] = None,
    ):
        super().__init__()
        if not isinstance(head, torch.nn.Linear):
            raise TypeError(f"LinearCrossEntropyLoss: head must be a torch.nn.Linear, got {type(head).__name__}")
        self.head = head
        self.register_buffer("ce_weight", ce_weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.chunk_size = z_loss, softcap, chunk_size

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.fused_linear_cross_entropy(
            hidden,
            self.head.weight,
            target,
            self.head.bias,
            self.ce_weight,
            self.ignore_index,
            self.reduction,
            self.label_smoothing,
            z_loss=self.z_loss,
            softcap=self.softcap,
            chunk_size=self.chunk_size,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"z_loss={self.z_loss}, softcap={self.softcap}, chunk_size={self.chunk_size}"
        )
