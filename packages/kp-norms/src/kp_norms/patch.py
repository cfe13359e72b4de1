"""Swap torch.nn norm modules for kp's in place, and back."""

from __future__ import annotations

from torch import nn

from kp_norms.modules import RMSNorm

_ORIGINAL = "_kp_original"


def _to_kp(module: nn.RMSNorm) -> RMSNorm:
    new = RMSNorm.__new__(RMSNorm)
    nn.Module.__init__(new)
    new.normalized_shape = tuple(module.normalized_shape)
    new.eps = module.eps
    new.elementwise_affine = module.elementwise_affine
    new.weight = module.weight  # shared Parameter: optimizer state and state_dict keys stay valid
    object.__setattr__(new, _ORIGINAL, module)
    return new


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def patch(model: nn.Module, *, rms_norm: bool = True) -> list[str]:
    """Replace every `torch.nn.RMSNorm` in `model` with `kp_norms.RMSNorm`; return the names changed.

    The parameters are shared, not copied, so `unpatch` restores the original modules exactly.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"kp_norms.patch: model must be a torch.nn.Module, got {type(model).__name__}")
    changed = []
    if rms_norm:
        for name, module in list(model.named_modules()):
            if type(module) is nn.RMSNorm and name:
                _replace(model, name, _to_kp(module))
                changed.append(name)
    return changed


def unpatch(model: nn.Module) -> list[str]:
    """Put back the modules `patch` replaced; return the names restored."""
    restored = []
    for name, module in list(model.named_modules()):
        original = getattr(module, _ORIGINAL, None)
        if original is not None and name:
            original.weight = module.weight
            _replace(model, name, original)
            restored.append(name)
    return restored
