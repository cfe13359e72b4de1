"""kp.optimize's loss site: a Hugging Face causal LM's head and loss, checked against float64 and timed against
kp_losses' fused linear + cross-entropy; chosen, the model's training calls with labels get the fused loss."""

import pytest
import torch
from optimize_models import FixedTimer, llama

import kp
from kp import graphs, loss_site

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ONLY_LOSS = ["losses"]
SITE = "lm_head + loss"


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    return out, [p.grad.clone() for p in model.parameters()]


def test_the_loss_site_is_chosen_when_faster_and_the_model_then_fuses_its_loss():
    model, ids = llama(DEVICE)
    model.train()
    want, want_grads = _loss_and_grads(model, ids)
    timer = FixedTimer({(SITE, "torch"): 2.0, (SITE, "kp_losses fused linear cross-entropy"): 1.0})
    report = kp.optimize(model, (ids,), allow=ONLY_LOSS, timer=timer, report=False)
    assert report.chosen == {SITE: "kp_losses fused linear cross-entropy"}, report.text()
    (layer,) = report.layers
    assert layer.kind == "loss" and "2.00x torch" in layer.why
    assert "grad" in layer.tried[0].error or "output" in layer.tried[0].error  # checked against float64
    got, got_grads = _loss_and_grads(model, ids)
    assert got.logits is None  # the fused loss: no logits made
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # without labels: the model's own forward, logits and all
        assert model(ids).logits.shape == (*ids.shape, model.config.vocab_size)
    assert kp.restore(model) == [SITE]
    assert model(ids, labels=ids).logits is not None


def test_the_loss_site_stays_torch_when_not_faster_and_is_absent_in_inference():
    model, ids = llama(DEVICE)
    timer = FixedTimer({(SITE, "torch"): 1.0, (SITE, "kp_losses fused linear cross-entropy"): 0.99})
    report = kp.optimize(model, (ids,), allow=ONLY_LOSS, timer=timer, report=False)
    assert report.chosen == {} and [layer.name for layer in report.layers] == [SITE]
    assert model(ids, labels=ids).logits is not None
    report = kp.check(model, (ids,), mode="infer", allow=["lm_head", "losses"], report=False)
    assert [layer.kind for layer in report.layers] == ["linear"]  # the bare head: float8 inference candidates


def test_check_refuses_a_fused_loss_with_a_wrong_gradient(monkeypatch):
    import kp_losses

    real = kp_losses.fused_linear_cross_entropy

    class Scaled(torch.autograd.Function):  # the loss right, the hidden states' gradient 1 % too large
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * 1.01

    monkeypatch.setattr(
        loss_site.kp_losses, "fused_linear_cross_entropy", lambda x, *a, **k: real(Scaled.apply(x), *a, **k)
    )
    model, ids = llama(DEVICE)
    report = kp.check(model, (ids,), allow=ONLY_LOSS, report=False)
    (tried,) = report.layers[0].tried
    assert tried.status == "refused" and "grad input" in tried.error, tried


def test_no_loss_site_without_token_ids_or_for_a_model_kp_losses_cannot_fuse():
    model, ids = llama(DEVICE)
    embeds = model.model.embed_tokens(ids).detach()
    head = next(s for s in kp.sites.capture(model, (None, None, None, None, embeds), {"lm_head": "linear"}))
    assert loss_site.site(model, head, (None, None, None, None, embeds)) is None  # no ids to make labels of
    model.loss_function = lambda *a, **k: torch.zeros(())  # a loss of the user's: not fused
    head = kp.sites.capture(model, (ids,), {"lm_head": "linear"})[0]
    assert loss_site.site(model, head, (ids,)) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="kp.graphs is offered on a GPU only")
def test_a_graphed_model_keeps_the_fused_loss_for_calls_with_labels():
    model, ids = llama(DEVICE)
    model.train()
    timer = FixedTimer({(SITE, "torch"): 2.0, (SITE, "kp_losses fused linear cross-entropy"): 1.0})
    report = kp.optimize(model, (ids,), allow=["losses", "graphs"], timer=timer, report=False)
    assert SITE in report.chosen
    assert model(ids, labels=ids).logits is None  # past the graph's forward: the patched one
    kp.restore(model)
    assert "forward" not in vars(model)


def test_uninstalling_a_graph_puts_back_the_forward_it_covered():
    model = torch.nn.Linear(2, 2)
    patched = lambda x: "patched"  # noqa: E731 (an instance forward, as kp_losses.patch sets)
    model.forward = patched
    undo = []
    graphs.install(model, lambda x: "graphed", 1, undo)
    assert model(torch.ones(2)) == "graphed" and model(x=torch.ones(2)) == "patched"
    undo[0][1]()
    assert model.forward is patched and graphs.uninstall(model) is None


def test_the_float8_loss_is_checked_against_the_loss_budget_and_patches_the_model_in_float8():
    model, ids = llama(DEVICE)
    model.train()
    name = "kp_losses fused linear cross-entropy, float8 tensorwise"
    timer = FixedTimer({(SITE, "torch"): 3.0, (SITE, "kp_losses fused linear cross-entropy"): 2.0, (SITE, name): 1.0})
    report = kp.optimize(model, (ids,), allow=[SITE], timer=timer, report=False)
    assert report.chosen == {SITE: name}, report.text()
    tried = {t.name: t for t in report.layers[0].tried}
    assert "budget 1e-01" in tried[name].error  # lossy: within loss_budget, as the float8 linears
    assert "2x torch's" in tried["kp_losses fused linear cross-entropy"].error  # lossless: the rule
    assert model._kp_losses_float8 == "tensorwise"
    out = model(ids, labels=ids)
    assert out.logits is None and out.loss.isfinite()
    kp.restore(model)
    assert not hasattr(model, "_kp_losses_float8")
