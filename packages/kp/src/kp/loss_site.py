"""The loss of a Hugging Face causal LM as one of kp.optimize's sites: its lm_head and transformers' causal-LM loss
on the example batch, against kp_losses' fused linear + cross-entropy (which never makes the logits).

The site's inputs are the decoder's last hidden states on the example batch (what lm_head read) and, as labels, the
batch's token ids shifted by one (what training a causal LM on that batch computes). Chosen, the model is patched
with kp_losses.patch: its training calls that pass labels get the fused loss; calls without labels are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kp_losses
from kp.sites import Site

NAME = "loss"  # the site's suffix in the report: "<lm_head's name> + loss"
KIND = "loss"
IGNORE = -100  # transformers' ignore_index, the shifted labels' last position


class TorchLoss(nn.Module):
    """What the model computes for its loss: logits = lm_head(hidden) (Gemma: softcap * tanh(logits / softcap)),
    then its loss_function (transformers' ForCausalLMLoss: fp32, mean over the counted tokens). labels: (rows, 1)
    already shifted, so that kp.optimize's row slicing cuts hidden states and labels alike."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.lm_head = model.lm_head
        self.softcap = getattr(model.config, "final_logit_softcapping", None)
        self.vocab = model.config.vocab_size
        self.loss_function = model.loss_function

    def extra_repr(self) -> str:
        return f"vocab={self.vocab}, softcap={self.softcap}"

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return self.loss_function(logits, None, self.vocab, shift_labels=labels.flatten())


class FusedLoss(nn.Module):
    """The same loss by kp_losses.fused_linear_cross_entropy from lm_head's parameters (shared, not copied), its
    head in float8 by a recipe or not: what kp_losses.patch(model, float8=...) makes the model compute."""

    def __init__(self, torch_loss: TorchLoss, float8: str | None = None):
        super().__init__()
        self.lm_head, self.softcap, self.float8 = torch_loss.lm_head, torch_loss.softcap, float8

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        return kp_losses.fused_linear_cross_entropy(
            hidden,
            head.weight,
            labels.flatten(),
            head.bias,
            softcap=self.softcap,
            out_dtype=torch.float32,
            float8=self.float8,
        )


def root(model: nn.Module) -> nn.Module | None:
    """The causal LM in `model` whose loss kp_losses can fuse (the model itself, or the first such submodule)."""
    return next((m for m in model.modules() if kp_losses.patchable(m)), None)


def site(model: nn.Module, head_site: Site, example_inputs: tuple) -> Site | None:
    """The loss site of the causal LM whose lm_head `head_site` captured, or None: not such a head, or no token ids
    (an integer (batch, seq) tensor as the first example input) to make labels of."""
    lm = root(model)
    ids = example_inputs[0] if example_inputs else None
    if lm is None or head_site.module is not lm.lm_head or not head_site.args:
        return None
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.dim() != 2:
        return None
    hidden = head_site.args[0]
    labels = F.pad(ids, (0, 1), value=IGNORE)[:, 1:].to(hidden.device)
    if hidden.shape[:-1] != labels.shape:
        return None
    args = (hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1, 1))
    return Site(f"{head_site.name} + {NAME}", TorchLoss(lm), KIND, args)


def apply(model: nn.Module, undo: list, name: str, float8: str | None) -> None:
    """kp_losses.patch on the model's causal LM (its head in float8 by that recipe, or not), its undo appended
    under the site's name."""
    lm = root(model)
    kp_losses.patch(lm, float8=float8)
    undo.append((name, lambda: kp_losses.unpatch(lm)))
