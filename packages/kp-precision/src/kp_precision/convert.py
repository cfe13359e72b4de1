"""Swapping a model's nn.Linear layers: the walk both float8 conversions (training, inference) share."""

import warnings

from torch import nn


def swap_linears(model: nn.Module, caller: str, module_filter_fn, make, verbose: bool, label: str) -> nn.Module:
    """Replace each nn.Linear that module_filter_fn(module, fqn) picks (all if None) by make(linear), in place.
    Layers whose in_features or out_features is not a multiple of 16 (float8 tensor cores) stay and are named
    in one warning; verbose prints what was converted."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be an nn.Module, got {type(model).__name__}")
    converted, skipped = [], []
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            path = f"{fqn}.{name}" if fqn else name
            if type(child) is not nn.Linear or (module_filter_fn is not None and not module_filter_fn(child, path)):
                continue
            if child.in_features % 16 or child.out_features % 16:
                skipped.append(f"{path} ({child.in_features} -> {child.out_features})")
                continue
            setattr(module, name, make(child))
            converted.append(path)
    if skipped:
        warnings.warn(
            f"{caller}: kept as nn.Linear (float8 matmuls need in_features and out_features that are multiples "
            f"of 16): {', '.join(skipped)}",
            stacklevel=3,
        )
    if verbose:
        print(f"{caller} ({label}): {len(converted)} layers")
        for path in converted:
            print(f"  {path}")
    return model
