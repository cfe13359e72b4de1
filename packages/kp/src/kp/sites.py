"""The layers kp.optimize can serve in a model, and the inputs each one sees on the example batch."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.utils._pytree import tree_map


@dataclasses.dataclass
class Site:
    """One module of the model with candidates, and what it was called with on the example inputs."""

    name: str  # the module's qualified name in the model
    module: nn.Module  # the original object
    kind: str  # "rms_norm", "layer_norm", "gated_mlp", "linear", "attention"
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)

    @property
    def per_row(self) -> bool:
        """Each row of the input is computed alone (a norm, a linear, an MLP; not attention)."""
        return self.kind != "attention"

    def signature(self) -> str:
        """What a measured decision depends on: the module's class and settings, its parameters' and inputs'
        shapes and dtypes (not their values)."""
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in self.module.named_parameters()]
        inputs = [_describe(a) for a in (*self.args, *self.kwargs.values())]
        return f"{self.kind}|{type(self.module).__qualname__}|{self.module!r}|{params}|{inputs}"


def _describe(value) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return [_describe(v) for v in value]
    return repr(value) if isinstance(value, (int, float, bool, str, type(None))) else type(value).__name__


def _detached(value):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def _without_caches(kwargs: dict) -> dict:
    """A KV cache (transformers' Cache objects) grows at every call: each of a layer's test runs must start from
    none, as a training step does."""
    return {k: None if type(v).__name__.endswith("Cache") else v for k, v in kwargs.items()}


def capture(model: nn.Module, example_inputs: tuple, kinds: dict[str, str]) -> list[Site]:
    """Run `model(*example_inputs)` once without gradients and keep each listed module's first call's
    arguments. `kinds`: qualified name -> kind. Modules the example never calls are left out."""
    sites: dict[str, Site] = {}
    hooks = []

    def hook_for(name: str, kind: str):
        def hook(module, args, kwargs):
            if name not in sites:
                sites[name] = Site(name, module, kind, _detached(args), _detached(_without_caches(kwargs)))

        return hook

    for name, module in model.named_modules():
        if name in kinds:
            hooks.append(module.register_forward_pre_hook(hook_for(name, kinds[name]), with_kwargs=True))
    run_hooked(model, example_inputs, hooks)
    return [sites[name] for name in kinds if name in sites]


def run_hooked(model: nn.Module, example_inputs: tuple, hooks: list) -> None:
    """One forward pass without gradients, then the hooks (handles) removed, whatever happened."""
    try:
        with torch.no_grad():
            model(*example_inputs)
    finally:
        for h in hooks:
            h.remove()
