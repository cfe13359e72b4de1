"""Route a Hugging Face model's attention through kp, via transformers' attention-function registry.

`patch(model)` registers an attention function named "kp" (and the SDPA mask builder under the same name) and
switches the model to it with `set_attn_implementation`; `unpatch(model)` switches back; `register()` only
registers it (kp.optimize times a layer with it before deciding for the model). transformers is
imported only here, when a model is patched: it stays an optional dependency.
"""

from __future__ import annotations

import torch
from torch import nn

import kp_core

NAME = "kp"
_PREVIOUS = "_kp_attention_previous"
BACKEND_ATTR = "kp_attention_backend"  # the model config's attribute patch(model, backend=...) sets


def kp_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D); returns the
    output as (B, Sq, Hq, D) and no attention weights.

    With no mask (transformers skips building one when it is purely causal) the FlashAttention-layout kernel
    runs, with the model's sliding window and softcap. With a mask (padding, packed sequences, a sliding window
    transformers built into it, ...) the SDPA drop-in runs with it and with the softcap, which the kernel applies
    before adding the mask, as transformers' eager attention does (its SDPA path has no softcap).
    """
    from kp_attention import flash_attention, scaled_dot_product_attention

    dropout = dropout if module.training else 0.0  # transformers passes the config's rate; eval drops nothing
    softcap = kwargs.get("softcap") or 0.0
    window = kwargs.get("sliding_window")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # views: the kernels take any strides
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(causal) and query.shape[2] > 1
        # transformers' sliding window keeps keys with kv_idx > q_idx - window: `window - 1` to the left.
        left = window - 1 if window else -1
        backend = getattr(module.config, BACKEND_ATTR, "auto")
        out = flash_attention(
            q,
            k,
            v,
            causal=causal,
            window=(left, 0 if causal else -1),
            softcap=softcap,
            scale=scaling,
            dropout_p=dropout,
            backend=backend,
        )
        return out, None
    out = scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True, softcap=softcap
    )
    return out.transpose(1, 2), None


def register() -> str:
    """Register kp's attention function (and the SDPA mask builder) with transformers under the name "kp", without
    switching any model to it (`patch` does both); returns the name. Imports transformers.

    Examples:
        >>> import kp_attention
        >>> kp_attention.register()  # then model.set_attn_implementation("kp") picks it
        'kp'
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, kp_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return NAME


def patch(model: nn.Module, backend: str = "auto") -> str:
    """Switch a transformers model (Llama family and any model using the attention registry) to kp's attention.
    backend: what its mask-free calls run (kp_attention.backend: "kp", "torch" or "auto"). Returns the
    implementation it replaced (e.g. "sdpa"); `unpatch` restores it. The model's attention then takes its
    query (B, Hq, Sq, D) and key / value (B, Hkv, Sk, D) in float16, bfloat16 or float32.

    Examples:
        >>> import torch
        >>> import transformers
        >>> import kp_attention
        >>> config = transformers.LlamaConfig(
        ...     hidden_size=64,
        ...     intermediate_size=128,
        ...     num_hidden_layers=2,
        ...     num_attention_heads=4,
        ...     num_key_value_heads=2,
        ...     vocab_size=128,
        ... )
        >>> model = transformers.LlamaForCausalLM(config)
        >>> kp_attention.patch(model), model.config._attn_implementation
        ('sdpa', 'kp')
        >>> model(torch.randint(0, 128, (1, 16))).logits.shape
        torch.Size([1, 16, 128])
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"kp_attention.patch: model must be a transformers PreTrainedModel, got {type(model).__name__}")
    from kp_attention import backend as backends

    backends.check("kp_attention.patch", backend)
    register()
    setattr(model.config, BACKEND_ATTR, backend)
    previous = model.config._attn_implementation
    if previous != NAME:
        setattr(model, _PREVIOUS, previous)
    model.set_attn_implementation(NAME)
    return getattr(model, _PREVIOUS, previous)


def unpatch(model: nn.Module) -> str | None:
    """Restore the attention implementation `patch` replaced; returns it (None when the model was not patched).

    Examples:
        >>> import torch
        >>> import transformers
        >>> import kp_attention
        >>> config = transformers.LlamaConfig(
        ...     hidden_size=64,
        ...     intermediate_size=128,
        ...     num_hidden_layers=2,
        ...     num_attention_heads=4,
        ...     num_key_value_heads=2,
        ...     vocab_size=128,
        ... )
        >>> model = transformers.LlamaForCausalLM(config)
        >>> kp_attention.patch(model)
        'sdpa'
        >>> kp_attention.unpatch(model), model.config._attn_implementation
        ('sdpa', 'sdpa')
        >>> kp_attention.unpatch(model) is None  # not patched any more
        True
    """
    kp_core.check_module("kp_attention.unpatch", "model", model)
    previous = getattr(model, _PREVIOUS, None)
    if hasattr(model.config, BACKEND_ATTR):
        delattr(model.config, BACKEND_ATTR)
    if previous is not None:
        model.set_attn_implementation(previous)
        delattr(model, _PREVIOUS)
    return previous
