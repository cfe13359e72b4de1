"""The loss of Hugging Face causal LMs through fused_linear_cross_entropy, and back.

A patched model's `forward`, given `labels` while training (or always, with skip_logits=True), runs the model as
it was with `logits_to_keep=1` and no labels (so its head makes one position's logits, not (batch, seq, vocab)),
takes the decoder's last hidden states from a hook on `model.base_model`, and computes transformers' causal-LM
loss from them and `lm_head` without the full logits:

    labels shifted left by one (or the `shift_labels` given), ignore_index -100 (or the one given);
    "mean" over the counted tokens, or "sum" / num_items_in_batch where the trainer passes it (transformers'
    fixed_cross_entropy); fp32, as transformers computes it on `logits.float()`;
    Gemma 2 / 3: the config's final_logit_softcapping applied to the logits first.

The output's `loss` is that loss and its `logits` None (they were never made); every other field is the model's.
Without labels, or in eval mode without skip_logits, the model's own forward runs unchanged.

Patched are the classes whose forward was read and found to be that computation (transformers 4.46-5.x):
exact-class matches only, since a subclass may change forward. Mixture-of-experts models (their router loss is
added inside forward) and models that scale their logits (Cohere, Granite) are not among them. transformers is
never imported here: the classes are looked up in the modules a model's own import has loaded.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

import kp_core
from kp_losses import functional

_ORIGINAL = "_kp_losses_forward"
# family: the ForCausalLM class names whose forward is `logits = lm_head(hidden[keep])` (+ Gemma's final softcap)
# and `loss = self.loss_function(logits, labels, vocab_size, **kwargs)`, transformers' ForCausalLMLoss
_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def _patchable() -> tuple[type, ...]:
    found = []
    for family, name in _CLASSES.items():
        module = sys.modules.get(f"transformers.models.{family}.modeling_{family}")
        cls = getattr(module, name, None) if module is not None else None
        if cls is not None:
            found.append(cls)
    return tuple(found)


def _keep_argument(model: nn.Module) -> str | None:
    params = inspect.signature(type(model).forward).parameters
    return next((name for name in ("logits_to_keep", "num_logits_to_keep") if name in params), None)


def _causal_lm_loss(model, hidden: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """transformers' ForCausalLMLoss on lm_head(hidden), without the logits."""
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = model.lm_head
    items = kwargs.get("num_items_in_batch")
    loss = functional.fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        head.weight,
        shift_labels.reshape(-1).to(hidden.device),
        head.bias,
        ignore_index=ignore_index,
        reduction="mean" if items is None else "sum",
        softcap=getattr(model.config, "final_logit_softcapping", None),
        out_dtype=torch.float32,
        float8=model._kp_losses_float8,
    )
    if items is not None:
        loss = loss / (items.to(loss.device) if torch.is_tensor(items) else items)
    return loss


def _forward(self, *args, labels=None, **kwargs):
    original = getattr(self, _ORIGINAL)
    skip = self._kp_losses_skip_logits
    if labels is None or not (skip or (skip is None and self.training)):
        return original(*args, labels=labels, **kwargs)
    captured = []
    hook = self.base_model.register_forward_hook(lambda module, inputs, output: captured.append(output[0]))
    try:
        out = original(*args, labels=None, **{**kwargs, self._kp_losses_keep: 1})
    finally:
        hook.remove()
    loss = _causal_lm_loss(self, captured[-1], labels, kwargs)
    if isinstance(out, tuple):
        return (loss, None, *out[1:])
    out["loss"], out["logits"] = loss, None
    return out


def patch(model: nn.Module, *, skip_logits: bool | None = None, float8: str | None = None) -> list[str]:
    """Compute `model`'s causal-LM loss with kp_losses.fused_linear_cross_entropy, in place (see the module docstring).

    Args:
        model: a Hugging Face causal LM (Llama, Mistral, Qwen 2 / 3, Gemma 1 / 2 / 3 text, Phi-3).
        skip_logits: None: the fused loss (and no logits) when labels are given in training mode; True: whenever
            labels are given; False: never (the patch then changes nothing).
        float8: None, "tensorwise" or "rowwise": the head's GEMMs in float8 (fused_linear_cross_entropy's float8;
            the `kp-losses[float8]` extra).

    Returns:
        The names of the heads whose loss is fused (["lm_head"]), or [] where the model is not one of those.

    Examples:
        >>> import torch
        >>> import transformers
        >>> import kp_losses
        >>> config = transformers.LlamaConfig(
        ...     hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=50
        ... )
        >>> model = transformers.LlamaForCausalLM(config).train()
        >>> ids = torch.randint(0, 50, (2, 7))
        >>> want = model(input_ids=ids, labels=ids).loss
        >>> kp_losses.patch(model)
        ['lm_head']
        >>> out = model(input_ids=ids, labels=ids)
        >>> out.logits is None and torch.allclose(out.loss, want, atol=1e-5)
        True
    """
    op = "kp_losses.patch"
    kp_core.check_module(op, "model", model)
    if skip_logits is not None:
        kp_core.check_bool(op, "skip_logits", skip_logits)
    functional._check_recipe(op, float8)
    if not patchable(model):
        return []
    if _ORIGINAL not in vars(model):
        setattr(model, _ORIGINAL, model.forward)
        model.forward = types.MethodType(_forward, model)
    model._kp_losses_skip_logits, model._kp_losses_keep = skip_logits, _keep_argument(model)
    model._kp_losses_float8 = float8
    return ["lm_head"]


def patchable(model: nn.Module) -> bool:
    """Whether patch(model) fuses its loss: one of the classes above, with a Linear lm_head, transformers' own
    causal-LM loss function (not one the user or the class set) and a logits_to_keep argument.

    Examples:
        >>> import torch
        >>> import kp_losses
        >>> kp_losses.patchable(torch.nn.Linear(2, 2))
        False
    """
    kp_core.check_module("kp_losses.patchable", "model", model)
    if type(model) not in _patchable() or _keep_argument(model) is None:
        return False
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return False
    return getattr(getattr(model, "loss_function", None), "__name__", None) == "ForCausalLMLoss"


def unpatch(model: nn.Module) -> list[str]:
    """Undo patch: `model`'s own forward again. Returns ["lm_head"] where it was patched, else [].

    Examples:
        >>> import torch
        >>> import kp_losses
        >>> kp_losses.unpatch(torch.nn.Linear(2, 2))
        []
    """
    kp_core.check_module("kp_losses.unpatch", "model", model)
    if _ORIGINAL not in vars(model):
        return []
    del model.forward
    for name in (_ORIGINAL, "_kp_losses_skip_logits", "_kp_losses_keep", "_kp_losses_float8"):
        delattr(model, name)
    return ["lm_head"]
