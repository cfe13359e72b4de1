"""Model conversions: each swaps a model's nn.Linear layers (or QAT layers) for kp-precision's, in place.

    convert_to_float8_training   nn.Linear -> Float8Linear (kp_precision.training), or "auto": where measured
                                 faster (kp_precision.auto)
    convert_to_float8_inference  nn.Linear -> Float8InferenceLinear (kp_precision.inference)
    prepare_qat / convert        nn.Linear -> QATLinear -> QuantizedLinear (kp_precision.qat)

torchao's shape: `convert_*(model, *, module_filter_fn=(module, fqn) -> bool, ...)`. They share one walk,
swap_linears, which keeps the layers a conversion cannot take and names them in one warning.
"""

import warnings

from torch import nn

import kp_core
from kp_precision.auto import auto_filter
from kp_precision.inference import Float8InferenceLinear
from kp_precision.qat import DEFAULT_GROUP, QATLinear, QuantizedLinear, check_formats
from kp_precision.recipes import RECIPES, Float8Config
from kp_precision.shared import unaligned
from kp_precision.training import Float8Linear


def swap_linears(model, caller, module_filter_fn, make, verbose, label, unfit=unaligned) -> nn.Module:
    """Replace each nn.Linear that module_filter_fn(module, fqn) picks (all if None) by make(linear), in place.
    Layers for which unfit(linear) gives a reason stay, named in one warning; verbose prints what was converted."""
    kp_core.check_module(caller, "model", model)
    kp_core.check_callable(caller, "module_filter_fn", module_filter_fn)
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


def convert_to_float8_training(
    model: nn.Module,
    *,
    module_filter_fn=None,
    recipe: str | None = None,
    config: Float8Config | None = None,
    verbose: bool = False,
) -> nn.Module:
    """Swap model's nn.Linear layers for Float8Linear in place (sharing their parameters) and return model.

    `module_filter_fn(module, fqn) -> bool` picks layers (all by default; "auto": those measured faster in
    float8 on their GPU, see kp_precision.auto_filter); `recipe` is a shortcut for `Float8Config(recipe=...)`,
    `config` the whole setting. Layers whose in_features or out_features is not a multiple of 16 stay nn.Linear
    (one warning names them); `verbose=True` prints each converted layer.

    The converted layers take (*, in_features) in float16, bfloat16 or float32.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
        >>> model = kp_precision.convert_to_float8_training(model, recipe="rowwise")
        >>> model[0]
        Float8Linear(in_features=64, out_features=128, bias=True, recipe=rowwise, scaling=dynamic)
        >>> model(torch.randn(8, 64)).shape
        torch.Size([8, 64])
    """
    if recipe is not None and config is not None:
        raise ValueError("convert_to_float8_training: give recipe or config, not both")
    config = config or Float8Config(recipe=recipe or "tensorwise")
    if isinstance(module_filter_fn, str):
        if module_filter_fn != "auto":
            raise ValueError(
                f"convert_to_float8_training: module_filter_fn must be a callable, None or 'auto', "
                f"got {module_filter_fn!r}"
            )
        module_filter_fn = auto_filter(config)
    make = lambda linear: Float8Linear.from_linear(linear, config=config)  # noqa: E731
    label = f"{config.recipe}, {config.scaling}"
    return swap_linears(model, "convert_to_float8_training", module_filter_fn, make, verbose, label)


def convert_to_float8_inference(
    model: nn.Module, *, module_filter_fn=None, recipe="rowwise", verbose=False
) -> nn.Module:
    """Swap model's nn.Linear layers for Float8InferenceLinear in place (weights cast once) and return model.

    `module_filter_fn(module, fqn) -> bool` picks layers (all by default); layers whose in_features or
    out_features is not a multiple of 16 stay nn.Linear (one warning names them); `verbose=True` prints each
    converted layer. `recipe`: "tensorwise", "rowwise" or "blockwise" (Float8InferenceLinear's).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        >>> with torch.no_grad():
        ...     model = kp_precision.convert_to_float8_inference(model)  # warns: 128 -> 10 stays nn.Linear
        >>> type(model[0]).__name__, type(model[2]).__name__
        ('Float8InferenceLinear', 'Linear')
    """
    if recipe not in RECIPES:
        raise ValueError(f"convert_to_float8_inference: recipe must be one of {RECIPES}, got {recipe!r}")
    make = lambda linear: Float8InferenceLinear.from_linear(linear, recipe=recipe)  # noqa: E731
    return swap_linears(model, "convert_to_float8_inference", module_filter_fn, make, verbose, recipe)


def prepare_qat(model: nn.Module, *, weight="int4", group_size="default", activation=None, module_filter_fn=None,
                verbose=False) -> nn.Module:  # fmt: skip
    """Swap model's nn.Linear layers for QATLinear in place (sharing their parameters) and return model.
    `weight`: 'int4' (groups of 32 by default), 'int8' (per row by default) or 'fp8' (per row); `group_size`:
    a power of two dividing in_features, or None for per-row scales; `activation`: None, 'int8' or 'fp8'.
    `module_filter_fn(module, fqn) -> bool` picks layers (all by default); layers whose in_features the group
    does not divide stay nn.Linear (one warning names them).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        >>> model = kp_precision.prepare_qat(model, weight="int4", activation="int8")
        >>> model[0]
        QATLinear(in_features=64, out_features=64, bias=True, weight_dtype=int4, group_size=32, activation=int8)
    """
    group = DEFAULT_GROUP.get(weight) if group_size == "default" else group_size
    check_formats("prepare_qat", weight, activation, group)
    make = lambda lin: QATLinear.from_linear(lin, weight_dtype=weight, group_size=group, activation=activation)  # noqa: E731

    def unfit(lin):
        if group and lin.in_features % group:
            return f"in_features is not a multiple of group_size {group}"
        return None

    label = f"{weight}, activation {activation}"
    return swap_linears(model, "prepare_qat", module_filter_fn, make, verbose, label, unfit)


def convert(model: nn.Module, *, verbose=False) -> nn.Module:
    """Swap model's QATLinear layers for QuantizedLinear in place and return model (the weights quantised once,
    to exactly the values the QAT model trained with).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> model = kp_precision.prepare_qat(torch.nn.Sequential(torch.nn.Linear(64, 64)))
        >>> x = torch.randn(4, 64)
        >>> before = model(x)  # ... after QAT training
        >>> model = kp_precision.convert(model)
        >>> model[0]
        QuantizedLinear(in_features=64, out_features=64, int4, group_size=32)
        >>> torch.allclose(model(x), before)
        True
    """
    kp_core.check_module("convert", "model", model)
    converted = []
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, QATLinear):
                setattr(module, name, QuantizedLinear(child))
                converted.append(f"{fqn}.{name}" if fqn else name)
    if verbose:
        print(f"convert: {len(converted)} layers")
        for path in converted:
            print(f"  {path}")
    return model
