"""Conformance spec for kp-precision's fake quantisation and QAT (kp::fake_quantize, prepare_qat, convert).

Reference: symmetric integer quantisation written in plain PyTorch (kp_conformance.references.fake_quantize_int:
scale = amax / qmax per group, round half to even, clamp), compared bit for bit; the float8 format against the
float8 recipe (references.quantize_fp8, rowwise). Gradients are the straight-through estimator's: the upstream
gradient unchanged. A converted model must compute exactly what the prepared one did.
"""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import kp_conformance as kc
import kp_core
import kp_precision
from kp_conformance import fuzz
from kp_conformance.references import dequantize_fp8, fake_quantize_int, quantize_fp8
from kp_precision.ops import fake_quantize as fq_mod

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TIER = kc.current()
DEVICE = kc.device()
OP = "kp::fake_quantize"
QMAX = {"int8": 127, "int4": 7}
GROUPS = (None, 8, 32, 128)

kc.declare(
    kc.Spec(
        name="fake_quantize",
        package="kp-precision",
        ops=(OP,),
        reference=(
            "symmetric integer quantisation in plain PyTorch (scale = amax / qmax per group or row, round half to "
            "even, clamp to [-qmax-1, qmax], dequantise in float32, one rounding); fp8 by the rowwise float8 "
            "recipe; straight-through gradients; converted model equal to the prepared one bit for bit"
        ),
        dtypes=DTYPES,
        properties=(
            "values",
            "gradient",
            "prepare_convert",
            "state_dict",
            "no_mutation",
            "zero_size",
            "bad_input",
            "opcheck",
            "compile",
        ),  # fmt: skip
    )
)


def reference(x, fmt, group):
    if fmt == "fp8":
        data, scale, _ = quantize_fp8(x, torch.float8_e4m3fn, "rowwise")
        return dequantize_fp8(data, scale, "rowwise", dtype=torch.float32).to(x.dtype)
    return fake_quantize_int(x, QMAX[fmt], group or 0)[0]


def check(x, fmt, group):
    with kp_core.record_launches() as rec:
        y = kp_precision.fake_quantize(x, fmt, group_size=group)
    if x.numel():
        kc.assert_kernel_ran(rec, "kp::quantize" if fmt == "fp8" else OP)
    ref = reference(x, fmt, group)
    assert y.dtype == x.dtype and y.shape == x.shape
    torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{fmt} group {group}: {m}")


@st.composite
def cases(draw):
    group = draw(st.sampled_from(GROUPS))
    unit = group or 1
    k = unit * draw(st.integers(1, max(1, min(TIER.max_cols, 8192) // unit)))
    rows = draw(st.one_of(st.sampled_from([1, 2, 17, 33]), st.integers(1, max(1, TIER.max_numel // k))))
    return dict(
        shape=(rows, k) if draw(st.booleans()) else (1, rows, k),
        fmt=draw(st.sampled_from(["int8", "int4", "fp8"])),
        group=group,
        layout=draw(st.sampled_from(["contiguous", "row_strided"])),
        family=draw(st.sampled_from(kc.FAMILIES)),
        scale=draw(st.sampled_from([1.0, 1e-3, 300.0])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.conformance(kernel="fake_quantize", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=cases())
def test_values(dtype, c):
    kc.skip_if_not_covered(dtype)
    group = None if c["fmt"] == "fp8" else c["group"]
    x = kc.make_input(c["shape"], dtype, DEVICE, c["layout"], scale=c["scale"], seed=c["seed"], family=c["family"])
    check(x, c["fmt"], group)


@pytest.mark.conformance(kernel="fake_quantize", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_ties_and_edges(dtype):
    """Values exactly halfway between codes (ties to even), at the group's amax, zero groups, tiny groups."""
    kc.skip_if_not_covered(dtype)
    codes = torch.arange(-7, 8, dtype=torch.float32)
    halves = codes[:-1] + 0.5
    row = torch.cat([torch.tensor([7.0]), codes, halves, -halves, torch.zeros(1)])  # amax 7 -> scale 1 for int4
    x = torch.stack([row, row * 2.0**-10, torch.zeros_like(row), torch.full_like(row, 1e-30)])
    x = torch.cat([x, torch.zeros(4, 64 - x.shape[1])], dim=1).to(device=DEVICE, dtype=dtype)
    for fmt, group in (("int4", None), ("int4", 64), ("int8", None), ("int8", 8)):
        check(x, fmt, group)


@pytest.mark.conformance(kernel="fake_quantize", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_many_tiles(dtype):
    """Tiles pinned small (64 elements a program): 32-wide rows two per program, and 2048-wide rows in two
    1024-wide column tiles, so rows and columns both span several programs."""
    kc.skip_if_not_covered(dtype)
    narrow = kc.make_input((150, 32), dtype, DEVICE, "row_strided", seed=7, family="mixed")
    wide = kc.make_input((5, 2048), dtype, DEVICE, "contiguous", seed=8, family="one_huge")
    # the interpreter multiplies the element count by 16 (kp_precision.ops.fake_quantize)
    with kp_core.pinned("_fake_quantize", elements=64 if DEVICE.type == "cuda" else 4):
        for x, fmt, group in ((narrow, "int8", None), (narrow, "int4", 16), (wide, "int4", 32), (wide, "int8", None)):
            check(x, fmt, group)


@pytest.mark.conformance(kernel="fake_quantize", prop="gradient")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_gradient_is_straight_through(dtype):
    x = kc.make_input((9, 64), dtype, DEVICE, "contiguous", seed=1).requires_grad_()
    g = kc.make_input((9, 64), dtype, DEVICE, "contiguous", seed=2)
    for fmt, group in (("int8", None), ("int4", 32), ("fp8", None)):
        x.grad = None
        kp_precision.fake_quantize(x, fmt, group_size=group).backward(g)
        assert torch.equal(x.grad, g), f"{fmt}: the gradient is not the upstream one"


def small_model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 32)).to(device=DEVICE, dtype=dtype)


SETTINGS = [
    dict(weight="int4"),
    dict(weight="int4", group_size=None, activation="int8"),
    dict(weight="int8"),
    dict(weight="int8", group_size=32, activation="fp8"),
    dict(weight="fp8", activation="int8"),
]


@pytest.mark.conformance(kernel="fake_quantize", prop="prepare_convert")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_prepare_and_convert_agree(dtype, setting):
    """After training steps, the converted model's outputs equal the prepared model's bit for bit (its weights
    dequantise to the fake-quantised values; activations take the same fake quant), and each prepared layer's
    weight fake quant matches the reference."""
    kc.skip_if_not_covered(dtype)
    model = kp_precision.prepare_qat(small_model(), **setting)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for step in range(2):
        x = kc.make_input((20, 64), torch.float32, DEVICE, "contiguous", seed=step)
        with kp_core.record_launches() as rec:
            model(x).square().mean().backward()
        kc.assert_kernel_ran(rec, OP if setting["weight"] != "fp8" else "kp::quantize")
        opt.step()
        opt.zero_grad()
    model = model.to(dtype)
    x = kc.make_input((3, 5, 64), dtype, DEVICE, "contiguous", seed=9)
    with torch.no_grad():
        prepared = model(x)
        layer = model[0]
        group = layer.group_size
        ref = reference(layer.weight, layer.weight_dtype, group if layer.weight_dtype != "fp8" else None)
        torch.testing.assert_close(
            kp_precision.fake_quantize(layer.weight, layer.weight_dtype, group_size=group), ref, rtol=0, atol=0
        )
        converted = kp_precision.convert(model)
        assert isinstance(converted[0], kp_precision.QuantizedLinear)
        assert torch.equal(converted(x), prepared), "the converted model computes something else than the prepared one"


@pytest.mark.conformance(kernel="fake_quantize", prop="state_dict")
def test_state_dict():
    """A prepared model's state_dict is the original's (loads into nn.Linear and back); a converted model's holds
    the quantised weights and loads into another converted model exactly."""
    model = small_model()
    keys = model.state_dict().keys()
    prepared = kp_precision.prepare_qat(copy.deepcopy(model))
    assert prepared.state_dict().keys() == keys
    model.load_state_dict(prepared.state_dict(), strict=True)
    converted = kp_precision.convert(prepared)
    again = kp_precision.convert(kp_precision.prepare_qat(small_model()))
    again.load_state_dict(converted.state_dict(), strict=True)
    x = torch.randn(4, 64, device=DEVICE)
    assert torch.equal(again(x), converted(x))
    assert converted[0].qweight.dtype == torch.uint8 and converted[0].qweight.shape == (96, 32)  # int4 pairs


@pytest.mark.conformance(kernel="fake_quantize", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_no_mutation(dtype):
    x = kc.make_input((7, 64), dtype, DEVICE, "row_strided", seed=3)
    before = x.clone()
    for fmt, group in (("int8", None), ("int4", 16), ("fp8", None)):
        kp_precision.fake_quantize(x, fmt, group_size=group)
        assert torch.equal(x, before), f"fake_quantize {fmt} modified its input"


@pytest.mark.conformance(kernel="fake_quantize", prop="zero_size")
def test_zero_size():
    with kp_core.record_launches() as rec:
        y = kp_precision.fake_quantize(torch.empty(0, 64, device=DEVICE), "int4", group_size=32)
    assert y.shape == (0, 64) and rec.backends() <= {kp_core.REFERENCE}


_x = lambda d, shape=(4, 64), dtype=torch.float32: torch.ones(shape, dtype=dtype, device=d)  # noqa: E731
BAD_INPUTS = [
    ("integer input", lambda d: kp_precision.fake_quantize(_x(d, dtype=torch.int32)), TypeError, "input"),
    ("unknown format", lambda d: kp_precision.fake_quantize(_x(d), "int2"), ValueError, "dtype"),
    ("group not a power of two", lambda d: kp_precision.fake_quantize(_x(d), group_size=48), ValueError, "group_size"),
    (
        "group not dividing",
        lambda d: kp_precision.fake_quantize(_x(d, (4, 48)), group_size=32),
        ValueError,
        "group_size",
    ),
    ("group with fp8", lambda d: kp_precision.fake_quantize(_x(d), "fp8", group_size=32), ValueError, "group_size"),
    ("row too long", lambda d: kp_precision.fake_quantize(_x(d, (1, 70000))), ValueError, "group_size"),
    (
        "prepare weight format",
        lambda d: kp_precision.prepare_qat(nn.Linear(64, 8), weight="int2"),
        ValueError,
        "weight",
    ),
    (
        "prepare activation",
        lambda d: kp_precision.prepare_qat(nn.Linear(64, 8), activation="int4"),
        ValueError,
        "activation",
    ),
    (
        "prepare fp8 with groups",
        lambda d: kp_precision.prepare_qat(nn.Linear(64, 8), weight="fp8", group_size=32),
        ValueError,
        "group_size",
    ),
    ("convert a list", lambda d: kp_precision.convert([nn.Linear(64, 8)]), TypeError, "model"),
    (
        "QAT input",
        lambda d: kp_precision.prepare_qat(nn.Sequential(nn.Linear(64, 8)))(_x(d, (2, 32)).cpu()),
        ValueError,
        "in_features",
    ),
]


test_bad_input = kc.bad_input_test("fake_quantize", BAD_INPUTS, DEVICE)


def test_layers_that_do_not_fit_stay():
    model = nn.Sequential(nn.Linear(64, 8), nn.Linear(8, 48))
    with pytest.warns(UserWarning, match=r"1 \(8 -> 48: in_features is not a multiple of group_size 32"):
        kp_precision.prepare_qat(model)
    assert isinstance(model[0], kp_precision.QATLinear) and type(model[1]) is nn.Linear


@pytest.mark.conformance(kernel="fake_quantize", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    x = kc.make_input((17, 96), dtype, DEVICE, "row_strided", seed=4)
    with kp_core.record_launches() as rec:
        for qmax, group in ((127, 0), (7, 32)):
            torch.library.opcheck(fq_mod.FAKE_QUANTIZE.op, (x, qmax, group))
    kc.assert_kernel_ran(rec, OP)


@pytest.mark.conformance(kernel="fake_quantize", prop="compile")
def test_compile_fullgraph_equals_eager():
    """A prepared layer, forward and backward, compiles to one graph: eager's bits forward (one layer: between
    layers Inductor would fuse GELU its own way, a difference of an ulp that is not the fake quant's); the weight's
    gradient to float32 rounding (on a GPU Inductor sums the layer's own matmul gradient in its own order)."""
    torch._dynamo.reset()
    x = kc.make_input((20, 64), torch.float32, DEVICE, "contiguous", seed=5)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = kp_precision.prepare_qat(nn.Sequential(nn.Linear(64, 32).to(DEVICE)), weight="int4", activation="int8")
        fn = torch.compile(model, fullgraph=True) if compiled else model
        with kp_core.record_launches() as rec:
            y = fn(x)
            y.sum().backward()
        kc.assert_kernel_ran(rec, OP)
        results.append((y, model[0].weight.grad))
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], rtol=2**-20, atol=2**-20)


def test_reference_is_independent():
    x = torch.tensor([[7.0, 2.5, 3.5, -2.5, 0.4]])
    with kp_core.record_launches() as rec:
        y, codes = fake_quantize_int(x, 7, 0)
    assert rec.count() == 0 and codes.tolist() == [[7.0, 2.0, 4.0, -2.0, 0.0]]


FUZZ_TARGETS = [
    fuzz.Target(
        "kp_precision.fake_quantize",
        "kp-precision",
        kp_precision.fake_quantize,
        lambda d: dict(input=torch.randn(4, 64, device=d), dtype="int4", group_size=32),
        dict(
            input=fuzz.Tensor(DTYPES, sized=(1,), ranked=False, words=("group_size",), first=True),
            dtype=fuzz.Scalar(bad=("int3", torch.int8, None)),
            group_size=fuzz.Scalar(bad=(0, -32, 24, 32.0, "32")),
        ),
        zero=lambda d: dict(input=torch.randn(0, 64, device=d), dtype="int4", group_size=32),
    ),
]


test_bad_input_fuzz = kc.fuzz_test("fake_quantize", FUZZ_TARGETS)
