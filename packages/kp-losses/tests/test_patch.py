"""kp_losses.patch on tiny Hugging Face causal LMs (float64): the same loss and gradients as the model's own, with
the fused kernel run and no logits made; everything else left as it was."""

import pytest
import torch

import kp_core
import kp_losses
from kp_losses.ops import linear_cross_entropy as lce

transformers = pytest.importorskip("transformers")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=300)


def _config(name, **extra):
    return getattr(transformers, name)(**SMALL, num_key_value_heads=2, **extra)


FAMILIES = {
    "llama": lambda: transformers.LlamaForCausalLM(_config("LlamaConfig")),
    "mistral": lambda: transformers.MistralForCausalLM(_config("MistralConfig")),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(_config("Qwen2Config")),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(_config("Qwen3Config", head_dim=8)),
    "gemma": lambda: transformers.GemmaForCausalLM(_config("GemmaConfig", head_dim=8)),
    "gemma2 (final softcap)": lambda: transformers.Gemma2ForCausalLM(
        _config("Gemma2Config", head_dim=8, final_logit_softcapping=3.0)
    ),
    "gemma3 (final softcap)": lambda: transformers.Gemma3ForCausalLM(
        _config("Gemma3TextConfig", head_dim=8, final_logit_softcapping=3.0)
    ),
    "phi3": lambda: transformers.Phi3ForCausalLM(_config("Phi3Config", pad_token_id=0)),
}


def model_and_batch(family, seed=0):
    torch.manual_seed(seed)
    model = FAMILIES[family]().to(DEVICE, torch.float64).train()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=g).to(DEVICE)
    labels = ids.clone()
    labels[0, :3] = -100
    return model, ids, labels


def loss_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family", FAMILIES)
def test_same_loss_and_gradients_as_the_model_without_logits(family):
    model, ids, labels = model_and_batch(family)
    want, want_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    assert kp_losses.patch(model) == ["lm_head"]
    with kp_core.record_launches() as rec:
        got, got_grads = loss_and_grads(model, input_ids=ids, labels=labels)
    assert rec.backends(lce.OP) == {KERNEL}
    assert got.logits is None and got.loss.dtype == torch.float32
    torch.testing.assert_close(got.loss, want.loss.float())
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b)


def test_trainer_arguments_num_items_in_batch_and_shift_labels():
    model, ids, labels = model_and_batch("llama")
    shifted = torch.full_like(labels, -100)
    shifted[:, :-2] = labels[:, 2:]  # a shift of two, which only shift_labels can say
    other = torch.where(labels == -100, 5, labels)  # ignore_index 5 instead
    calls = [
        (labels, dict(num_items_in_batch=torch.tensor(7))),
        (labels, dict(shift_labels=shifted)),
        (other, dict(ignore_index=5)),
    ]
    wants = [loss_and_grads(model, input_ids=ids, labels=t, **kw)[0].loss for t, kw in calls]
    kp_losses.patch(model)
    for (t, kw), want in zip(calls, wants):
        torch.testing.assert_close(model(input_ids=ids, labels=t, **kw).loss, want.float())


def test_eval_without_labels_or_skip_logits_runs_the_model_as_it_was():
    model, ids, labels = model_and_batch("qwen2")
    kp_losses.patch(model)
    model.eval()
    with kp_core.record_launches() as rec:
        out = model(input_ids=ids, labels=labels)
        assert out.logits.shape == (2, 9, SMALL["vocab_size"]) and out.loss is not None
        assert model.train()(input_ids=ids).logits.shape == (2, 9, SMALL["vocab_size"])  # no labels
    assert rec.backends(lce.OP) == set()


def test_skip_logits_true_fuses_in_eval_and_false_never():
    model, ids, labels = model_and_batch("llama")
    model.eval()
    kp_losses.patch(model, skip_logits=True)
    assert model(input_ids=ids, labels=labels).logits is None
    kp_losses.patch(model, skip_logits=False)
    model.train()
    assert model(input_ids=ids, labels=labels).logits is not None


def test_unpatch_restores_the_models_forward():
    model, ids, labels = model_and_batch("gemma")
    want = model(input_ids=ids, labels=labels)
    assert kp_losses.patch(model) == ["lm_head"] and kp_losses.patch(model) == ["lm_head"]  # twice: once patched
    assert kp_losses.unpatch(model) == ["lm_head"] and kp_losses.unpatch(model) == []
    out = model(input_ids=ids, labels=labels)
    assert out.logits is not None
    torch.testing.assert_close(out.loss, want.loss)


def test_models_it_does_not_know_are_left_alone():
    assert kp_losses.patch(torch.nn.Linear(3, 3)) == []
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50))
    assert kp_losses.patch(gpt2) == []
    model, _, _ = model_and_batch("llama")
    model.loss_function = lambda *a, **k: torch.zeros(())  # a loss of the user's own
    assert kp_losses.patch(model) == []


def test_bad_arguments_name_themselves():
    with pytest.raises(TypeError, match="model must be"):
        kp_losses.patch("model")
    with pytest.raises(TypeError, match="skip_logits"):
        kp_losses.patch(torch.nn.Linear(2, 2), skip_logits="yes")
    with pytest.raises(ValueError, match="float8 must be None or one of"):
        kp_losses.patch(torch.nn.Linear(2, 2), float8="e4m3")


def test_float8_head_keeps_a_float8_linears_error():
    """patch(model, float8=...): the head's GEMMs in float8 (vocabulary 304, hidden 32: multiples of 16); the loss
    and the head's gradient within 10 % of the model's own (fp32 here, kp-precision's casts need it), quantize ran."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SMALL, "vocab_size": 304}, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).to(DEVICE).train()
    ids = torch.randint(0, 304, (2, 9), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    want, want_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    kp_losses.patch(model, float8="rowwise")
    with kp_core.record_launches() as rec:
        got, got_grads = loss_and_grads(model, input_ids=ids, labels=ids)
    assert "kp::quantize" in {launch.op for launch in rec.launches} and got.logits is None
    assert abs(float(got.loss) - float(want.loss)) < 0.1 * float(want.loss)
    head = [i for i, (name, _) in enumerate(model.named_parameters()) if name == "lm_head.weight"][0]
    rel = float((got_grads[head] - want_grads[head]).norm() / want_grads[head].norm())
    assert 1e-6 < rel < 0.1, rel
    kp_losses.unpatch(model)
    assert not hasattr(model, "_kp_losses_float8")
