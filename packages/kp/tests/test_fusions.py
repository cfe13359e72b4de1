"""kp.optimize's fusions across packages (kp.fusions): a kp norm read only by float8 layers casts its output for
them in its own kernel. Real kernels (the interpreter on a CPU), timings set through the timer hook."""

import pytest
import torch
from optimize_models import FixedTimer, fan_out, llama

import kp
import kp_core
import kp_norms
import kp_precision
from kp import decisions, fusions

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = "norm -> float8"
TIMES = {
    ("*", "torch"): 1.0,
    ("*", "kp_norms.RMSNorm"): 0.5,
    ("*", "float8 tensorwise"): 0.5,
    ("*", "float8 rowwise"): 0.6,
    ("norm -> float8", decisions.FUSION): 0.4,  # against the norm and its readers' casts: 1.0
}


def _activation_casts(model, x) -> int:
    """kp::quantize launches on the (16, 64) activation in one forward: those a reader made itself."""
    with kp_core.record_launches() as record, torch.no_grad():
        model(x)
    return sum(1 for launch in record.launches if launch.op == "kp::quantize") - 3 * 2  # the 3 weights: amax + cast


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_norm_read_only_by_float8_layers_casts_for_them_in_its_own_kernel(recipe):
    model, x = fan_out(DEVICE)
    weight = model.norm.weight
    keys = set(model.state_dict())
    times = dict(TIMES)
    times[("*", f"float8 {recipe}")] = 0.3
    report = kp.optimize(
        model, (x,), allow=["norms", f"float8 {recipe}", "fusion"], timer=FixedTimer(times), report=False
    )
    assert report.chosen == {
        "norm": "kp_norms.RMSNorm",
        **{n: f"float8 {recipe}" for n in "qkv"},
        FUSED: decisions.FUSION,
    }
    assert isinstance(model.norm, fusions.Float8Norm) and model.norm.granularity == recipe
    assert model.norm.weight is weight and set(model.state_dict()) == keys
    fusion = next(layer for layer in report.layers if layer.name == FUSED)
    assert fusion.kind == "fusion" and "read by q, k, v" in fusion.tried[0].note and "2.50x" in fusion.why
    fused_out = model(x)
    casts = _activation_casts(model, x) if recipe == "tensorwise" else None

    # the same layers without the fusion: the same output bit for bit, and each reader casts the activation
    kp.restore(model)
    kp.optimize(model, (x,), allow=["norms", f"float8 {recipe}"], timer=FixedTimer(times), report=False)
    assert isinstance(model.norm, kp_norms.RMSNorm)
    torch.testing.assert_close(fused_out, model(x), rtol=0, atol=0)
    if recipe == "tensorwise":
        assert casts == 0 and _activation_casts(model, x) == 3 * 2
    kp.restore(model)
    assert type(model.norm) is torch.nn.RMSNorm and model.norm.weight is weight


def test_gradients_through_the_fused_norm_are_the_norms():
    model, x = fan_out(DEVICE)
    grads = []
    for allow in (["norms", "float8 tensorwise", "fusion"], ["norms", "float8 tensorwise"]):
        kp.optimize(model, (x,), allow=allow, timer=FixedTimer(TIMES), report=False)
        assert isinstance(model.norm, fusions.Float8Norm) == ("fusion" in allow)
        xg = x.clone().requires_grad_()
        model(xg).sum().backward()
        grads.append([xg.grad, *(p.grad for p in model.parameters())])
        model.zero_grad(set_to_none=True)
        kp.restore(model)
    assert len(grads[0]) == 5 and all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_fused_cast_that_differs_from_the_layers_own_is_refused(monkeypatch):
    real = kp_norms.norm_float8

    def planted(*args, **kwargs):
        out = real(*args, **kwargs)
        data = out.data.view(torch.uint8).clone()
        data.view(-1)[5] ^= 1  # one float8 value off by one step
        return out._replace(data=data.view(out.data.dtype))

    monkeypatch.setattr(fusions.kp_norms, "norm_float8", planted)
    model, x = fan_out(DEVICE)
    report = kp.optimize(
        model, (x,), allow=["norms", "float8 tensorwise", "fusion"], timer=FixedTimer(TIMES), report=False
    )
    fusion = next(layer for layer in report.layers if layer.name == FUSED)
    assert fusion.choice == "torch" and fusion.tried[0].status == "refused"
    assert "differs from the layers' own cast" in fusion.tried[0].error
    assert isinstance(model.norm, kp_norms.RMSNorm)


def test_a_norm_with_other_readers_or_other_recipes_is_not_fused():
    model, x = fan_out(DEVICE)
    times = {**TIMES, ("k", "float8 rowwise"): 0.1}  # k picks rowwise, q and v tensorwise: no one cast serves all
    report = kp.optimize(model, (x,), allow=["norms", "float8*", "fusion"], timer=FixedTimer(times), report=False)
    assert report.chosen["k"] == "float8 rowwise" and report.chosen["q"] == "float8 tensorwise"
    assert FUSED not in {layer.name for layer in report.layers}
    model, x = fan_out(DEVICE)
    report = kp.optimize(model, (x,), allow=["norms", "float8*"], deny=["v"], timer=FixedTimer(TIMES), report=False)
    assert FUSED not in {layer.name for layer in report.layers}  # v stays an nn.Linear: it reads the norm too


def test_a_llama_block_casts_each_activation_once_where_it_is_made():
    """A Hugging Face Llama with kp norms, kp gated MLPs and float8 linears: both norms of each block and each
    MLP's gated activation make the float8 copy their readers take; the logits are the unfused model's, bit for
    bit, and the state_dict keys are the original's."""
    model, ids = llama(DEVICE)
    keys = set(model.state_dict())
    times = {**TIMES, ("*", "kp_norms.GatedMLP"): 0.5, ("*", decisions.FUSION): 0.4}
    allow = ["norms", "glu", "float8 tensorwise"]
    step = {"torch": 1.0, "kp": 0.9}
    kp.optimize(model, (ids,), allow=allow, timer=FixedTimer(times, step), report=False)
    with torch.no_grad():
        unfused = model(ids).logits
    report = kp.optimize(model, (ids,), allow=[*allow, "fusion"], timer=FixedTimer(times, step), report=False)
    fused = {name for name, choice in report.chosen.items() if choice == decisions.FUSION}
    for i in range(2):
        block = f"model.layers.{i}"
        want = {f"{block}.input_layernorm -> float8", f"{block}.post_attention_layernorm -> float8"}
        assert want | {f"{block}.mlp -> float8"} <= fused, fused
    assert "model.norm -> float8" not in fused  # the lm_head reads a slice of the final norm's output
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp, fusions.Float8GatedMLP) and isinstance(mlp.down_proj, kp_precision.Float8Linear)
    assert isinstance(model.model.layers[0].input_layernorm, fusions.Float8Norm)
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, unfused, rtol=0, atol=0)
    kp.restore(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear


def test_float8_norm_bad_arguments():
    with pytest.raises(TypeError, match="norm must be a kp_norms RMSNorm or LayerNorm"):
        fusions.Float8Norm(torch.nn.RMSNorm(64), "tensorwise", False)
    with pytest.raises(ValueError, match="granularity must be 'tensorwise' or 'rowwise'"):
        fusions.Float8Norm(kp_norms.RMSNorm(64), "blockwise", False)
    with pytest.raises(TypeError, match="mlp must be a kp_norms.GatedMLP"):
        fusions.Float8GatedMLP(torch.nn.Linear(4, 4), "rowwise", False)
    assert fusions.recipe_of(kp_precision.Float8Linear(64, 64, config=kp_precision.Float8Config("blockwise"))) is None


@pytest.mark.parametrize("which", ["norm", "mlp"])
def test_compiled_fused_modules_skip_the_float8_copy_nobody_takes(which):
    """Under torch.compile a float8 layer casts its own input (attached copies are eager only): the fused norm and
    gated MLP run their plain forms there, with the same output bit for bit and no float8 kernel of their own."""
    torch.manual_seed(0)
    f = dict(device=DEVICE, dtype=torch.float32)
    x = torch.randn(16, 64, **f)
    if which == "norm":
        module = fusions.Float8Norm(kp_norms.RMSNorm(64, eps=1e-6, **f), "tensorwise", False)
        fused_op, plain_op = "kp::norm_float8", "kp::norm"
    else:
        module = fusions.Float8GatedMLP(kp_norms.GatedMLP(64, 128, **f), "tensorwise", False)
        fused_op, plain_op = "kp::glu_float8", "kp::glu"
    with torch.no_grad(), kp_core.record_launches() as eager_record:
        expected = module(x)
    assert eager_record.count(fused_op) > 0
    torch._dynamo.reset()
    with torch.no_grad(), kp_core.record_launches() as record:
        got = torch.compile(module, fullgraph=True)(x)
    assert record.count(fused_op) == 0 and record.count(plain_op) > 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
