"""Conformance spec for kp-precision's MX formats (kp::mx_quantize, kp::mx_dequantize, kp::mx_matmul).

Reference: the OCP Microscaling Formats v1.0 conversion written in plain PyTorch (kp_conformance.references
.mx_quantize: the shared exponent from floor(log2 amax) in float64, torch's own float8 cast, fp4 by nearest grid
value with ties to even). Scales and elements are compared exactly (elements of NaN-scaled blocks carry nothing
and are not compared), dequantised values exactly; the matmul against a float64 matmul of the dequantised
operands, by the 2x rule against PyTorch's float32 matmul of the same.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kp_conformance as kc
import kp_core
import kp_precision
from kp_conformance import fuzz
from kp_conformance.references import FP4_GRID, MX_ELEMENTS, mx_quantize, mx_values
from kp_precision.ops import mx as mx_mod

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ELEMS = tuple(MX_ELEMENTS)
TIER = kc.current()
DEVICE = kc.device()
OPS = ("kp::mx_quantize", "kp::mx_dequantize", "kp::mx_matmul")

kc.declare(
    kc.Spec(
        name="mx",
        package="kp-precision",
        ops=OPS,
        reference=(
            "OCP MX v1.0 conversion in plain PyTorch: X = 2**(floor(log2 amax) - emax) per 32-block (E8M0, NaN for "
            "a NaN/inf amax), elements RNE(clamp(x / X)) by torch's float8 cast or the fp4 grid; matmul in float64 "
            "of the dequantised operands, 2x rule against torch's float32 matmul"
        ),
        dtypes=DTYPES,
        properties=(
            "values",
            "every_value",
            "conversions_agree",
            "dequantize",
            "matmul",
            "no_mutation",
            "zero_size",
            "bad_input",
            "opcheck",
            "compile",
        ),
    )
)


def element_values(t):
    """kp's elements as float64 values, (..., K)."""
    if t.elem != "fp4_e2m1":
        return t.data.double()
    codes = torch.stack([t.data & 0xF, t.data >> 4], dim=-1).flatten(-2).long()
    mag = torch.tensor(FP4_GRID, dtype=torch.float64, device=t.data.device)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def check(x, elem):
    """Quantise with kp (the kernel ran) and compare scales, elements and dequantised values with the spec."""
    with kp_core.record_launches() as rec:
        t = kp_precision.mx_quantize(x, elem)
    if x.numel():
        kc.assert_kernel_ran(rec, "kp::mx_quantize")
    elems, byte = mx_quantize(x, elem)
    assert torch.equal(t.scale.long(), byte), (
        f"{elem}: scales differ at {(t.scale.long() != byte).nonzero()[:4].tolist()}"
    )
    ours = element_values(t)
    live = (byte != 255).repeat_interleave(32, -1)  # a NaN scale makes its block's elements meaningless
    same = (ours == elems) | (ours.isnan() & elems.isnan()) | ~live
    if not bool(same.all()):
        i = tuple((~same).nonzero()[0].tolist())
        raise AssertionError(f"{elem}: element {i}: ours {ours[i].item()}, spec {elems[i].item()} (x {x[i].item()})")
    return t, mx_values(elems, byte)


@st.composite
def cases(draw):
    k = 32 * draw(st.integers(1, max(1, min(TIER.max_cols, 4096) // 32)))
    rows = draw(st.one_of(st.sampled_from([1, 2, 3, 17, 33]), st.integers(1, max(1, TIER.max_numel // k))))
    shape = (rows, k) if draw(st.booleans()) else (rows, 1, k)
    return dict(
        shape=shape,
        elem=draw(st.sampled_from(ELEMS)),
        layout=draw(st.sampled_from(["contiguous", "row_strided"])),
        family=draw(st.sampled_from(kc.FAMILIES)),
        scale=draw(st.sampled_from([1.0, 1e-30, 1e30, 3e-3])),
        specials=draw(st.sampled_from([0, 0, 0, 1, 2])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.conformance(kernel="mx", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=cases())
def test_values(dtype, c):
    # no skip: MX quantisation stores elements and scale bytes, never bfloat16
    x = kc.make_input(c["shape"], torch.float32, DEVICE, c["layout"], seed=c["seed"], family=c["family"])
    x = (x.double() * c["scale"]).to(dtype)  # float32 first: the family's values may not fit float16
    if c["specials"] and x.numel():
        at = torch.unravel_index(torch.tensor(c["seed"] % x.numel()), x.shape)
        x[at] = float("nan") if c["specials"] == 1 else -float("inf")
    check(x, c["elem"])


def grid_inputs(elem):
    """Blocks that reach every element value and every tie: each block holds the format's largest value (so the
    shared exponent is known) times 2**e, then element values, midpoints between neighbours and one float32 ulp
    either side of them, all times 2**e, for e across E8M0's range; plus zero blocks, subnormal amaxes and
    values past the range (saturation)."""
    emax, vmax, dtype = MX_ELEMENTS[elem]
    if dtype is None:
        vals = torch.tensor(FP4_GRID)
    else:
        vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        vals = vals[vals.isfinite() & (vals >= 0)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat([vals, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    pts = torch.cat([pts, -pts])
    pad = -len(pts) % 31
    pts = torch.cat([pts, pts[:pad]]).view(-1, 31)
    blocks = torch.cat([torch.full((len(pts), 1), vmax), pts], dim=1)  # amax = vmax: shared exponent 0
    rows = [blocks * 2.0**e for e in (-100, -10, 0, 7, 60)]
    odd = torch.tensor([vmax * 1.5] + [1.0] * 31)  # amax past the largest value: exponent + 1, saturation
    tiny = torch.full((32,), 1e-40)  # a subnormal amax: the smallest scale, 2**-127
    rows.append(torch.stack([odd, -odd, torch.zeros(32), tiny]))
    return torch.cat(rows).reshape(1, -1).float()


@pytest.mark.conformance(kernel="mx", prop="every_value")
@pytest.mark.parametrize("elem", ELEMS)
def test_every_value(elem):
    x = grid_inputs(elem).to(DEVICE)
    t, ref = check(x, elem)
    y = kp_precision.mx_dequantize(t)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.conformance(kernel="mx", prop="conversions_agree")
@pytest.mark.parametrize("elem", ["fp8_e4m3", "fp8_e5m2"])
def test_conversions_agree(elem):
    """fp8 elements through both conversions: the hardware's and the integer one. Under the interpreter, whose
    float8 rounding is not round-to-nearest-even, the hardware path only on values the format holds exactly."""
    x = grid_inputs(elem)
    if kc.interpreting():
        _, vmax, dtype = MX_ELEMENTS[elem]
        vals = torch.arange(256, dtype=torch.uint8).view(dtype).float()
        vals = vals[vals.isfinite()]
        vals = torch.cat([vals, vals[: -len(vals) % 31]]).view(-1, 31)
        x = torch.cat([torch.full((len(vals), 1), vmax), vals], dim=1).reshape(1, -1)
    for soft in (False, True):
        with kp_core.pinned("fp8_convert", soft=soft):
            check(x.to(DEVICE), elem)


@pytest.mark.conformance(kernel="mx", prop="dequantize")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("elem", ELEMS)
def test_dequantize(dtype, elem):
    kc.skip_if_not_covered(dtype)
    x = kc.make_input((33, 96), torch.float32, DEVICE, "contiguous", seed=1, family="mixed")
    x[2, 40] = float("nan")
    t, ref = check(x, elem)
    with kp_core.record_launches() as rec:
        y = kp_precision.mx_dequantize(t, dtype)
    kc.assert_kernel_ran(rec, "kp::mx_dequantize")
    torch.testing.assert_close(y, ref.float().to(dtype), rtol=0, atol=0, equal_nan=True)


@st.composite
def mm_cases(draw):
    cap = max(32, min(math.isqrt(TIER.max_numel) // 2, 4096))
    return dict(
        m=draw(st.one_of(st.sampled_from([1, 15, 33]), st.integers(1, cap))),
        n=draw(st.one_of(st.sampled_from([1, 16, 40]), st.integers(1, cap))),
        k=32 * draw(st.integers(1, cap // 32)),
        elem_a=draw(st.sampled_from(ELEMS)),
        elem_b=draw(st.sampled_from(ELEMS)),
        family=draw(st.sampled_from(kc.FAMILIES)),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.conformance(kernel="mx", prop="matmul")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=mm_cases())
def test_matmul(dtype, c):
    kc.skip_if_not_covered(dtype)
    a = kp_precision.mx_quantize(
        kc.make_input((c["m"], c["k"]), torch.float32, DEVICE, "contiguous", seed=c["seed"], family=c["family"]),
        c["elem_a"],
    )
    b = kp_precision.mx_quantize(
        kc.make_input((c["n"], c["k"]), torch.float32, DEVICE, "contiguous", seed=c["seed"] + 1), c["elem_b"]
    )
    with kp_core.record_launches() as rec:
        y = kp_precision.mx_matmul(a, b, out_dtype=dtype)
    kc.assert_kernel_ran(rec, "kp::mx_matmul")
    av = mx_values(element_values(a), a.scale.long())
    bv = mx_values(element_values(b), b.scale.long())
    kc.check_close(f"mx_matmul {c}", y, av @ bv.t(), (av.float() @ bv.float().t()).to(dtype), dtype)


@pytest.mark.conformance(kernel="mx", prop="no_mutation")
def test_no_mutation():
    x = kc.make_input((5, 64), torch.float32, DEVICE, "row_strided", seed=2)
    before = x.clone()
    for elem in ELEMS:
        t = kp_precision.mx_quantize(x, elem)
        data, scale = t.data.view(torch.uint8).clone(), t.scale.clone()
        kp_precision.mx_matmul(t, t, out_dtype=torch.float32)
        kp_precision.mx_dequantize(t)
        assert torch.equal(x, before), "mx_quantize modified its input"
        assert torch.equal(t.data.view(torch.uint8), data) and torch.equal(t.scale, scale), (
            "an MX op modified its operand"
        )


@pytest.mark.conformance(kernel="mx", prop="zero_size")
@pytest.mark.parametrize("elem", ELEMS)
def test_zero_size(elem):
    w = kp_precision.mx_quantize(torch.ones(3, 64, device=DEVICE), elem)
    with kp_core.record_launches() as rec:
        t = kp_precision.mx_quantize(torch.empty(0, 64, device=DEVICE), elem)
        y = kp_precision.mx_dequantize(t)
        z = kp_precision.mx_matmul(t, w)
    assert rec.backends() <= {kp_core.REFERENCE}, f"an empty input launched {rec.launches}"
    assert t.scale.shape == (0, 2) and y.shape == (0, 64) and z.shape == (0, 3)


_x = lambda d, shape=(4, 64), dtype=torch.float32: torch.ones(shape, dtype=dtype, device=d)  # noqa: E731
BAD_INPUTS = [
    ("integer input", lambda d: kp_precision.mx_quantize(_x(d, dtype=torch.int32)), TypeError, "input"),
    ("float64 input", lambda d: kp_precision.mx_quantize(_x(d, dtype=torch.float64)), TypeError, "input"),
    ("K not a multiple of 32", lambda d: kp_precision.mx_quantize(_x(d, (4, 48))), ValueError, "multiple of 32"),
    ("unknown element format", lambda d: kp_precision.mx_quantize(_x(d), "fp6_e3m2"), ValueError, "elem"),
    ("dequantize a tensor", lambda d: kp_precision.mx_dequantize(_x(d)), TypeError, "MXTensor"),
    (
        "dequantize to int",
        lambda d: kp_precision.mx_dequantize(kp_precision.mx_quantize(_x(d)), torch.int8),
        TypeError,
        "dtype",
    ),
    (
        "data and scale disagree",
        lambda d: kp_precision.mx_dequantize(
            kp_precision.mx_quantize(_x(d))._replace(scale=torch.zeros(4, 3, dtype=torch.uint8, device=d))
        ),
        ValueError,
        "scale",
    ),
    (
        "matmul K mismatch",
        lambda d: kp_precision.mx_matmul(kp_precision.mx_quantize(_x(d)), kp_precision.mx_quantize(_x(d, (4, 96)))),
        ValueError,
        "share K",
    ),
    (
        "matmul 3-D",
        lambda d: kp_precision.mx_matmul(kp_precision.mx_quantize(_x(d, (2, 4, 64))), kp_precision.mx_quantize(_x(d))),
        ValueError,
        "share K",
    ),
    (
        "matmul out_dtype",
        lambda d: kp_precision.mx_matmul(
            kp_precision.mx_quantize(_x(d)), kp_precision.mx_quantize(_x(d)), out_dtype=torch.int32
        ),
        TypeError,
        "out_dtype",
    ),
]


test_bad_input = kc.bad_input_test("mx", BAD_INPUTS, DEVICE)


CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.conformance(kernel="mx", prop="opcheck")
@pytest.mark.parametrize("elem", ELEMS)
def test_opcheck(elem):
    x = kc.make_input((17, 96), torch.float32, DEVICE, "row_strided", seed=3)
    with kp_core.record_launches() as rec:
        # not test_schema: it compares inputs with torch.allclose, which float8 / packed bytes do not support
        torch.library.opcheck(mx_mod.MX_QUANTIZE.op, (x, elem), test_utils=CHECKS)
        data, scale = mx_mod.MX_QUANTIZE(x, elem)
        torch.library.opcheck(mx_mod.MX_DEQUANTIZE.op, (data, scale, elem, torch.float32), test_utils=CHECKS)
        args = (data, scale, data, scale, elem, elem, torch.float32)
        torch.library.opcheck(mx_mod.MX_MATMUL.op, args, test_utils=CHECKS)
    kc.assert_kernel_ran(rec, *OPS)


@pytest.mark.conformance(kernel="mx", prop="compile")
def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()

    def f(x, w):
        a, b = kp_precision.mx_quantize(x, "fp8_e4m3"), kp_precision.mx_quantize(w, "fp4_e2m1")
        return kp_precision.mx_matmul(a, b, out_dtype=torch.float32), kp_precision.mx_dequantize(b)

    x = kc.make_input((33, 128), torch.float32, DEVICE, "contiguous", seed=5)
    w = kc.make_input((48, 128), torch.float32, DEVICE, "contiguous", seed=6)
    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        with kp_core.record_launches() as rec:
            results.append(fn(x, w))
        kc.assert_kernel_ran(rec, *OPS)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_reference_is_independent():
    """The spec's conversion must not route through kp; and its ties go to the even element."""
    x = torch.tensor([[6.0, 5.0, 2.5, 1.25, 0.25, 0.75, -5.0] + [0.0] * 25])
    with kp_core.record_launches() as rec:
        elems, byte = mx_quantize(x, "fp4_e2m1")
    assert rec.count() == 0 and byte.tolist() == [[127]]
    assert elems[0, :7].tolist() == [6.0, 4.0, 2.0, 1.0, 0.0, 1.0, -4.0]


FUZZ_TARGETS = [
    fuzz.Target(
        "kp_precision.mx_quantize",
        "kp-precision",
        kp_precision.mx_quantize,
        lambda d: dict(input=torch.randn(4, 64, device=d), elem="fp4_e2m1"),
        dict(
            input=fuzz.Tensor(DTYPES, sized=(1,), ranked=False, first=True),
            elem=fuzz.Scalar(bad=("fp8", None, torch.float8_e4m3fn)),
        ),
        results=lambda r: [r.data.view(torch.uint8), r.scale.view(torch.uint8)],
    ),
    fuzz.Target(
        "kp_precision.mx_dequantize",
        "kp-precision",
        kp_precision.mx_dequantize,
        lambda d: dict(tensor=kp_precision.mx_quantize(torch.randn(4, 64, device=d))),
        dict(tensor=fuzz.Scalar(bad=(torch.ones(4, 64), None)), dtype=fuzz.Scalar(bad=(torch.int8, "float32"))),
    ),
]


test_bad_input_fuzz = kc.fuzz_test("mx", FUZZ_TARGETS)
