"""The tolerance rule kp holds its kernels to: at most twice as far from float64 as PyTorch's own low-precision
computation, plus one ulp of the output's dtype at the output's scale."""

from __future__ import annotations

import torch

# The float64 reference is itself rounded: its reductions (sums of up to ~1e8 terms, pairwise) are good to
# a few dozen float64 ulps. Negligible beside fp32/fp16/bf16, it is what bounds a float64 kernel.
REFERENCE_ULPS = 32


def atol_for(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """One ulp of `dtype` at the output's scale (the final store's rounding) plus the reference's own error."""
    finite = ref[torch.isfinite(ref)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    return (torch.finfo(dtype).eps + REFERENCE_ULPS * torch.finfo(torch.float64).eps) * max(1.0, scale)


def rule_bound(ours: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(max |ours - ref64|, the rule's bound 2 * max |lowp - ref64| + atol); NaN in `ours` gives an infinite error."""
    if ours.numel() == 0:
        return 0.0, 0.0
    ours64, lowp64, ref64 = (t.detach().to(torch.float64) for t in (ours, lowp, ref64))
    err = (ours64 - ref64).abs().max().item()
    err = float("inf") if torch.isnan(ours64).any() else err
    return err, 2 * (lowp64 - ref64).abs().max().item() + atol_for(dtype, ref64)
