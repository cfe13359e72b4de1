"""What kp can put in place of a module, per kind of module: each candidate builds a replacement that shares the
original's parameters (optimisers, state_dict and tied weights see the same tensors)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import torch
from torch import nn

import kp_attention
import kp_norms
import kp_precision
import kp_sparsity
from kp.loss_site import KIND as LOSS_KIND
from kp.loss_site import FusedLoss
from kp_attention.ops import attention_fa4
from kp_attention.patch import BACKEND_ATTR


@dataclasses.dataclass(frozen=True)
class Candidate:
    name: str  # in the report; allow / deny match it
    family: str  # "norms", "glu", "float8", "sparsity", "attention"; allow / deny match it too
    build: Callable[[nn.Module], nn.Module]
    lossy: bool = False  # changes the layer's function beyond rounding: checked against the loss budget instead
    modes: tuple[str, ...] = ("train", "infer")


class _Holder(nn.Module):
    """A parent for one module, so that the packages' in-place swaps replace it here and not in the model."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.m = module


def _kp_norms(module: nn.Module, **flags) -> nn.Module | None:
    holder = _Holder(module)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an MLP with an unknown activation is simply not a site
        flags = {"rms_norm": False, "layer_norm": False, "swiglu": False, **flags}
        changed = kp_norms.patch(holder, module_filter_fn=lambda _, name: name == "m", **flags)  # not its children
    return holder.m if changed else None


def _float8_training(recipe: str) -> Candidate:
    config = kp_precision.Float8Config(recipe=recipe)
    return Candidate(
        f"float8 {recipe}",
        "float8",
        lambda m: kp_precision.Float8Linear.from_linear(m, config=config),
        lossy=True,
        modes=("train",),
    )


def _float8_inference(recipe: str) -> Candidate:
    return Candidate(
        f"float8 {recipe} (inference)",
        "float8",
        lambda m: kp_precision.Float8InferenceLinear.from_linear(m, recipe=recipe),
        lossy=True,
        modes=("infer",),
    )


class Switched(nn.Module):
    """A Hugging Face attention layer run with another attention implementation of transformers' registry, and
    kp_attention's backend for its mask-free calls: the config is the model's (shared by its layers), so both are
    switched for the call only. kp.optimize times and checks a layer with it; the choice itself is made for the
    whole model (`kp_attention.patch`)."""

    def __init__(self, module: nn.Module, implementation: str, backend: str = "kp"):
        super().__init__()
        self.module, self.implementation, self.backend = module, implementation, backend

    def forward(self, *args, **kwargs):
        config = self.module.config
        previous = config._attn_implementation, getattr(config, BACKEND_ATTR, None)
        config._attn_implementation = self.implementation
        setattr(config, BACKEND_ATTR, self.backend)
        try:
            return self.module(*args, **kwargs)
        finally:
            config._attn_implementation = previous[0]
            if previous[1] is None:
                delattr(config, BACKEND_ATTR)
            else:
                setattr(config, BACKEND_ATTR, previous[1])


def _attention(backend: str) -> Candidate:
    name = "kp_attention" if backend == "kp" else f"kp_attention {backend}"
    return Candidate(name, "attention", lambda m: Switched(m, kp_attention.register(), backend))


# kp's kernel, and FlashAttention-4 behind kp's op where it can run (kp-attention[fa4], SM 9.0+): each checked
# and timed per layer; kp.decisions picks one implementation for the whole model.
ATTENTION = (_attention("kp"), _attention("fa4"))
ATTENTION_BACKEND = {c.name: c.name.split(" ")[1] if " " in c.name else "kp" for c in ATTENTION}  # name -> backend


def _is_hf_attention(module: nn.Module) -> bool:
    """A transformers attention layer that dispatches through the attention registry by its config."""
    config = getattr(module, "config", None)
    return (
        type(module).__module__.startswith("transformers.models.")
        and type(module).__name__.endswith("Attention")
        and isinstance(getattr(config, "_attn_implementation", None), str)
    )


_NORM_KINDS = {"rms_norm": {"rms_norm": True}, "layer_norm": {"layer_norm": True}, "gated_mlp": {"swiglu": True}}
_NORM_NAMES = {"rms_norm": "kp_norms.RMSNorm", "layer_norm": "kp_norms.LayerNorm", "gated_mlp": "kp_norms.GatedMLP"}
LINEAR = (
    _float8_training("tensorwise"),
    _float8_training("rowwise"),
    _float8_inference("tensorwise"),
    _float8_inference("rowwise"),
    Candidate("2:4 sparse", "sparsity", kp_sparsity.SparseLinear.from_dense, lossy=True, modes=("infer",)),
)


# A causal LM's head and loss (kp.loss_site), in training: kp_losses' fused loss, lossless (the conformance rule),
# and with its head's GEMMs in float8 (family "float8": checked against loss_budget, as the float8 linears)
LOSSES = (
    Candidate("kp_losses fused linear cross-entropy", "losses", FusedLoss, modes=("train",)),
    *(
        Candidate(
            f"kp_losses fused linear cross-entropy, float8 {recipe}",
            "float8",
            lambda m, r=recipe: FusedLoss(m, float8=r),
            lossy=True,
            modes=("train",),
        )
        for recipe in ("tensorwise", "rowwise")
    ),
)


def kind_of(module: nn.Module) -> str | None:
    """The site kind of `module`, or None when kp has nothing for it. Classes are matched exactly, as the
    packages' own patching does: a subclass may compute something else."""
    if type(module) is nn.Linear:
        return "linear"
    if _is_hf_attention(module):
        return "attention"
    for kind, flags in _NORM_KINDS.items():
        if _kp_norms(module, **flags) is not None:
            return kind
    return None


def candidates(kind: str, mode: str) -> list[Candidate]:
    if kind == "linear":
        return [c for c in LINEAR if mode in c.modes]
    if kind == LOSS_KIND:
        return [c for c in LOSSES if mode in c.modes]
    if kind == "attention":
        fa4 = torch.cuda.is_available() and attention_fa4.unavailable(torch.device("cuda")) is None
        return [c for c in ATTENTION if fa4 or c is ATTENTION[0]]
    flags = _NORM_KINDS[kind]
    family = "glu" if kind == "gated_mlp" else "norms"
    return [Candidate(_NORM_NAMES[kind], family, lambda m: _kp_norms(m, **flags))]
