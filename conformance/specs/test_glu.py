"""Conformance spec for kp-norms' gated activations (SwiGLU, GeGLU with erf and tanh GELU), split and packed,
forward and backward, against independent float64 references."""

import contextlib
from dataclasses import dataclass
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import kp_conformance as kc
import kp_core
import kp_norms
from kp_conformance import fuzz
from kp_conformance.references import gelu64, gelu_tanh64, quantize_fp8, silu64
from kp_core import Activation
from kp_norms.ops import glu as glu_mod

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TIER = kc.current()
DEVICE = kc.device()
SPLIT_OPS = ("kp::glu", "kp::glu_backward")
PACKED_OPS = ("kp::glu_packed", "kp::glu_packed_backward")
FLOAT8_OPS = ("kp::glu_float8", "kp::glu_float8_backward")

kc.declare(
    kc.Spec(
        name="glu",
        package="kp-norms",
        ops=SPLIT_OPS + PACKED_OPS + FLOAT8_OPS,
        reference=(
            "y = act(gate) * up in float64 (Shazeer 2020, 'GLU Variants Improve Transformer', eq. 6): "
            "silu(g) = g * sigmoid(g), gelu(g) = 0.5 g (1 + erf(g / sqrt 2)), tanh form 0.5 g (1 + tanh(sqrt(2/pi) "
            "(g + 0.044715 g^3))) (Hendrycks & Gimpel 2016; torch.nn.GELU docs); packed: gate, up = x.chunk(2, -1); "
            "the float8 copy: the float8 recipe's cast of the output in float32 PyTorch (quantize_fp8)"
        ),
        dtypes=DTYPES,
        properties=(
            "values",
            "gradients",
            "float8_output",
            "no_mutation",
            "determinism",
            "zero_size",
            "bad_input",
            "opcheck",
            "compile",
        ),
    )
)


@dataclass(frozen=True)
class Act:
    split: object  # kp on (gate, up)
    packed: object  # kp on one [..., 2H] input
    act64: object  # the activation in float64, from its formula
    lowp: object  # PyTorch's own activation, run in the input's precision


ACTS = {
    "swiglu": Act(kp_norms.swiglu, kp_norms.swiglu_packed, silu64, F.silu),
    "geglu": Act(kp_norms.geglu, kp_norms.geglu_packed, gelu64, F.gelu),
    "geglu_tanh": Act(
        partial(kp_norms.geglu, approximate="tanh"),
        partial(kp_norms.geglu_packed, approximate="tanh"),
        gelu_tanh64,
        partial(F.gelu, approximate="tanh"),
    ),
}
FORMS = ("split", "packed")


def make_case(form, shape, dtype, layouts, scale, seed, family="normal"):
    """Inputs for one call: (gate, up) for the split form, (x,) with x [..., 2H] for the packed form. family
    (kc.GLU_FAMILIES) shapes the gate's values; up stays N(0, scale^2)."""
    if form == "packed":
        x = kc.make_input(shape[:-1] + (2 * shape[-1],), dtype, DEVICE, layouts[0], scale=scale, seed=seed)
        if family != "normal":
            gate = kc.make_input(shape, dtype, DEVICE, "contiguous", scale=scale, seed=seed, family=family)
            x[..., : shape[-1]] = gate
        return (x,)
    gate = kc.make_input(shape, dtype, DEVICE, layouts[0], scale=scale, seed=seed, family=family)
    return gate, kc.make_input(shape, dtype, DEVICE, layouts[1], scale=scale, seed=seed + 1)


def calls(act, form):
    """(ours, reference in float64, PyTorch in low precision), each taking make_case's inputs."""
    a = ACTS[act]
    ref64, lowp = (lambda g, u: a.act64(g) * u), (lambda g, u: a.lowp(g) * u)
    if form == "packed":
        return a.packed, lambda x: ref64(*x.chunk(2, -1)), lambda x: lowp(*x.chunk(2, -1))
    return a.split, ref64, lowp


def ops_of(form):
    return PACKED_OPS if form == "packed" else SPLIT_OPS


case = dict(
    form=st.sampled_from(FORMS),  # drawn, not parametrised: both forms run the same kernels
    shape=kc.row_shapes(TIER).map(lambda s: s[0]),  # any shape: the last dim is H
    layouts=st.tuples(st.sampled_from(kc.LAYOUTS), st.sampled_from(kc.LAYOUTS)),
    scale=st.sampled_from([1.0, 0.01, 30.0]),
    seed=st.integers(0, 2**16),
    family=st.sampled_from(kc.GLU_FAMILIES),
)


@pytest.mark.conformance(kernel="glu", prop="values")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(**case)
def test_values(dtype, act, form, shape, layouts, scale, seed, family):
    kc.skip_if_not_covered(dtype)
    inputs = make_case(form, shape, dtype, layouts, scale, seed, family)
    ours, ref64, lowp = calls(act, form)
    with kp_core.record_launches() as rec:
        y = ours(*inputs)
    if y.numel():
        kc.assert_kernel_ran(rec, ops_of(form)[0])
    kc.check_close("y", y, ref64(*(t.double() for t in inputs)), lowp(*inputs), dtype)


def grads(fn, inputs, dy):
    """(y, gradient of each input) for fn(*inputs).backward(dy)."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    y = fn(*inputs)
    y.backward(dy)
    return [y.detach(), *(t.grad for t in inputs)]


@pytest.mark.conformance(kernel="glu", prop="gradients")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(**case)
def test_gradients(dtype, act, form, shape, layouts, scale, seed, family):
    kc.skip_if_not_covered(dtype)
    inputs = make_case(form, shape, dtype, layouts, scale, seed, family)
    dy = kc.make_input(shape, dtype, DEVICE, layouts[-1], seed=seed + 2)
    ours, ref64, lowp = calls(act, form)
    with kp_core.record_launches() as rec:
        got = grads(ours, inputs, dy)[1:]
    if dy.numel():
        kc.assert_kernel_ran(rec, *ops_of(form))
    refs = grads(ref64, [t.double() for t in inputs], dy.double())[1:]
    lows = grads(lowp, inputs, dy)[1:]
    names = ("dinput",) if form == "packed" else ("dgate", "dup")
    for name, g, r, low in zip(names, got, refs, lows):
        kc.check_close(name, g, r, low, dtype)


FIXED_SHAPES = [(7, 33), (3, 5, 257), (2, 1), (4, 1025)]


@pytest.mark.conformance(kernel="glu", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("layout", kc.LAYOUTS)
def test_no_mutation(dtype, layout):
    kc.skip_if_not_covered(dtype)
    for i, shape in enumerate(FIXED_SHAPES):
        for act, form in zip(ACTS, FORMS * 2):
            inputs = make_case(form, shape, dtype, (layout, layout), 1.0, i)
            dy = kc.make_input(shape, dtype, DEVICE, layout, seed=i + 7)
            before = [t.clone() for t in (*inputs, dy)]
            ours = calls(act, form)[0]
            with kp_core.record_launches() as rec:
                ours(*inputs)  # forward alone on the originals
                grads(ours, inputs, dy)
            kc.assert_kernel_ran(rec, *ops_of(form))
            for t, b in zip((*inputs, dy), before):
                assert torch.equal(t, b), f"{act} {form}: an input was modified"


@pytest.mark.conformance(kernel="glu", prop="determinism")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_determinism(dtype):
    """Bitwise-equal results and gradients on repeated calls."""
    kc.skip_if_not_covered(dtype)
    rows = 4096 if DEVICE.type == "cuda" else 67
    for act, form in (("swiglu", "split"), ("geglu_tanh", "packed")):
        inputs = make_case(form, (rows, 4097), dtype, ("contiguous", "contiguous"), 1.0, 3)
        dy = kc.make_input((rows, 4097), dtype, DEVICE, "contiguous", seed=4)
        ours = calls(act, form)[0]
        outs = []
        for _ in range(2):
            with kp_core.record_launches() as rec:
                outs.append(grads(ours, inputs, dy))
            kc.assert_kernel_ran(rec, *ops_of(form))
        for a, b in zip(*outs):
            assert torch.equal(a, b), "repeated calls differ"


@pytest.mark.conformance(kernel="glu", prop="zero_size")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_zero_size(dtype):
    for shape in [(0, 8), (3, 0, 5), (4, 0)]:
        for act, form in zip(ACTS, FORMS * 2):
            inputs = [t.requires_grad_() for t in make_case(form, shape, dtype, ("contiguous",) * 2, 1.0, 0)]
            ours, _, lowp = calls(act, form)
            with kp_core.record_launches() as rec:
                y = ours(*inputs)
                y.sum().backward()
            # Documented behaviour: an empty input launches no kernel (nothing to compute, no empty grid).
            assert rec.backends() <= {kp_core.REFERENCE}, f"an empty input launched {rec.launches}"
            expected = lowp(*inputs)
            assert y.shape == expected.shape and y.dtype == expected.dtype
            assert all(t.grad.shape == t.shape and t.grad.dtype == t.dtype for t in inputs)


def _pair(d):
    return dict(gate=torch.randn(3, 16, device=d), up=torch.randn(3, 16, device=d))


def _halves(fn):
    """torch on a packed [..., 2H] input: fn(gate, up) on its halves."""
    return lambda input, **kw: fn(*input.chunk(2, -1), **kw)


def _torch_geglu(gate, up, approximate="none"):
    return F.gelu(gate, approximate=approximate) * up


GATE = fuzz.Tensor(DTYPES, ranked=False, first=True)
UP = fuzz.Tensor(DTYPES, sized=(0, 1))
PACKED = fuzz.Tensor(DTYPES, sized=(1,), ranked=False, first=True)  # an odd last dim is refused
APPROXIMATE = fuzz.Scalar(bad=("erf", None, 1))
FLOAT8_IN = (torch.float16, torch.bfloat16, torch.float32)

GLU_TARGETS = [
    fuzz.Target(
        "kp_norms.swiglu",
        "kp-norms",
        kp_norms.swiglu,
        _pair,
        dict(gate=GATE, up=UP),
        torch_fn=lambda gate, up: F.silu(gate) * up,
        zero=lambda d: dict(gate=torch.randn(0, 16, device=d), up=torch.randn(0, 16, device=d)),
        aliases=(("gate", "up"),),
    ),
    fuzz.Target(
        "kp_norms.geglu",
        "kp-norms",
        kp_norms.geglu,
        lambda d: dict(_pair(d), approximate="tanh"),
        dict(gate=GATE, up=UP, approximate=APPROXIMATE),
        torch_fn=_torch_geglu,
        aliases=(("gate", "up"),),
    ),
    fuzz.Target(
        "kp_norms.swiglu_packed",
        "kp-norms",
        kp_norms.swiglu_packed,
        lambda d: dict(input=torch.randn(3, 32, device=d)),
        dict(input=PACKED),
        torch_fn=_halves(lambda gate, up: F.silu(gate) * up),
        zero=lambda d: dict(input=torch.randn(2, 0, 32, device=d)),
    ),
    fuzz.Target(
        "kp_norms.geglu_packed",
        "kp-norms",
        kp_norms.geglu_packed,
        lambda d: dict(input=torch.randn(3, 32, device=d)),
        dict(input=PACKED, approximate=APPROXIMATE),
        torch_fn=_halves(_torch_geglu),
    ),
    fuzz.Target(
        "kp_norms.glu_float8",
        "kp-norms",
        kp_norms.glu_float8,
        lambda d: dict(_pair(d), granularity="rowwise"),
        dict(
            gate=fuzz.Tensor(FLOAT8_IN, ranked=False, first=True),
            up=fuzz.Tensor(FLOAT8_IN, sized=(0, 1)),
            activation=fuzz.Scalar(bad=("relu", None)),
            granularity=fuzz.Scalar(bad=("blockwise", None)),
            float8_dtype=fuzz.Scalar(bad=(torch.int8, torch.float16)),
            power_of_2=fuzz.Scalar(bad=(1, None)),
        ),
        zero=lambda d: dict(gate=torch.randn(0, 16, device=d), up=torch.randn(0, 16, device=d)),
        aliases=(("gate", "up"),),
    ),
    fuzz.Target(
        "kp_norms.GatedMLP",
        "kp-norms",
        lambda module, input: module(input),
        lambda d: dict(module=kp_norms.GatedMLP(16, 32, device=d), input=torch.randn(3, 16, device=d)),
        dict(input=fuzz.Tensor((torch.float32,), sized=(1,), ranked=False, first=True)),
        torch_fn=lambda module, input: module.down_proj(F.silu(module.gate_proj(input)) * module.up_proj(input)),
    ),
    fuzz.Target(
        "kp_norms.GatedMLP(...)",
        "kp-norms",
        kp_norms.GatedMLP,
        lambda d: dict(hidden_size=16, intermediate_size=32, activation="silu", device=d),
        dict(
            hidden_size=fuzz.Scalar(bad=(-1, 16.0, "16")),
            intermediate_size=fuzz.Scalar(bad=(-1, None)),
            activation=fuzz.Scalar(bad=("relu", None)),
        ),
        launches=False,
    ),
]


test_bad_input_fuzz = kc.fuzz_test("glu", GLU_TARGETS)


@pytest.mark.conformance(kernel="glu", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    kc.skip_if_not_covered(dtype)
    for layout, activation in (("row_strided", Activation.SILU), ("transposed", Activation.GELU_TANH)):
        g, u = (kc.make_input((37, 130), dtype, DEVICE, layout, seed=i).requires_grad_() for i in (1, 2))
        x = kc.make_input((37, 260), dtype, DEVICE, layout, seed=3).requires_grad_()
        dy = kc.make_input((37, 130), dtype, DEVICE, layout, seed=4)
        with kp_core.record_launches() as rec:
            act = int(activation)
            torch.library.opcheck(glu_mod.GLU.op, (g, u, act))
            torch.library.opcheck(glu_mod.GLU.backward_op, (dy, g.detach(), u.detach(), act))
            torch.library.opcheck(glu_mod.GLU_PACKED.op, (x, act))
            torch.library.opcheck(glu_mod.GLU_PACKED.backward_op, (dy, x.detach(), act))
        kc.assert_kernel_ran(rec, *SPLIT_OPS, *PACKED_OPS)


@pytest.mark.conformance(kernel="glu", prop="compile")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_compile_fullgraph_equals_eager(dtype):
    kc.skip_if_not_covered(dtype)
    torch._dynamo.reset()

    def f(g, u, x):
        return kp_norms.swiglu(g * 2, u) + kp_norms.geglu_packed(x, approximate="tanh") * 2

    compiled = torch.compile(f, fullgraph=True)
    for layout, shape in zip(("contiguous", "transposed"), FIXED_SHAPES[:2]):
        g, u = make_case("split", shape, dtype, (layout, "row_strided"), 1.0, 5)
        (x,) = make_case("packed", shape, dtype, (layout,), 1.0, 6)
        dy = kc.make_input(shape, dtype, DEVICE, "contiguous", seed=7)
        results = []
        for fn in (f, compiled):
            with kp_core.record_launches() as rec:
                results.append(grads(fn, (g, u, x), dy))
            kc.assert_kernel_ran(rec, *SPLIT_OPS, *PACKED_OPS)
        for name, a, b in zip(("y", "dgate", "dup", "dinput"), *results):
            # The ops are opaque to the compiler, so the same kernels compute both; what Inductor fuses around
            # them (* 2, +) is exact or rounds once in every dtype here, as eager does.
            assert torch.equal(a, b), (
                f"{name}: compiled differs from eager by {(a.double() - b.double()).abs().max():.3e}"
            )


# ---- the float8 copy of the output (kp::glu_float8) ----

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT8_ACTS = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}


def bits_equal(what, ours, ref):
    if ours.dtype in FP8:
        ours, ref = ours.view(torch.uint8), ref.view(torch.uint8)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def check_float8(act, gate, up, granularity, fp8, power_of_2, soft=None, dy=None):
    """glu_float8: its kernels ran; the output bit for bit the plain function's (held to the rule by test_values),
    the float8 copy bit for bit the recipe's cast of it; with dy, the gradients bit for bit the plain function's."""
    convert = contextlib.nullcontext() if soft is None else kp_core.pinned("fp8_convert", soft=soft)
    cast = dict(float8_dtype=fp8, granularity=granularity, power_of_2=power_of_2)
    leaves = [t.detach().requires_grad_(dy is not None) for t in (gate, up)]
    with convert, kp_core.record_launches() as rec:
        out = kp_norms.glu_float8(*leaves, FLOAT8_ACTS[act], **cast)
    if gate.numel():
        kc.assert_kernel_ran(rec, FLOAT8_OPS[0])
        assert rec.kernels(FLOAT8_OPS[0]) == {"_glu_fwd", "_glu_cast_float8"}, rec.launches
    plain_leaves = [t.detach().requires_grad_(dy is not None) for t in (gate, up)]
    plain = ACTS[act].split(*plain_leaves)
    bits_equal(f"{act} output against the plain function", out.output, plain)
    data, scale, amax = quantize_fp8(out.output.detach(), fp8, granularity, None, None, power_of_2)
    assert out.data.dtype == fp8 and out.scale.shape == scale.shape and out.amax.shape == amax.shape
    bits_equal(f"{act} float8 data", out.data, data)
    bits_equal(f"{act} float8 scale", out.scale, scale)
    bits_equal(f"{act} float8 amax", out.amax, amax)
    if dy is not None and gate.numel():
        with kp_core.record_launches() as rec:
            out.output.backward(dy)
        kc.assert_kernel_ran(rec, FLOAT8_OPS[1])
        plain.backward(dy)
        for name, a, p in zip(("dgate", "dup"), leaves, plain_leaves):
            bits_equal(f"{act} {name} against the plain function", a.grad, p.grad)


@pytest.mark.conformance(kernel="glu", prop="float8_output")
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=kc.dtype_id)
@given(
    **case,
    granularity=st.sampled_from(["tensorwise", "rowwise"]),
    fp8=st.sampled_from(FP8),
    power_of_2=st.booleans(),
    soft=st.sampled_from([None] if kc.interpreting() else [None, True]),
    with_grads=st.booleans(),
)
def test_float8_output(
    dtype, act, form, shape, layouts, scale, seed, family, granularity, fp8, power_of_2, soft, with_grads
):
    kc.skip_if_not_covered(dtype)
    gate, up = make_case("split", shape, dtype, layouts, scale, seed, family)
    dy = kc.make_input(shape, dtype, DEVICE, "contiguous", seed=seed + 2) if with_grads else None
    check_float8(act, gate, up, granularity, fp8, power_of_2, soft, dy)


@pytest.mark.conformance(kernel="glu", prop="float8_output")
@pytest.mark.parametrize("fp8", FP8, ids=kc.dtype_id)
def test_float8_conversions_agree(fp8):
    """Both float8 conversions (the hardware's, kp's integer one), tensorwise and rowwise, on outputs every correct
    rounding gets exact (under the interpreter too): gates of 32 or 64, where silu and gelu are the identity in
    float32, times ups the float8 format holds, with power-of-two scales; then power-of-two scales off with the
    default conversion on drawn inputs: 40 rows (several row blocks under the interpreter's big tiles too) of 1100
    columns (two column blocks under the interpreter, one on a GPU; masked lanes), one row all zero, and a single
    row; and the 40 rows again with both kernels' tiles pinned 512 wide, so that a row spans three programs (the
    amax of each row, and of the tensor, merged by atomic max) on a GPU too."""
    g = torch.tensor([32.0, 64.0]).repeat(4, 550)
    u = torch.tensor([0.5, 1.0, 1.5, -2.0, 3.0, -0.75, 1.75, 0.25, -1.0, 0.375]).repeat(4, 110)
    gate, up = g.to(DEVICE, torch.float16), u.to(DEVICE, torch.float16)
    drawn = make_case("split", (40, 1100), torch.float32, ("contiguous", "contiguous"), 1.0, 7)
    drawn[0][2] = 0.0
    for act in ("swiglu", "geglu"):
        for granularity in ("tensorwise", "rowwise"):
            for soft in (False, True):
                check_float8(act, gate, up, granularity, fp8, True, soft)
            check_float8(act, *drawn, granularity, fp8, False)
            check_float8(act, drawn[0][3:4], drawn[1][3:4], granularity, fp8, False)
            with narrow_tiles():
                check_float8(act, *drawn, granularity, fp8, False)


@contextlib.contextmanager
def narrow_tiles():
    """glu_float8's two kernels on tiles 512 columns wide (1024 elements; the interpreter keeps its own count)."""
    with kp_core.pinned("_glu_fwd_float8", elements=1024, max_block_n=512, num_warps=4):
        with kp_core.pinned("_glu_cast_float8", elements=1024, max_block_n=512, num_warps=4):
            yield


@pytest.mark.conformance(kernel="glu", prop="zero_size")
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_float8_zero_size(granularity):
    """Empty inputs, empty rows included: no launch, and the scale and amax of the recipe's cast (amax 0)."""
    for shape in [(0, 8), (3, 0), (2, 0, 5), (4, 3, 0)]:
        gate, up = (torch.ones(shape, device=DEVICE) for _ in range(2))
        with kp_core.record_launches() as rec:
            out = kp_norms.glu_float8(gate, up, granularity=granularity)
        assert rec.backends() <= {kp_core.REFERENCE}, f"an empty input launched {rec.launches}"
        data, scale, amax = quantize_fp8(out.output, torch.float8_e4m3fn, granularity)
        assert out.output.shape == out.data.shape == gate.shape
        bits_equal("scale", out.scale, scale)
        bits_equal("amax", out.amax, amax)


@pytest.mark.conformance(kernel="glu", prop="opcheck")
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_opcheck_float8(granularity):
    g, u = (kc.make_input((37, 130), torch.float32, DEVICE, "contiguous", seed=i).requires_grad_() for i in (1, 2))
    with kp_core.record_launches() as rec:
        args = (g, u, int(Activation.SILU), torch.float8_e4m3fn, granularity == "rowwise", False)
        torch.library.opcheck(glu_mod.GLU_FLOAT8.op, args)
    kc.assert_kernel_ran(rec, *FLOAT8_OPS)


@pytest.mark.conformance(kernel="glu", prop="compile")
def test_compile_float8_equals_eager():
    torch._dynamo.reset()

    def f(g, u):
        out = kp_norms.glu_float8(g * 2, u, granularity="rowwise")
        return out.output, out.data.float() * out.scale

    compiled = torch.compile(f, fullgraph=True)
    g, u = (kc.make_input((4, 9, 64), torch.float32, DEVICE, "contiguous", seed=i) for i in (1, 2))
    results = []
    for fn in (f, compiled):
        with kp_core.record_launches() as rec:
            results.append(fn(g, u))
        kc.assert_kernel_ran(rec, FLOAT8_OPS[0])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_reference_is_independent():
    """The references must not route through kp (sanity check on the spec itself)."""
    g = torch.linspace(-4, 4, 9, dtype=torch.float64)
    with kp_core.record_launches() as rec:
        values = [fn(g) for fn in (silu64, gelu64, gelu_tanh64)]
    assert rec.count() == 0
    torch.testing.assert_close(values[0], F.silu(g))
    torch.testing.assert_close(values[1], F.gelu(g))
    torch.testing.assert_close(values[2], F.gelu(g, approximate="tanh"))
