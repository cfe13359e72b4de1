"""nn.Module forms of kp_losses' functions: torch.nn.CrossEntropyLoss's, and a loss that owns the head."""

from __future__ import annotations

from typing import Optional

import torch

import kp_core
from kp_losses import functional as F


class CrossEntropyLoss(torch.nn.Module):
    """torch.nn.CrossEntropyLoss (class-index targets) with kp's kernels, plus z_loss and softcap
    (kp_losses.cross_entropy).

    Examples:
        >>> import torch
        >>> import kp_losses
        >>> loss_fn = kp_losses.CrossEntropyLoss(label_smoothing=0.1)
        >>> logits, target = torch.randn(4, 10), torch.tensor([1, 0, -100, 9])
        >>> want = torch.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, target)
        >>> torch.allclose(loss_fn(logits, target), want, atol=1e-5)
        True
    """

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
        F._check_options("kp_losses.CrossEntropyLoss", reduction, label_smoothing, z_loss, softcap, ignore_index)
        if weight is not None:
            kp_core.check_tensor("kp_losses.CrossEntropyLoss", "weight", weight, dtypes=kp_core.FLOAT_DTYPES, ndim=1)
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
    `loss = LinearCrossEntropyLoss(model.lm_head)(hidden, target)` shares the head's weight and bias.

    Examples:
        >>> import torch
        >>> import kp_losses
        >>> head = torch.nn.Linear(8, 20)
        >>> hidden, target = torch.randn(6, 8), torch.tensor([1, 2, 3, -100, 5, 19])
        >>> loss = kp_losses.LinearCrossEntropyLoss(head)(hidden, target)
        >>> torch.allclose(loss, torch.nn.functional.cross_entropy(head(hidden), target), atol=1e-5)
        True
    """

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
        float8: Optional[str] = None,
    ):
        super().__init__()
        op = "kp_losses.LinearCrossEntropyLoss"
        if not isinstance(head, torch.nn.Linear):
            raise TypeError(f"{op}: head must be a torch.nn.Linear, got {type(head).__name__}")
        F._check_options(op, reduction, label_smoothing, z_loss, softcap, ignore_index)
        F._check_chunk_size(op, chunk_size)
        F._check_recipe(op, float8)
        if ce_weight is not None:
            kp_core.check_tensor(op, "ce_weight", ce_weight, dtypes=kp_core.FLOAT_DTYPES, ndim=1)
        self.head = head
        self.register_buffer("ce_weight", ce_weight)
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
        self.z_loss, self.softcap, self.chunk_size, self.float8 = z_loss, softcap, chunk_size, float8

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
            float8=self.float8,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}, "
            f"z_loss={self.z_loss}, softcap={self.softcap}, chunk_size={self.chunk_size}, float8={self.float8!r}"
        )
