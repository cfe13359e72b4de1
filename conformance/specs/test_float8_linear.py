"""Conformance spec for kp-precision's float8 training linear (Float8Linear, convert_to_float8_training).

Reference: each recipe written out in plain PyTorch from its description (kp_precision.training's docstring,
torchao's float8 recipes, DeepSeek-V3's blockwise one): every operand cast by the float8 recipe
(kp_conformance.references.quantize_fp8, bit-exact with torch's own cast), dequantised exactly, and the three
matmuls (y = x w^T + b, gx = gy w, gw = gy^T x) in float64; PyTorch's low-precision run of the same recipe does
them with torch._scaled_mm on the same float8 operands (the forward with fast accumulation, as the layer's
default; kp_conformance.references.scaled_mm_lowp), scales in float32, and rounds to the input's dtype. The 2x
rule judges the output and every gradient. The route of precise matmuls to torch._scaled_mm is pinned off, so
every matmul is kp's kernel.
"""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import kp_conformance as kc
import kp_core
import kp_precision
from kp_conformance import fuzz
from kp_conformance.references import quantize_fp8, scale_of_each, scaled_mm_lowp

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the input's (and output's) dtype
TIER = kc.current()
DEVICE = kc.device()
OPS = ("kp::quantize", "kp::scaled_mm")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CONFIGS = (
    kp_precision.Float8Config("tensorwise"),
    kp_precision.Float8Config("tensorwise", "delayed", history_len=4),
    kp_precision.Float8Config("rowwise"),
    kp_precision.Float8Config("blockwise"),
)

kc.declare(
    kc.Spec(
        name="float8_linear",
        package="kp-precision",
        ops=OPS,
        reference=(
            "each recipe in plain PyTorch: operands cast by the float8 recipe (bit-exact with torch's cast), "
            "dequantised exactly, y = x w^T + b, gx = gy w, gw = gy^T x in float64; PyTorch's run in float32 "
            "rounded to the input's dtype for the 2x rule"
        ),
        dtypes=DTYPES,
        properties=(
            "values",
            "recipes",
            "delayed",
            "state_dict",
            "convert",
            "inference",
            "no_mutation",
            "bad_input",
            "compile",
        ),
    )
)


class Cast:
    """A 2-D operand cast by the recipe: its float8 data and every element's float32 scale."""

    def __init__(self, data, scale):
        self.data, self.scale = data, scale

    def t(self):
        return Cast(self.data.t(), self.scale.t())

    def __call__(self, dtype):  # dequantised, exactly in float64
        return self.data.to(dtype) * self.scale.to(dtype)


def matmul(a, b, dtype, fast=False):
    """a @ b of two Casts: float64 of the dequantised operands, or PyTorch's float8 GEMM (float32)."""
    if dtype == torch.float64:
        return a(dtype) @ b(dtype)
    return scaled_mm_lowp(a.data, b.data, a.scale, b.scale, fast)


@pytest.fixture(autouse=True)
def _kernel_only():
    with kp_core.pinned("scaled_mm_route", cublas=False):
        yield


def cast(t, fp8, config, weight=False, given=None):
    """(Cast, amax) of t cast along its last dim by the recipe."""
    if config.recipe == "tensorwise":
        gran, block = "tensorwise", None
    elif config.recipe == "rowwise":
        gran, block = "rowwise", None
    else:
        gran, block = "blockwise", (128, 128) if weight else (1, 128)
    pow2 = config.pow2 and given is None
    data, scale, amax = quantize_fp8(t, fp8, gran, block, given=given, power_of_2=pow2)
    return Cast(data, scale_of_each(data, scale, gran, block)), amax


def recipe(x2, w, b, gy, config, dtype, given=(None, None, None)):
    """{name: (float64 reference, PyTorch low-precision result)} for y, gx, gw (and gb) of the recipe."""
    qx, _ = cast(x2, E4M3, config, given=given[0])
    qw, _ = cast(w, E4M3, config, weight=True, given=given[1])
    gfp8 = config.gradient
    qg, _ = cast(gy, gfp8, config, given=given[2])
    if config.recipe == "rowwise":  # the backward's casts along the other dimension
        wb = cast(w.t().contiguous(), E4M3, config)[0].t()
        gt = cast(gy.t().contiguous(), gfp8, config)[0]
        xb = cast(x2.t().contiguous(), E4M3, config)[0].t()
    elif config.recipe == "blockwise":
        wb = qw
        gt = cast(gy.t().contiguous(), gfp8, config)[0]
        xb = cast(x2.t().contiguous(), E4M3, config)[0].t()
    else:
        wb, gt, xb = qw, qg.t(), qx
    out = {}
    for d in (torch.float64, torch.float32):  # the reference, then PyTorch in low precision
        y = matmul(qx, qw.t(), d, config.fast_accum_output) + (0 if b is None else b.to(d))
        out.setdefault("y", []).append(y)
        out.setdefault("gx", []).append(matmul(qg, wb, d))
        out.setdefault("gw", []).append(matmul(gt, xb, d))
        if b is not None:
            out.setdefault("gb", []).append(gy.to(d).sum(0))
    final = {"y": dtype, "gx": dtype, "gw": dtype, "gb": dtype}
    return {k: (v[0], v[1].to(final[k])) for k, v in out.items()}


def run(layer, x, gy):
    """Forward and backward through kp, proving the kernels ran; (y, gx, gw, gb)."""
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    with kp_core.record_launches() as rec:
        y = layer(x)
        y.backward(gy)
    kc.assert_kernel_ran(rec, *OPS)
    return y, x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


def make_layer(k, n, bias, config, w_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / math.sqrt(k))
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    lin = lin.to(device=DEVICE, dtype=w_dtype)
    return kp_precision.Float8Linear.from_linear(lin, config=config)


def check(c, dtype):
    m, k, n, config = c["m"], c["k"], c["n"], c["config"]
    layer = make_layer(k, n, c["bias"], config, c["w_dtype"] or dtype, c["seed"])
    x = kc.make_input((m, k), dtype, DEVICE, "contiguous", seed=c["seed"] + 1, family=c["family"])
    gy = kc.make_input((m, n), dtype, DEVICE, "contiguous", seed=c["seed"] + 2)
    y, gx, gw, gb = run(layer, x, gy)
    b = None if layer.bias is None else layer.bias.detach()
    refs = recipe(x, layer.weight.detach(), b, gy, config, dtype)
    for name, ours in (("y", y), ("gx", gx), ("gw", gw), ("gb", gb)):
        if name in refs:
            ref, low = refs[name]
            low = low.to(ours.dtype)  # a float32 master weight's gradient: rounded to dtype, then widened
            kc.check_close(f"float8_linear {config.recipe} {name} {c}", ours, ref, low, dtype)


@st.composite
def cases(draw):
    cap = max(16, min(math.isqrt(TIER.max_numel) // 4, 4096))
    mult16 = st.one_of(st.sampled_from([16, 32, 128, 144]), st.integers(1, cap // 16).map(lambda v: 16 * v))
    return dict(
        m=draw(st.one_of(st.sampled_from([1, 15, 17, 33]), st.integers(1, cap))),
        k=draw(mult16),
        n=draw(mult16),
        config=dataclasses.replace(
            draw(st.sampled_from([c for c in CONFIGS if c.scaling == "dynamic"])), fast_accum_output=draw(st.booleans())
        ),
        bias=draw(st.booleans()),
        w_dtype=draw(st.sampled_from([None, torch.float32])),  # None: the input's dtype
        family=draw(st.sampled_from(kc.FAMILIES)),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.conformance(kernel="float8_linear", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=cases())
def test_values(dtype, c):
    kc.skip_if_not_covered(dtype)
    check(c, dtype)


@pytest.mark.conformance(kernel="float8_linear", prop="recipes")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("config", [c for c in CONFIGS if c.scaling == "dynamic"], ids=lambda c: c.recipe)
def test_recipes(dtype, config):
    """Each recipe on rows that need padding (37 -> 48) and K = 272 (a partial 128-block), with bias."""
    kc.skip_if_not_covered(dtype)
    check(dict(m=37, k=272, n=144, config=config, bias=True, w_dtype=torch.float32, family="normal", seed=1), dtype)


@pytest.mark.conformance(kernel="float8_linear", prop="delayed")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_delayed(dtype):
    """Delayed scaling: the first call casts dynamically and fills each history with its amax; each later call
    casts with scale = max(history) / FP8_MAX, then pushes its amax in front (the oldest drops out)."""
    kc.skip_if_not_covered(dtype)
    config = CONFIGS[1]
    layer = make_layer(144, 48, True, config, torch.float32, 3)
    hist = {"x": [], "w": [], "g": []}
    for step in range(config.history_len + 1):
        x = kc.make_input((33, 144), dtype, DEVICE, "contiguous", seed=10 + step) * (1 + step)
        gy = kc.make_input((33, 48), dtype, DEVICE, "contiguous", seed=20 + step) * (3 - step / 2)
        w = layer.weight.detach()
        given = [None] * 3
        if step:
            given = [
                torch.stack(hist[n]).amax() / torch.finfo(f).max for n, f in (("x", E4M3), ("w", E4M3), ("g", E5M2))
            ]
        y, gx, gw, gb = run(layer, x, gy)
        refs = recipe(x, w, layer.bias.detach(), gy, config, dtype, given=given)
        for name, ours in (("y", y), ("gx", gx), ("gw", gw)):
            kc.check_close(f"delayed step {step} {name}", ours, refs[name][0], refs[name][1].to(ours.dtype), dtype)
        amaxes = {"x": x.float().abs().amax(), "w": w.float().abs().amax(), "g": gy.float().abs().amax()}
        for key, buf in (("x", "amax_history_x"), ("w", "amax_history_w"), ("g", "amax_history_grad")):
            hist[key] = [amaxes[key]] * config.history_len if not step else [amaxes[key]] + hist[key][:-1]
            torch.testing.assert_close(getattr(layer, buf), torch.stack(hist[key]), rtol=0, atol=0)


@pytest.mark.conformance(kernel="float8_linear", prop="state_dict")
def test_state_dict_round_trip():
    """A dynamic Float8Linear's state_dict is an nn.Linear's: it loads into one (strict) and back; a delayed one's
    adds its scaling state (three amax histories and whether they are filled) and still takes an nn.Linear's
    (strict; its histories start again); from_linear shares the linear's parameters (no copy) and convert keeps
    the model's keys."""
    lin = nn.Linear(64, 32).to(DEVICE)
    f8 = kp_precision.Float8Linear.from_linear(lin, config=CONFIGS[0])
    assert f8.weight is lin.weight and f8.bias is lin.bias
    assert f8.state_dict().keys() == lin.state_dict().keys()
    plain = nn.Linear(64, 32).to(DEVICE)
    plain.load_state_dict(f8.state_dict(), strict=True)
    assert torch.equal(plain.weight, lin.weight)
    delayed = kp_precision.Float8Linear.from_linear(lin, config=CONFIGS[1])
    scaling = {"amax_history_x", "amax_history_w", "amax_history_grad", "amax_history_filled"}
    assert delayed.state_dict().keys() == lin.state_dict().keys() | scaling
    delayed.load_state_dict(plain.state_dict(), strict=True)
    assert not delayed._history_filled and not delayed.amax_history_filled
    other = kp_precision.Float8Linear(64, 32, device=DEVICE, config=CONFIGS[2])
    other.load_state_dict(plain.state_dict(), strict=True)
    assert torch.equal(other.weight, plain.weight) and torch.equal(other.bias, plain.bias)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(DEVICE)
    keys = model.state_dict().keys()
    kp_precision.convert_to_float8_training(model)
    assert model.state_dict().keys() == keys


def _steps(layer, opt, first, last):
    """Steps first..last-1 of a small SGD run on the layer (inputs by step), and their outputs."""
    outs = []
    for step in range(first, last):
        x = kc.make_input((32, 64), torch.float32, DEVICE, "contiguous", seed=40 + step) * (1 + step % 3)
        opt.zero_grad(set_to_none=True)
        y = layer(x)
        y.square().mean().backward()
        opt.step()
        outs.append(y.detach())
    return outs


@pytest.mark.conformance(kernel="float8_linear", prop="state_dict")
def test_delayed_resume_is_bit_identical():
    """Delayed scaling resumed from a state_dict (saved to disk and loaded into a new layer and optimizer)
    continues exactly as the uninterrupted run: outputs, weights and histories equal bit for bit (before the
    scaling state was in the state_dict, a resume refilled the histories from the next step's amaxes)."""
    config = kp_precision.Float8Config("tensorwise", "delayed", history_len=4)

    def fresh():
        layer = make_layer(64, 32, True, config, torch.float32, 5)
        return layer, torch.optim.SGD(layer.parameters(), lr=0.1)

    straight, opt = fresh()
    want = _steps(straight, opt, 0, 6)
    first, opt = fresh()
    got = _steps(first, opt, 0, 3)
    saved = copy.deepcopy((first.state_dict(), opt.state_dict()))
    second, opt = fresh()
    second.load_state_dict(saved[0], strict=True)
    opt.load_state_dict(saved[1])
    got += _steps(second, opt, 3, 6)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: the resumed run's output differs"
    for name, t in straight.state_dict().items():
        assert torch.equal(second.state_dict()[name], t), f"{name} differs after the resumed run"


@pytest.mark.conformance(kernel="float8_linear", prop="convert")
def test_convert(capsys):
    """Every nn.Linear the filter picks becomes a Float8Linear on the same parameters; layers float8 cannot
    take stay, with a warning that names them; verbose lists what was converted."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down, self.head = nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 10)

    model = nn.Sequential(Block(), Block()).to(DEVICE)
    up = model[0].up.weight
    with pytest.warns(UserWarning, match=r"0\.head \(64 -> 10: float8 matmuls need"):
        kp_precision.convert_to_float8_training(
            model, module_filter_fn=lambda mod, fqn: fqn != "1.down", recipe="rowwise", verbose=True
        )
    kinds = {name: type(mod).__name__ for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    assert kinds == {
        "0.up": "Float8Linear",
        "0.down": "Float8Linear",
        "0.head": "Linear",
        "1.up": "Float8Linear",
        "1.down": "Linear",
        "1.head": "Linear",
    }
    assert model[0].up.weight is up and model[0].up.config.recipe == "rowwise"
    assert "0.up" in capsys.readouterr().out


@pytest.mark.conformance(kernel="float8_linear", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_no_mutation(dtype):
    for config in CONFIGS:
        layer = make_layer(144, 32, True, config, torch.float32, 5)
        x = kc.make_input((20, 144), dtype, DEVICE, "contiguous", seed=6)
        before = (x.clone(), layer.weight.detach().clone(), layer.bias.detach().clone())
        layer(x.requires_grad_()).sum().backward()
        after = (x.detach(), layer.weight.detach(), layer.bias.detach())
        for name, a, b in zip(("input", "weight", "bias"), before, after, strict=True):
            assert torch.equal(a, b), f"{config.recipe}: a forward and backward modified the {name}"


@pytest.mark.conformance(kernel="float8_linear", prop="inference")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_inference(dtype, recipe):
    """Float8InferenceLinear: the weight cast once by the recipe (tensorwise, per row, 128 x 128), activations per
    call (tensorwise, per row, 1 x 128), one float8 matmul with bias and activation (float64 reference, 2x rule);
    an nn.Linear's state_dict loads into it (cast on load) to the same float8 weight; its own state_dict loads
    into another exactly; convert_to_float8_inference swaps a model's layers."""
    kc.skip_if_not_covered(dtype)
    config = kp_precision.Float8Config(recipe, power_of_2=False)
    lin = nn.Linear(272, 144, device=DEVICE, dtype=dtype).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(kc.make_input((144, 272), dtype, DEVICE, "contiguous", seed=9) / 16)
        lin.bias.copy_(kc.make_input((144,), dtype, DEVICE, "contiguous", seed=10))
    layer = kp_precision.Float8InferenceLinear.from_linear(lin, recipe=recipe, activation="gelu")
    x = kc.make_input((3, 13, 272), dtype, DEVICE, "contiguous", seed=11)
    with kp_core.record_launches() as rec:
        y = layer(x)
    kc.assert_kernel_ran(rec, *OPS)
    qx, _ = cast(x.reshape(-1, 272), E4M3, config)
    qw, _ = cast(lin.weight, E4M3, config, weight=True)
    ref, low = (F.gelu(matmul(qx, qw.t(), d, fast=True) + lin.bias.to(d)) for d in (torch.float64, torch.float32))
    kc.check_close(f"inference {recipe}", y.reshape(-1, 144), ref, low.to(dtype), dtype)
    loaded = kp_precision.Float8InferenceLinear(272, 144, device=DEVICE, dtype=dtype, recipe=recipe, activation="gelu")
    loaded.load_state_dict(lin.state_dict(), strict=True)
    again = kp_precision.Float8InferenceLinear(272, 144, device=DEVICE, dtype=dtype, recipe=recipe, activation="gelu")
    again.load_state_dict(loaded.state_dict(), strict=True)
    for other in (loaded, again):
        assert torch.equal(other.weight.view(torch.uint8), layer.weight.view(torch.uint8))
        assert torch.equal(other.weight_scale, layer.weight_scale) and torch.equal(other(x), y)
    model = kp_precision.convert_to_float8_inference(nn.Sequential(copy.deepcopy(lin), nn.ReLU()), recipe=recipe)
    assert isinstance(model[0], kp_precision.Float8InferenceLinear) and model[0].weight.dtype == E4M3


def _layer(d, **kw):
    return kp_precision.Float8Linear(32, 16, device=d, **kw)


BAD_INPUTS = [
    ("unknown recipe", lambda d: kp_precision.Float8Config("columnwise"), ValueError, "recipe"),
    ("unknown scaling", lambda d: kp_precision.Float8Config(scaling="static"), ValueError, "scaling"),
    ("delayed rowwise", lambda d: kp_precision.Float8Config("rowwise", "delayed"), ValueError, "delayed"),
    ("history of 0", lambda d: kp_precision.Float8Config(scaling="delayed", history_len=0), ValueError, "history_len"),
    ("grad_dtype float16", lambda d: kp_precision.Float8Config(grad_dtype=torch.float16), TypeError, "grad_dtype"),
    (
        "fast_accum_output not a bool",
        lambda d: kp_precision.Float8Config(fast_accum_output="yes"),
        TypeError,
        "fast_accum_output",
    ),
    ("features not multiples of 16", lambda d: kp_precision.Float8Linear(30, 16), ValueError, "multiples of 16"),
    ("integer input", lambda d: _layer(d)(torch.ones(4, 32, dtype=torch.int32, device=d)), TypeError, "input"),
    ("input's last dim", lambda d: _layer(d)(torch.ones(4, 48, device=d)), ValueError, "in_features"),
    ("0-dim input", lambda d: _layer(d)(torch.ones((), device=d)), ValueError, "in_features"),
    (
        "recipe and config",
        lambda d: kp_precision.convert_to_float8_training(nn.Linear(16, 16), recipe="rowwise", config=CONFIGS[0]),
        ValueError,
        "recipe or config",
    ),
    ("not a module", lambda d: kp_precision.convert_to_float8_training([nn.Linear(16, 16)]), TypeError, "model"),
    (
        "inference recipe",
        lambda d: kp_precision.Float8InferenceLinear(32, 16, recipe="columnwise"),
        ValueError,
        "recipe",
    ),
    (
        "inference activation",
        lambda d: kp_precision.Float8InferenceLinear(32, 16, activation="tanh"),
        ValueError,
        "activation",
    ),
    ("inference features", lambda d: kp_precision.Float8InferenceLinear(32, 8), ValueError, "multiples of 16"),
    (
        "inference input",
        lambda d: kp_precision.Float8InferenceLinear(32, 16, device=d)(torch.ones(2, 16, device=d)),
        ValueError,
        "in_features",
    ),
    (
        "inference wrong weight",
        lambda d: kp_precision.Float8InferenceLinear(32, 16, device=d).set_weight(torch.ones(32, 16, device=d)),
        ValueError,
        "weight",
    ),
    (
        "inference convert recipe",
        lambda d: kp_precision.convert_to_float8_inference(nn.Linear(16, 16), recipe="columnwise"),
        ValueError,
        "recipe",
    ),
]


test_bad_input = kc.bad_input_test("float8_linear", BAD_INPUTS, DEVICE)


@pytest.mark.conformance(kernel="float8_linear", prop="compile")
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.recipe}-{c.scaling}")
def test_compile_fullgraph_equals_eager(config):
    """Forward and backward of a compiled Float8Linear (one graph, no break) equal eager's bit for bit, and
    delayed scaling updates its histories the same way. Compiled, a tensorwise layer's casts are the quantize op's
    PyTorch maths for inductor to fuse (kp_precision.shared.cast): no quantize kernel runs there, and the bits must
    still be the kernels'."""
    torch._dynamo.reset()
    layers = [make_layer(144, 48, True, config, torch.float32, 7) for _ in range(2)]
    x = kc.make_input((40, 144), torch.float32, DEVICE, "contiguous", seed=8)
    results = []
    for layer, compiled in zip(layers, (False, True), strict=True):
        fn = torch.compile(layer, fullgraph=True) if compiled else layer
        for _ in range(2):  # delayed: the first call fills the histories, the second uses them
            xi = x.clone().requires_grad_()
            layer.zero_grad(set_to_none=True)
            with kp_core.record_launches() as rec:
                y = fn(xi)
                y.backward(torch.ones_like(y))
            if compiled and config.recipe == "tensorwise":
                assert not rec.backends("kp::quantize"), rec.launches
                kc.assert_kernel_ran(rec, *(op for op in OPS if op != "kp::quantize"))
            else:
                kc.assert_kernel_ran(rec, *OPS)
        results.append((y, xi.grad, layer.weight.grad, [b.clone() for b in layer.buffers()]))
    (y0, gx0, gw0, b0), (y1, gx1, gw1, b1) = results
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1) and torch.equal(gw0, gw1)
    assert all(torch.equal(a, b) for a, b in zip(b0, b1, strict=True))


FUZZ_TARGETS = [
    fuzz.Target(
        "kp_precision.Float8Linear",
        "kp-precision",
        lambda module, input: module(input),
        lambda d: dict(module=kp_precision.Float8Linear(32, 48, device=d), input=torch.randn(16, 32, device=d)),
        dict(input=fuzz.Tensor(DTYPES, sized=(1,), ranked=False, words=("in_features", "weight"), first=True)),
    ),
    fuzz.Target(
        "kp_precision.Float8Config(...)",
        "kp-precision",
        kp_precision.Float8Config,
        lambda d: dict(recipe="tensorwise", scaling="delayed", history_len=16),
        dict(
            recipe=fuzz.Scalar(bad=("columnwise", None)),
            scaling=fuzz.Scalar(bad=("lazy", None)),
            history_len=fuzz.Scalar(bad=(0, -1, 16.0)),
        ),
        launches=False,
    ),
]


test_bad_input_fuzz = kc.fuzz_test("float8_linear", FUZZ_TARGETS)
