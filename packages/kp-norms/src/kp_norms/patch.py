"""Swap norm and gated-MLP modules for kp's in place, and back: torch.nn and Hugging Face transformers models.

Modules are matched by exact class (a subclass may override `forward`, so it is left alone):

    torch.nn.RMSNorm                                -> RMSNorm                      torch's rounding
    torch.nn.LayerNorm                              -> LayerNorm
    {Llama,Mistral,Qwen2,Qwen3}RMSNorm              -> RMSNorm(casting="llama")     w * fp32_norm(x).to(x.dtype)
    Gemma{,2,3}RMSNorm                              -> RMSNorm(offset=1.0)          (fp32_norm(x) * (1 + w)).to(x.dtype)
    {Llama,Mistral,Qwen2,Qwen3,Gemma,Gemma2,Gemma3}MLP -> GatedMLP              down(act(gate(x)) * up(x)), fused gate

The transformers classes are looked up in the modules already imported (a model holding one has imported
its module), so transformers is never imported here and stays an optional extra; families the installed
version lacks are simply absent. A gated MLP's activation is identified by evaluating its `act_fn`; one that is
not SiLU, GELU or GELU-tanh is left alone, with a warning.

The new modules hold the original Parameters and child modules (shared, not copied): state_dict keys,
optimizer state and tied weights stay valid, and `unpatch` puts back the original module objects.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

import kp_core
from kp_norms.modules import GatedMLP, LayerNorm, RMSNorm

_ORIGINAL = "_kp_original"

# transformers class -> what it becomes. Each forward was read in transformers 4.45 and 5.x (the same maths):
#   Llama-style: h = x.float(); h = h * rsqrt(mean(h**2) + variance_epsilon); return weight * h.to(x.dtype)
#   Gemma-style: h = x.float(); h = h * rsqrt(mean(h**2) + eps); return (h * (1.0 + weight.float())).type_as(x)
#   MLPs:        down_proj(act_fn(gate_proj(x)) * up_proj(x))
_LLAMA_NORMS = ("llama:LlamaRMSNorm", "mistral:MistralRMSNorm", "qwen2:Qwen2RMSNorm", "qwen3:Qwen3RMSNorm")
_GEMMA_NORMS = ("gemma:GemmaRMSNorm", "gemma2:Gemma2RMSNorm", "gemma3:Gemma3RMSNorm")
_MLPS = tuple(
    f"{family}:{cls}MLP"
    for family, cls in [("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3")]
    + [("gemma", "Gemma"), ("gemma2", "Gemma2"), ("gemma3", "Gemma3")]
)

# Activations a gated MLP may use, as kp names them, and PyTorch's definition of each.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
# GELU and GELU-tanh differ by up to ~5e-4 on [-6, 6]; float64 implementations of one function by ~1e-16.
_PROBE = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)


def _hf_class(spec: str) -> type | None:
    family, name = spec.split(":")
    module = sys.modules.get(f"transformers.models.{family}.modeling_{family}")
    cls = getattr(module, name, None) if module is not None else None
    return cls if isinstance(cls, type) else None


def _activation(act_fn: object) -> str | None:
    """kp's name for what `act_fn` computes, or None when it is none of them (or has state of its own)."""
    if not callable(act_fn):
        return None
    if isinstance(act_fn, nn.Module) and any(True for _ in [*act_fn.parameters(), *act_fn.buffers()]):
        return None  # learnable or stateful: not a fixed function
    try:
        with torch.no_grad():
            y = act_fn(_PROBE.clone())
    except Exception:  # an activation that cannot run on a CPU float64 tensor is not one we know
        return None
    if not isinstance(y, torch.Tensor) or y.shape != _PROBE.shape:
        return None
    y = y.to(torch.float64)
    for name, fn in _ACTIVATIONS.items():
        if torch.allclose(y, fn(_PROBE), rtol=1e-6, atol=1e-9):
            return name
    return None


def _adopt(new: nn.Module, old: nn.Module) -> nn.Module:
    """Give `new` the Parameters and child modules of `old` that it has slots for, and its train/eval mode."""
    for name, param in old._parameters.items():
        if name in new._parameters:
            new._parameters[name] = param
    for name, child in old._modules.items():
        if name in new._modules:
            new._modules[name] = child
    new.train(old.training)
    return new


def _to_rms_norm(module: nn.Module, eps: float | None, **variant) -> RMSNorm:
    weight = module.weight
    shape = tuple(module.normalized_shape) if isinstance(module, nn.RMSNorm) else tuple(weight.shape)
    new = RMSNorm(shape, eps, elementwise_affine=weight is not None, **variant, device="meta")
    return _adopt(new, module)


def _to_layer_norm(module: nn.LayerNorm) -> LayerNorm:
    new = LayerNorm(
        module.normalized_shape,
        module.eps,
        elementwise_affine=module.elementwise_affine,
        bias=module.bias is not None,
        device="meta",
    )
    return _adopt(new, module)


def _to_gated_mlp(module: nn.Module, activation: str) -> GatedMLP:
    new = GatedMLP.from_modules(module.gate_proj, module.up_proj, module.down_proj, activation=activation)
    new.train(module.training)
    return new


def _converters(rms_norm: bool, layer_norm: bool, swiglu: bool) -> dict[type, Callable[[nn.Module], nn.Module]]:
    table: dict[type, Callable[[nn.Module], nn.Module]] = {}
    if rms_norm:
        table[nn.RMSNorm] = lambda m: _to_rms_norm(m, m.eps)
        for cls in filter(None, map(_hf_class, _LLAMA_NORMS)):
            table[cls] = lambda m: _to_rms_norm(m, m.variance_epsilon, casting="llama")
        for cls in filter(None, map(_hf_class, _GEMMA_NORMS)):
            table[cls] = lambda m: _to_rms_norm(m, m.eps, offset=1.0)
    if layer_norm:
        table[nn.LayerNorm] = _to_layer_norm
    if swiglu:
        for cls in filter(None, map(_hf_class, _MLPS)):
            table[cls] = _gated_mlp_or_none
    return table


def _gated_mlp_or_none(module: nn.Module) -> GatedMLP | None:
    activation = _activation(getattr(module, "act_fn", None))
    return None if activation is None else _to_gated_mlp(module, activation)


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    (model.get_submodule(parent) if parent else model)._modules[child] = new


def patch(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    layer_norm: bool = True,
    swiglu: bool = True,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    mlp_classes: Iterable[type[nn.Module]] = (),
) -> list[str]:
    """Replace, in place, the modules of `model` that kp computes (see this module's docstring); return their names.

    rms_norm: torch.nn.RMSNorm and the Llama / Mistral / Qwen2 / Qwen3 / Gemma / Gemma2 / Gemma3 RMSNorms.
    layer_norm: torch.nn.LayerNorm.
    swiglu: the gated MLPs of those transformers families, SwiGLU or GeGLU (Gemma) alike.
    module_filter_fn(module, name): return False to leave a module that would be replaced as it is.
    mlp_classes: your own gated-MLP classes to swap too (with swiglu=True); each must compute
        `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with those attribute names, as the transformers ones do.

    The root module itself is never replaced. Patching twice changes nothing the second time. A module reached by
    several names (shared) becomes one kp module at all of them, and every name is listed.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64), torch.nn.LayerNorm(64))
        >>> kp_norms.patch(model)
        ['1', '2']
        >>> type(model[1]).__module__
        'kp_norms.modules'
        >>> kp_norms.patch(model)  # a second time: nothing left to swap
        []
        >>> other = torch.nn.Sequential(torch.nn.RMSNorm(64), torch.nn.RMSNorm(64))
        >>> kp_norms.patch(other, module_filter_fn=lambda module, name: name != "0")
        ['1']
    """
    kp_core.check_module("kp_norms.patch", "model", model)
    for arg, flag in (("rms_norm", rms_norm), ("layer_norm", layer_norm), ("swiglu", swiglu)):
        kp_core.check_bool("kp_norms.patch", arg, flag)
    kp_core.check_callable("kp_norms.patch", "module_filter_fn", module_filter_fn)
    table = _converters(rms_norm, layer_norm, swiglu)
    for cls in mlp_classes if swiglu else ():
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise TypeError(f"kp_norms.patch: mlp_classes must hold nn.Module subclasses, got {cls!r}")
        table[cls] = _gated_mlp_or_none
    done: dict[int, nn.Module | None] = {}
    changed, left = [], []
    for name, module in list(model.named_modules(remove_duplicate=False)):
        convert = table.get(type(module))
        if not name or convert is None or (module_filter_fn is not None and not module_filter_fn(module, name)):
            continue
        if id(module) not in done:
            new = done[id(module)] = convert(module)
            if new is not None:
                object.__setattr__(new, _ORIGINAL, module)  # a plain attribute: not a child, not in state_dict
        new = done[id(module)]
        if new is None:
            left.append(f"{name} ({type(module).__name__}, act_fn {getattr(module, 'act_fn', None)!r})")
        else:
            _set(model, name, new)
            changed.append(name)
    if left:
        warnings.warn(
            f"kp_norms.patch: left {len(left)} gated MLPs as they are, their activation is not one of "
            f"{', '.join(_ACTIVATIONS)}: {', '.join(left)}",
            stacklevel=2,
        )
    return changed


def unpatch(model: nn.Module) -> list[str]:
    """Put back the original module objects `patch` replaced (with any Parameters or children reassigned since
    through the kp module); return the names restored.

    Examples:
        >>> import torch
        >>> import kp_norms
        >>> norm = torch.nn.RMSNorm(64)
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), norm)
        >>> kp_norms.patch(model)
        ['1']
        >>> kp_norms.unpatch(model), model[1] is norm
        (['1'], True)
    """
    kp_core.check_module("kp_norms.unpatch", "model", model)
    restored = []
    for name, module in list(model.named_modules(remove_duplicate=False)):
        original = module.__dict__.get(_ORIGINAL)
        if original is not None and name:
            _adopt(original, module)
            _set(model, name, original)
            restored.append(name)
    return restored
