"""The tolerance rule kp holds its kernels to: at most twice as far from float64 as PyTorch's own low-precision
computation, plus one ulp of the output's dtype at the output's scale."""

from __future__ import annotations

import torch

# The float64 reference is itself rounded: its reductions (sums of up to ~1e8 terms, pairwise) are good to
# a few dozen float64 ulps. Negligible beside fp32/fp16/bf16, it is what bounds a float64 kernel.
REFERENCE_ULPS = 32


def atol_for(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """One ulp of `dtype` at the output's scale (the final store's rounding) plus the reference's own error.

    Args:
        dtype: the output's floating-point dtype.
        ref: the float64 reference output, any shape; its largest finite magnitude (at least 1) is the scale.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> round(kp_core.atol_for(torch.bfloat16, torch.tensor([0.5, -4.0], dtype=torch.float64)), 6)
        0.03125
    """
    finite = ref[torch.isfinite(ref)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    return (torch.finfo(dtype).eps + REFERENCE_ULPS * torch.finfo(torch.float64).eps) * max(1.0, scale)


def rule_bound(ours: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(max |ours - ref64|, the rule's bound 2 * max |lowp - ref64| + atol); NaN in `ours` gives an infinite error.

    A kernel passes where the error is at most the bound.

    Args:
        ours: the kernel's output, any floating-point dtype.
        ref64: the float64 reference, ours' shape.
        lowp: PyTorch's own computation in the low precision, ours' shape.
        dtype: the output's dtype, for atol_for.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> ref64 = torch.tensor([1.0, 2.0], dtype=torch.float64)
        >>> lowp = torch.tensor([1.0, 2.0078125])
        >>> err, bound = kp_core.rule_bound(torch.tensor([1.0, 2.0]), ref64, lowp, torch.float32)
        >>> err <= bound
        True
    """
    if ours.numel() == 0:
        return 0.0, 0.0
    ours64, lowp64, ref64 = (t.detach().to(torch.float64) for t in (ours, lowp, ref64))
    err = (ours64 - ref64).abs().max().item()
    err = float("inf") if torch.isnan(ours64).any() else err
    return err, 2 * (lowp64 - ref64).abs().max().item() + atol_for(dtype, ref64)
