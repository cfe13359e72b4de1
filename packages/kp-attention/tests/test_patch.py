"""kp_attention.patch on tiny random Hugging Face models: logits and gradients within the conformance rule."""

import pytest
import torch

import kp_core

transformers = pytest.importorskip("transformers")
kc = pytest.importorskip("kp_conformance")
kp_attention = pytest.importorskip("kp_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# family -> (config class, model class, config overrides): the families kp-norms' patch supports
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    # Gemma 2's attention: logit softcap, a sliding-window layer then a global one; transformers' SDPA path drops
    # the softcap, so its own baseline is the eager one
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=None,
            query_pre_attn_scalar=16,
            attn_implementation="eager",
        ),
    ),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
}


def tiny(family):
    """A tiny random model of `family`, the same weights on every call."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        **dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            attn_implementation="sdpa",
        )
        | extra
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config)
    if family == "gemma2":
        with torch.no_grad():  # scores of a few units (initial weights give ~1e-3), so the softcap bends them
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight *= 40
                layer.self_attn.k_proj.weight *= 40
    return model.to(DEVICE)


def _attention64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers' attention signature over the conformance suite's float64 formula: softcap, then the mask
    transformers built (boolean, SDPA's form); rows that see no key give 0 (its eager attention in float64 gives
    NaN there, from the -inf it then adds, and the NaN reaches every row through the next layer's values)."""
    from kp_conformance.references import attention64

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    causal = attention_mask is None
    out, _ = attention64(q, k, v, causal=causal, softcap=softcap or 0.0, scale=scaling, mask=attention_mask)
    return out, None


def float64_copy(model):
    """The model in float64 through _attention64, every RMSNorm as the float64 formula (Gemma's scale 1 + w):
    transformers' norms normalise in fp32 even then, and the reference must be better than what it judges."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("float64", _attention64)
    ALL_MASK_ATTENTION_FUNCTIONS.register("float64", sdpa_mask)
    model = model.double()
    model.set_attn_implementation("float64")
    for m in model.modules():
        name = type(m).__name__
        if name.endswith("RMSNorm"):
            eps = getattr(m, "eps", getattr(m, "variance_epsilon", None))
            scale = (lambda w: 1 + w) if name.startswith("Gemma") else (lambda w: w)
            m.forward = lambda x, m=m, eps=eps, scale=scale: (
                scale(m.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            )
    return model


def logits_and_grads(model, ids, mask, keep):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask).logits
    out[keep].float().square().mean().backward()  # padded queries (which see no real token) take no part
    return out.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters()}


def check_patched(family, padded=True):
    """tiny(family), patched, against its float64 copy by the rule (logits and every gradient; PyTorch's own path
    as the baseline), on a batch whose second sequence is left-padded (padded) or with no mask (transformers then
    skips it: the causal flash kernel runs). Returns the patched model and the implementation patch replaced."""
    model = tiny(family)
    ids = torch.randint(0, 128, (2, 24), device=DEVICE)
    mask = None
    if padded:
        mask = torch.ones(2, 24, dtype=torch.long, device=DEVICE)
        mask[1, :5] = 0
    keep = (slice(None), slice(5, None)) if padded else (slice(None),)
    low, low_g = logits_and_grads(model, ids, mask, keep)
    ref, ref_g = logits_and_grads(float64_copy(tiny(family)), ids, mask, keep)  # same seed, same weights
    previous = kp_attention.patch(model)
    with kp_core.record_launches() as rec:
        ours, ours_g = logits_and_grads(model, ids, mask, keep)
    assert rec.count() > 0 and rec.backends() <= {kc.kernel_backend()}, rec.launches
    kc.check_close("logits", ours, ref, low, torch.float32)
    for name in ref_g:
        kc.check_close(name, ours_g[name], ref_g[name], low_g[name], torch.float32)
    return model, previous


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padding mask"])
def test_llama_patched_matches_by_the_rule(padded):
    model, previous = check_patched("llama", padded)
    assert previous == "sdpa"
    assert kp_attention.unpatch(model) == "sdpa"
    assert model.config._attn_implementation == "sdpa"


def test_patch_rejects_plain_modules():
    with pytest.raises(TypeError, match="model"):
        kp_attention.patch(torch.nn.Linear(2, 2))


def test_gemma2_softcap_with_padding_and_sliding_masks_matches_by_the_rule():
    """transformers builds an explicit mask for the sliding-window layer and for padding: the kernel applies the
    softcap, then the mask (this combination used to be refused)."""
    check_patched("gemma2")


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "gemma2")])
def test_each_family_patched_matches_by_the_rule(family):
    """A tiny random model of each other family, left-padded (Llama and Gemma 2 have their own tests above)."""
    check_patched(family)


def test_the_patch_passes_its_backend_to_the_mask_free_calls(accepted):
    """With the default backend, "auto" (torch's SDPA let to take the call, and timed faster), the causal calls skip
    kp's kernel; patched again with backend="kp", they run it."""
    from kp_attention import backend

    accepted[0]["torch"] = 0.5
    model = tiny("llama")
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    kp_attention.patch(model)
    model(input_ids=ids)  # measures
    with kp_core.record_launches() as rec:
        model(input_ids=ids)
    assert backend.decided() and not rec.backends("kp::flash_attention")
    kp_attention.patch(model, backend="kp")
    with kp_core.record_launches() as rec:
        model(input_ids=ids)
    assert rec.backends("kp::flash_attention")
    with pytest.raises(ValueError, match="backend"):
        kp_attention.patch(model, backend="fast")
