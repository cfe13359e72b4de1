"""kp.optimize's whole-model CUDA graph (kp.graphs): where it is offered, the decision with timings set through the
timer hook, the cache, and the model's forward once installed. On a CPU, kp_graphs runs a graphed callable
eagerly (the same padding and cutting back, no graph), so `decide` there tests the decision and its bookkeeping;
kp.optimize itself offers the graph on a GPU only, where the tests below run the real capture."""

import copy

import pytest
import torch
from optimize_models import FixedTimer, block, llama

import kp
from kp import graphs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
FASTER = {(graphs.SITE, "eager"): 2.0, (graphs.SITE, graphs.CANDIDATE): 1.0}
SLOWER = {(graphs.SITE, "eager"): 1.0, (graphs.SITE, graphs.CANDIDATE): 1.0}


def test_offered_in_training_on_a_gpu_with_a_timer_that_counts_the_host():
    x = torch.zeros(2, 8, device=DEVICE)
    assert "training only" in graphs.unavailable((x,), "infer", kp.measure.default_timer)
    assert "on a GPU" in graphs.unavailable((torch.zeros(2, 8),), "train", kp.measure.default_timer)
    if torch.cuda.is_available():
        assert graphs.unavailable((x,), "train", kp.measure.default_timer) is None
        assert "graph_timer" in graphs.unavailable((x,), "train", kp.graph_timer)

        def collective(*a):
            return 1.0

        collective.collective = True
        assert "collective" in graphs.unavailable((x,), "train", collective)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the graph is offered: the @gpu tests below")
def test_not_offered_off_a_gpu():
    model, x = block("cpu")
    report = kp.optimize(model, (x,), deny=["float8"], timer=FixedTimer({}), cache=False, report=False)
    assert graphs.SITE not in {layer.name for layer in report.layers} and "forward" not in model.__dict__


def test_decide_chooses_when_faster_and_installs_for_calls_shaped_as_the_example():
    model, x = block(DEVICE)
    expected = model(x)
    timer = FixedTimer(FASTER)
    layer, graphed, times = graphs.decide(model, (x,), timer, 1.03, {})
    assert layer.choice == graphs.CANDIDATE and layer.tried[0].status == "chosen" and "2.00x" in layer.why
    assert times == {"eager": [2.0, None], graphs.CANDIDATE: [1.0, None]}
    assert "forward" not in model.__dict__  # decide leaves the model as it found it
    undo = []
    graphs.install(model, graphed, 1, undo)
    before = graphed.stats.calls
    assert torch.equal(model(x), expected) and graphed.stats.calls == before + 1
    assert torch.equal(model(x=x), expected) and graphed.stats.calls == before + 1  # keyword: its own forward
    assert undo[0][0] == graphs.SITE
    undo[0][1]()
    assert "forward" not in model.__dict__


def test_decide_keeps_eager_below_min_speedup_and_reuses_cached_times():
    model, x = block(DEVICE)
    layer, graphed, times = graphs.decide(model, (x,), FixedTimer(SLOWER), 1.03, {})
    assert graphed is None and layer.choice == "torch" and "below 1.03x" in layer.why
    again = FixedTimer(FASTER)  # not asked: the cached times decide, and an unchosen graph is not built
    layer, graphed, _ = graphs.decide(model, (x,), again, 1.03, times)
    assert graphed is None and again.calls == [] and layer.tried[0].note == "cached time, not checked again"
    chosen = {"eager": [2.0, None], graphs.CANDIDATE: [1.0, None]}
    again = FixedTimer(SLOWER)  # cached as faster: checked again (the weights may differ), not timed
    layer, graphed, _ = graphs.decide(model, (x,), again, 1.03, chosen)
    assert graphed is not None and layer.choice == graphs.CANDIDATE and again.calls == []


@gpu
def test_optimize_graphs_the_whole_model_and_restore_removes_it():
    model, x = block(DEVICE)
    eager = block(DEVICE)[0]
    report = kp.optimize(model, (x,), deny=["float8"], timer=FixedTimer(FASTER), cache=False, report=False)
    row = next(layer for layer in report.layers if layer.name == graphs.SITE)
    assert row.choice == graphs.CANDIDATE and "forward" in model.__dict__
    for _ in range(3):  # replays: the same outputs and parameter gradients as the eager model's
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        y, y0 = model(x), eager(x)
        y.sum().backward()
        y0.sum().backward()
        assert torch.allclose(y, y0, rtol=1e-5, atol=1e-6)
        for p, p0 in zip(model.parameters(), eager.parameters(), strict=True):
            assert torch.allclose(p.grad, p0.grad, rtol=1e-4, atol=1e-5)
    assert graphs.SITE in kp.restore(model) and "forward" not in model.__dict__


@gpu
def test_a_graphed_llama_still_generates_through_its_own_forward():
    model, ids = llama(DEVICE)
    report = kp.optimize(model, (ids,), deny=["float8"], timer=FixedTimer(FASTER), cache=False, report=False)
    # the graphed step is not eager's bit for bit: under capture PyTorch's attention runs another kernel or mask path
    # (on an H100 the first module output that differs is the attention's); it meets the rule against float64
    row = next(layer for layer in report.layers if layer.name == graphs.SITE)
    assert report.chosen.get(graphs.SITE) == graphs.CANDIDATE, row.tried[0].error
    out = model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0)
    kp.restore(model)
    assert torch.equal(out, model.generate(ids[:1, :4], max_new_tokens=3, do_sample=False, pad_token_id=0))


class Planted:
    """A graphed step with a planted error: the real one's output scaled (so its gradients are too)."""

    def __init__(self, real, scale: float):
        self.real, self.scale, self.warmup = real, scale, real.warmup

    def __call__(self, *args):
        return self.real(*args) * self.scale


def float64_block_step(model, x):
    """An independent float64 reference of the block's training step: its output and parameters' gradients."""
    ref = copy.deepcopy(model).double()
    out = type(ref).forward(ref, x.double())  # its own forward, not a graphed one decide installed on the model
    grads = torch.autograd.grad(out.sum(), [p for p in ref.parameters() if p.requires_grad])
    return [out.detach(), *grads]


@pytest.mark.parametrize("scale", [1.0, 1.01])
def test_a_graph_that_is_not_eagers_bit_for_bit_is_judged_against_float64(monkeypatch, scale):
    """scale 1.0: the same step, no reference needed (never called); 1.01: 1 % off, beyond the rule's bound of
    twice eager's error against float64: refused, the rule's line in the report."""
    model, x = block(DEVICE)
    real_build, called = graphs.build, []
    monkeypatch.setattr(graphs, "build", lambda m, ex: Planted(real_build(m, ex), scale))

    def reference():
        called.append(True)
        return float64_block_step(model, x)

    layer, graphed, _ = graphs.decide(model, (x,), FixedTimer(FASTER), 1.03, {}, reference=reference)
    if scale == 1.0:
        assert graphed is not None and layer.choice == graphs.CANDIDATE and not called
        return
    assert graphed is None and called and layer.tried[0].status == "refused", layer.tried[0].note
    assert "against float64, result " in layer.tried[0].error and "2x eager's + 1 ulp" in layer.tried[0].error


def test_the_float64_reference_of_a_step_is_the_original_models():
    """decisions._float64_step: PyTorch's own layers in float64 (kp's choices undone on the copy, kept on the
    model), the gradients in the order of the model's parameters as it is."""
    from kp import decisions

    model, x = block(DEVICE)
    times = {("*", "kp_norms.RMSNorm"): 0.5, ("*", "kp_norms.LayerNorm"): 0.5}
    kp.optimize(model, (x,), deny=["float8", "graphs"], timer=FixedTimer(times), cache=False, report=False)
    assert type(model.norm).__module__.startswith("kp_norms")
    chosen = {name: model.get_submodule(name) for name, _ in model.__dict__[decisions._UNDO]}
    kp.restore(model)
    originals = {name: model.get_submodule(name) for name in chosen}
    expected = float64_block_step(model, x)
    swaps = [decisions._module_swap(decisions.Site(n, originals[n], "norm"), chosen[n], 1.0, "norms") for n in chosen]
    decisions._apply(model, swaps)
    got = decisions._float64_step(model, (x,), swaps)
    assert type(model.norm).__module__.startswith("kp_norms")  # kp's choices are back on the model
    assert len(got) == len(expected) and all(g.dtype == torch.float64 for g in got)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)
