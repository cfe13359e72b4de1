"""The tolerance rule: ours may be at most twice as far from float64 as PyTorch's own low-precision op."""

from __future__ import annotations

import torch

from kp_core.tolerance import atol_for, rule_bound


def check_close(what: str, ours: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor, dtype: torch.dtype) -> None:
    """Assert max|ours - ref64| <= 2 * max|lowp - ref64| + atol; same shape and dtype as lowp; no NaN."""
    assert ours.shape == ref64.shape, f"{what}: shape {tuple(ours.shape)} != reference {tuple(ref64.shape)}"
    assert ours.dtype == lowp.dtype, f"{what}: dtype {ours.dtype} != PyTorch's {lowp.dtype}"
    if ours.numel() == 0:
        return
    ours64, lowp64 = ours.detach().to(torch.float64).cpu(), lowp.detach().to(torch.float64).cpu()
    ref64 = ref64.detach().cpu()
    assert not torch.isnan(ours64).any(), f"{what}: {int(torch.isnan(ours64).sum())} NaN in our output"
    # a NaN reference would pass any output (NaN compares false): the reference must be finite where it judges
    assert not torch.isnan(ref64).any(), f"{what}: {int(torch.isnan(ref64).sum())} NaN in the float64 reference"
    err = (ours64 - ref64).abs()
    _, bound = rule_bound(ours64, ref64, lowp64, dtype)
    if err.max().item() > bound:
        atol = atol_for(dtype, ref64)
        err_lowp = (bound - atol) / 2
        i = int(err.argmax())
        at = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), err.shape)) if err.dim() else ()
        raise AssertionError(
            f"{what} ({dtype}): max err {err.max().item():.3e} (mean {err.mean().item():.3e}) > bound {bound:.3e} "
            f"= 2 * torch err {err_lowp:.3e} + atol {atol:.3e}; worst at {at}: ours {ours64.flatten()[i].item():.9g}, "
            f"float64 {ref64.flatten()[i].item():.9g}, torch {lowp64.flatten()[i].item():.9g}"
        )


def check_decode(what: str, out, lse, q, k_cache, v_cache, lens, dtype, **kw) -> None:
    """KV-cache attention by the rule (kp_conformance.references.decode): out against float64 and PyTorch in q's
    dtype; lse against float64 and logsumexp of the scores PyTorch forms in q's dtype; rows that see no key are 0
    with lse -inf."""
    from kp_conformance.references import attention64, attention_lowp, decode, lse_lowp

    ref, ref_lse = decode(attention64, q, k_cache, v_cache, lens, **kw)
    check_close(f"{what} out", out, ref, decode(attention_lowp, q, k_cache, v_cache, lens, **kw), dtype)
    assert torch.equal(lse.isinf().cpu(), ref_lse.isinf().cpu()), f"{what}: rows with no visible key differ"
    fin = ~ref_lse.isinf()
    low_lse = decode(lambda q, k, v, **a: lse_lowp(q, k, **a), q, k_cache, v_cache, lens, **kw)
    check_close(f"{what} lse", lse[fin], ref_lse[fin], low_lse[fin], torch.float32)
    assert (out[ref_lse.transpose(1, 2).isinf()] == 0).all(), f"{what}: rows with no visible key must be 0"
