"""kp_attention.patch on tiny random Hugging Face models: logits and gradients within the conformance rule."""

import pytest
import torch

import kp_core

transformers = pytest.importorskip("transformers")
kc = pytest.importorskip("kp_conformance")
kp_attention = pytest.importorskip("kp_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tiny_llama(**extra):
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation="sdpa",
        **extra,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DEVICE)


def float64_reference(model):
    """The model in float64. transformers' RMSNorm normalises in fp32 even then, so its norms are replaced by
    the float64 formula: the reference must be better than what it judges."""
    model = model.double()
    for m in model.modules():
        if type(m).__name__ == "LlamaRMSNorm":
            m.forward = lambda x, m=m: m.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.variance_epsilon)
    return model


def logits_and_grads(model, ids, mask, keep):
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask).logits
    out[keep].float().square().mean().backward()  # padded queries (which see no real token) take no part
    return out.detach()[keep], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padding mask"])
def test_llama_patched_matches_by_the_rule(padded):
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 24), device=DEVICE)
    mask = None  # transformers then skips the mask: the causal flash kernel runs
    if padded:
        mask = torch.ones(2, 24, dtype=torch.long, device=DEVICE)
        mask[1, :5] = 0  # left padding on the second sequence
    keep = (slice(None), slice(5, None)) if padded else (slice(None),)
    low, low_g = logits_and_grads(model, ids, mask, keep)
    ref, ref_g = logits_and_grads(float64_reference(tiny_llama()), ids, mask, keep)  # same seed, same weights
    assert kp_attention.patch(model) == "sdpa"
    with kp_core.record_launches() as rec:
        ours, ours_g = logits_and_grads(model, ids, mask, keep)
    assert rec.count() > 0 and rec.backends() <= {kc.kernel_backend()}, rec.launches
    kc.check_close("logits", ours, ref, low, torch.float32)
    for name in ref_g:
        kc.check_close(name, ours_g[name], ref_g[name], low_g[name], torch.float32)
    assert kp_attention.unpatch(model) == "sdpa"
    assert model.config._attn_implementation == "sdpa"


def test_patch_rejects_plain_modules():
    with pytest.raises(TypeError, match="model"):
        kp_attention.patch(torch.nn.Linear(2, 2))


def tiny_gemma2():
    """Gemma 2's attention: logit softcap, a sliding-window layer then a global one, query_pre_attn_scalar."""
    config = transformers.Gemma2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        sliding_window=8,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=None,
        query_pre_attn_scalar=16,
        attn_implementation="eager",  # transformers' SDPA path drops the softcap
    )
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config)
    with torch.no_grad():  # scores of a few units (initial weights give ~1e-3), so the softcap bends them
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight *= 40
            layer.self_attn.k_proj.weight *= 40
    return model.to(DEVICE)


def _attention64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """transformers' attention signature over the conformance suite's float64 formula: softcap, then the mask
    transformers built (boolean, SDPA's form); rows that see no key give 0 (its eager attention in float64 gives
    NaN there, from the -inf it then adds, and the NaN reaches every row through the next layer's values)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    causal = attention_mask is None
    from kp_conformance.references import attention64

    out, _ = attention64(q, k, v, causal=causal, softcap=softcap or 0.0, scale=scaling, mask=attention_mask)
    return out, None


def gemma2_float64(model):
    """The model in float64 through _attention64, its RMSNorms as the float64 formula (transformers' normalise
    in fp32)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register("float64", _attention64)
    ALL_MASK_ATTENTION_FUNCTIONS.register("float64", sdpa_mask)
    model = model.double()
    model.set_attn_implementation("float64")
    for m in model.modules():
        if type(m).__name__ == "Gemma2RMSNorm":
            m.forward = lambda x, m=m: (1 + m.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps)
    return model


def test_gemma2_softcap_with_padding_and_sliding_masks_matches_by_the_rule():
    """transformers builds an explicit mask for the sliding-window layer and for padding: the kernel applies the
    softcap, then the mask (this combination used to be refused)."""
    model = tiny_gemma2()
    ids = torch.randint(0, 128, (2, 24), device=DEVICE)
    mask = torch.ones(2, 24, dtype=torch.long, device=DEVICE)
    mask[1, :5] = 0
    keep = (slice(None), slice(5, None))
    low, low_g = logits_and_grads(model, ids, mask, keep)
    ref, ref_g = logits_and_grads(gemma2_float64(tiny_gemma2()), ids, mask, keep)
    kp_attention.patch(model)
    with kp_core.record_launches() as rec:
        ours, ours_g = logits_and_grads(model, ids, mask, keep)
    assert rec.count() > 0 and rec.backends() <= {kc.kernel_backend()}, rec.launches
    kc.check_close("logits", ours, ref, low, torch.float32)
    for name in ref_g:
        kc.check_close(name, ours_g[name], ref_g[name], low_g[name], torch.float32)


FAMILIES = {  # the families kp-norms' patch supports: config class, model class, extra config
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16)),
}


def tiny(family):
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        attn_implementation="sdpa",
        **extra,
    )
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config).to(DEVICE)


def family_float64(model):
    """The model in float64 through _attention64, every RMSNorm as the float64 formula (Gemma's scale 1 + w)."""
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_patched_matches_by_the_rule(family):
    """A tiny random model of each family, left-padded: logits and every gradient by the rule against its float64
    copy, PyTorch's own (SDPA) path as the baseline."""
    model = tiny(family)
    ids = torch.randint(0, 128, (2, 24), device=DEVICE)
    mask = torch.ones(2, 24, dtype=torch.long, device=DEVICE)
    mask[1, :5] = 0
    keep = (slice(None), slice(5, None))
    low, low_g = logits_and_grads(model, ids, mask, keep)
    ref, ref_g = logits_and_grads(family_float64(tiny(family)), ids, mask, keep)
    kp_attention.patch(model)
    with kp_core.record_launches() as rec:
        ours, ours_g = logits_and_grads(model, ids, mask, keep)
    assert rec.count() > 0 and rec.backends() <= {kc.kernel_backend()}, rec.launches
    kc.check_close("logits", ours, ref, low, torch.float32)
    for name in ref_g:
        kc.check_close(name, ours_g[name], ref_g[name], low_g[name], torch.float32)


def test_the_patch_passes_its_backend_to_the_mask_free_calls(monkeypatch):
    """With backend="auto" (torch's SDPA let to take the call, and timed faster) the causal calls skip kp's kernel;
    patched again with the default, they run it."""
    from kp_attention import backend

    monkeypatch.setattr(backend, "torch_refuses", lambda *a, **kw: None)
    monkeypatch.setattr(backend, "timer", lambda name, fn: 0.5 if name.endswith("torch") else 1.0)
    backend.forget()
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    kp_attention.patch(model, backend="auto")
    model(input_ids=ids)  # measures
    with kp_core.record_launches() as rec:
        model(input_ids=ids)
    assert backend.decided() and not rec.backends("kp::flash_attention")
    kp_attention.patch(model)
    with kp_core.record_launches() as rec:
        model(input_ids=ids)
    assert rec.backends("kp::flash_attention")
    backend.forget()
    with pytest.raises(ValueError, match="backend"):
        kp_attention.patch(model, backend="fast")
