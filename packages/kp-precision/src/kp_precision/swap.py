"""Swapping a model's nn.Linear layers: the walk the conversions (float8 training and inference, QAT) share."""

import warnings

from torch import nn


def needs_16(linear: nn.Linear) -> str | None:
    """Why a float8 matmul cannot take this layer (None: it can)."""
    if linear.in_features % 16 or linear.out_features % 16:
        return "float8 matmuls need in_features and out_features that are multiples of 16"
    return None


def swap_linears(model, caller, module_filter_fn, make, verbose, label, unfit=needs_16) -> nn.Module:
    """Replace each nn.Linear that module_filter_fn(module, fqn) picks (all if None) by make(linear), in place.
    Layers for which unfit(linear) gives a reason stay, named in one warning; verbose prints what was converted."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{caller}: model must be an nn.Module, got {type(model).__name__}")
    converted, skipped = [], []
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            path = f"{fqn}.{name}" if fqn else name
            if type(child) is not nn.Linear or (module_filter_fn is not None and not module_filter_fn(child, path)):
                continue
            reason = unfit(child)
            if reason:
                skipped.append(f"{path} ({child.in_features} -> {child.out_features}: {reason})")
                continue
            setattr(module, name, make(child))
            converted.append(path)
    if skipped:
        warnings.warn(f"{caller}: kept as nn.Linear: {', '.join(skipped)}", stacklevel=3)
    if verbose:
        print(f"{caller} ({label}): {len(converted)} layers")
        for path in converted:
            print(f"  {path}")
    return model
