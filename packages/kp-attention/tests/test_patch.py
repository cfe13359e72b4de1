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
