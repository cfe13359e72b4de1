"""Conformance spec for kp-precision's float8 quantisation (kp::quantize) and dequantisation (kp::dequantize).

The cast is checked bit for bit against torch's own float8 cast of the same scaled values, computed here in
plain float32 PyTorch from the recipe (amax per block -> q = FP8_MAX / amax -> saturate(x * q) -> float8);
scales and amaxes exactly; dequantisation exactly (one float32 multiply, one rounding).
"""

import contextlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import kp_conformance as kc
import kp_core
import kp_precision
from kp_conformance import fuzz
from kp_conformance.references import quantize_fp8
from kp_precision.ops import quantize as quantize_mod

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TIER = kc.current()
DEVICE = kc.device()
OPS = ("kp::quantize", "kp::dequantize", "kp::transpose")
# (granularity, block) pairs; square blocks need 2-D inputs
RECIPES = (
    ("tensorwise", None),
    ("rowwise", None),
    ("blockwise", (1, 128)),
    ("blockwise", (1, 16)),
    ("blockwise", (128, 128)),
    ("blockwise", (16, 32)),
)

kc.declare(
    kc.Spec(
        name="quantize",
        package="kp-precision",
        ops=OPS,
        reference=(
            "float32 PyTorch from the recipe (torchao's float8 scaling, OCP FP8 formats): amax = max |x| per block, "
            "q = FP8_MAX / max(amax, 1e-12) (2**floor(log2 q), exactly, for power-of-two scales), data = torch's "
            "own cast of clamp(x * q, -FP8_MAX, FP8_MAX) (NaN kept), scale = 1 / q; dequantised = float(data) * scale"
        ),
        dtypes=DTYPES,
        properties=(
            "values",
            "every_value",
            "conversions_agree",
            "dequantize",
            "no_mutation",
            "determinism",
            "zero_size",
            "bad_input",
            "opcheck",
            "compile",
        ),
    )
)


def ref_quantize(x, fp8, granularity, block, given=None, power_of_2=False):
    """(data, scale, amax) from the recipe, in float32 PyTorch (kp_conformance.references.quantize_fp8)."""
    return quantize_fp8(x, fp8, granularity, block, given, power_of_2)


def looped(on: bool):
    """Rowwise rows wider than 64 columns go to the looped kernel (chunks of 32) while this is entered."""
    return kp_core.pinned("row_config", max_fused_cols=64, loop_block_cols=32) if on else contextlib.nullcontext()


def assert_bits_equal(what, ours, ref):
    if ours.dtype in FP8:
        a, b = ours.view(torch.uint8), ref.view(torch.uint8)
        bad = a != b
        if bad.any():
            i = bad.nonzero()[0].tolist()
            raise AssertionError(
                f"{what}: {int(bad.sum())} of {bad.numel()} values differ, first at {i}: "
                f"ours 0x{int(a[tuple(i)]):02x} ({ours[tuple(i)].float().item()}), "
                f"torch 0x{int(b[tuple(i)]):02x} ({ref[tuple(i)].float().item()})"
            )
    else:
        torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def check(x, fp8, granularity, block, given=None, power_of_2=False, soft=None):
    """Quantise with kp (proving the kernel ran) and compare every output with the recipe bit for bit."""
    with kp_core.record_launches() as rec:
        t = kp_precision.quantize(x, fp8, granularity=granularity, block=block, scale=given, power_of_2=power_of_2)
    if x.numel():
        kc.assert_kernel_ran(rec, "kp::quantize")
    data, scale, amax = ref_quantize(x, fp8, granularity, block, given, power_of_2)
    assert t.data.shape == x.shape and t.data.dtype == fp8
    assert_bits_equal("data", t.data, data)
    assert_bits_equal("scale", t.scale, scale)
    assert_bits_equal("amax", t.amax, amax)
    return t


@st.composite
def cases(draw):
    granularity, block = draw(st.sampled_from(RECIPES))
    shape = draw(kc.row_shapes(TIER))[0]
    if block is not None and block[0] > 1:
        shape = (math.prod(shape[:-1]), shape[-1])
    given = None
    if granularity == "tensorwise" and draw(st.booleans()):
        given = draw(st.sampled_from([1.0, 2.0**-7, 0.37, 1e-3]))  # delayed scaling; small ones saturate
    return dict(
        fp8=draw(st.sampled_from(FP8)),
        granularity=granularity,
        block=block,
        shape=shape,
        layout=draw(st.sampled_from(kc.LAYOUTS)),
        family=draw(st.sampled_from(kc.FAMILIES)),
        scale=draw(st.sampled_from([1.0, 1e-3, 300.0])),
        specials=draw(st.sampled_from([0, 0, 0, 1, 2])),  # 1: a NaN, 2: an inf in the input
        given=given,
        power_of_2=draw(st.booleans()),
        looped=draw(st.integers(0, 4)) == 0,
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.conformance(kernel="quantize", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=cases())
def test_values(dtype, c):
    # no kc.skip_if_not_covered: quantize stores float8, scales and amaxes (float32), never a bfloat16
    x = kc.make_input(c["shape"], dtype, DEVICE, c["layout"], scale=c["scale"], seed=c["seed"], family=c["family"])
    if c["specials"] and x.numel():
        at = torch.unravel_index(torch.tensor(c["seed"] % x.numel()), x.shape)
        x[at] = float("nan") if c["specials"] == 1 else -float("inf")
    given = None if c["given"] is None else torch.tensor(c["given"], device=DEVICE)
    with looped(c["looped"]):
        check(x, c["fp8"], c["granularity"], c["block"], given, c["power_of_2"])


def every_value(fp8):
    """float32 inputs around every float8 value: each value, the midpoints between neighbours (ties), one
    float32 ulp either side of each midpoint, values past the largest (saturation), NaN, +-inf, +-0."""
    v = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    v = v[v.isfinite()].unique()
    mid = (v[1:] + v[:-1]) / 2
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    fmax = torch.finfo(fp8).max
    extra = torch.tensor([fmax * 1.0001, -fmax * 1.5, 3e38, math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0])
    return torch.cat([v, mid, torch.nextafter(mid, up), torch.nextafter(mid, down), extra])


@pytest.mark.conformance(kernel="quantize", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_many_tiles(dtype):
    """Tile kernels pinned to 64 elements a program (4 under the interpreter's x16), so rows and columns span
    several programs even at the smallest tier: 24-wide rows two to a program (tiles of 2 x 32), 2100-wide rows
    in three 1024-wide column tiles."""
    kp_core_pins = [kp_core.pinned(k, elements=64 if DEVICE.type == "cuda" else 4) for k in quantize_mod.TILES]
    narrow = kc.make_input((150, 24), dtype, DEVICE, "row_strided", seed=7, family="mixed")
    wide = kc.make_input((5, 2100), dtype, DEVICE, "contiguous", seed=8, family="one_huge")
    with contextlib.ExitStack() as stack:
        for pin in kp_core_pins:
            stack.enter_context(pin)
        for x in (narrow, wide):
            for granularity, block in (("tensorwise", None), ("blockwise", (1, 16))):
                t = check(x, torch.float8_e4m3fn, granularity, block)
                if dtype != torch.bfloat16 or not kc.interpreting():
                    check_dequantize(t, dtype)
            check(x, torch.float8_e5m2, "tensorwise", None, torch.tensor(0.5, device=DEVICE))


@pytest.mark.conformance(kernel="quantize", prop="every_value")
@pytest.mark.parametrize("fp8", FP8, ids=kc.dtype_id)
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise", "rowwise", "looped", "blockwise", "square"])
def test_every_value(fp8, recipe):
    """Every float8 value, every tie and both its neighbours, saturation, NaN and inf, through each kernel path.
    With a given scale of 1 the values reach the cast as they are; the dynamic recipes scale each row or block by
    its amax, so the grid is laid out one copy per row with a power-of-two scale that keeps it exact."""
    x = every_value(fp8)
    one = torch.ones((), device=DEVICE)
    if recipe == "delayed":
        check(x.to(DEVICE).view(1, -1), fp8, "tensorwise", None, one)
        return
    finite = x[x.isfinite()].abs()
    rows = torch.stack([finite, -finite]).to(DEVICE)  # amax = the largest finite input in both rows
    pinned = looped(recipe == "looped")
    granularity, block = {
        "tensorwise": ("tensorwise", None),
        "rowwise": ("rowwise", None),
        "looped": ("rowwise", None),
        "blockwise": ("blockwise", (1, 128)),
        "square": ("blockwise", (2, 128)),
    }[recipe]
    with pinned:
        for p2 in (False, True):
            check(rows, fp8, granularity, block, power_of_2=p2)


@pytest.mark.conformance(kernel="quantize", prop="conversions_agree")
@pytest.mark.parametrize("fp8", FP8, ids=kc.dtype_id)
def test_conversions_agree(fp8):
    """The two float8 conversions of the kernels, the hardware's and the integer one, each against torch: on a
    GPU over every value (they must agree bit for bit); under the interpreter, whose own float8 rounding is
    not torch's, the hardware path only on values float8 holds exactly (where any correct rounding is exact)."""
    x = every_value(fp8)
    if kc.interpreting():
        x = torch.arange(256, dtype=torch.uint8).view(fp8).float()
        x = x[x.isfinite()]
    finite = x[x.isfinite()].abs()
    rows = torch.stack([finite, -finite]).to(DEVICE)
    one = torch.ones((), device=DEVICE)
    for soft in (False, True):
        with kp_core.pinned("fp8_convert", soft=soft):
            check(x.to(DEVICE).view(1, -1), fp8, "tensorwise", None, one)
            check(rows, fp8, "tensorwise", None, power_of_2=True)
            check(rows, fp8, "rowwise", None, power_of_2=True)
            check(rows, fp8, "blockwise", (2, 16), power_of_2=True)
            with looped(True):
                t = check(rows, fp8, "rowwise", None, power_of_2=True)
            check_dequantize(t, torch.float32)


def check_dequantize(t, dtype):
    with kp_core.record_launches() as rec:
        y = kp_precision.dequantize(t, dtype)
    assert y.shape == t.data.shape and y.dtype == dtype
    if not t.data.numel():
        return
    kc.assert_kernel_ran(rec, "kp::dequantize")
    d = t.data.reshape(-1, t.data.shape[-1]).float()
    m, k = d.shape
    bm, bk = t.block
    s = t.scale.reshape(1, 1) if bm == 0 else t.scale.reshape(-1, t.scale.shape[-1])
    s = s.repeat_interleave(bm or m, 0)[:m].repeat_interleave(bk or k, 1)[:, :k]
    assert_bits_equal("dequantized", y, (d * s).to(dtype).reshape(t.data.shape))


@pytest.mark.conformance(kernel="quantize", prop="dequantize")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=cases())
def test_dequantize(dtype, c):
    kc.skip_if_not_covered(dtype)
    x = kc.make_input(c["shape"], torch.float32, DEVICE, c["layout"], scale=c["scale"], seed=c["seed"])
    if c["specials"] and x.numel():
        at = torch.unravel_index(torch.tensor(c["seed"] % x.numel()), x.shape)
        x[at] = float("nan") if c["specials"] == 1 else -float("inf")
    t = kp_precision.quantize(x, c["fp8"], granularity=c["granularity"], block=c["block"])
    check_dequantize(t, dtype)


FIXED = [((7, 33), "tensorwise", None), ((3, 5, 257), "rowwise", None), ((130, 300), "blockwise", (128, 128))]


@pytest.mark.conformance(kernel="quantize", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("layout", kc.LAYOUTS)
def test_no_mutation(dtype, layout):
    for i, (shape, granularity, block) in enumerate(FIXED):
        x = kc.make_input(shape, dtype, DEVICE, layout, seed=i)
        before = x.clone()
        t = kp_precision.quantize(x, granularity=granularity, block=block)
        data, scale = t.data.clone(), t.scale.clone()
        kp_precision.dequantize(t, dtype)
        assert torch.equal(x, before), "quantize modified its input"
        assert torch.equal(t.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(t.scale, scale)


@pytest.mark.conformance(kernel="quantize", prop="determinism")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_determinism(dtype):
    """Bitwise-equal results on repeated calls (the tensorwise amax is an atomic max: order-free)."""
    rows = 4096 if DEVICE.type == "cuda" else 67
    x = kc.make_input((rows, 4097), dtype, DEVICE, "contiguous", seed=3)
    for granularity, block in RECIPES[:3]:
        a, b = (kp_precision.quantize(x, granularity=granularity, block=block) for _ in range(2))
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
        assert torch.equal(a.scale, b.scale) and torch.equal(a.amax, b.amax)


@pytest.mark.conformance(kernel="quantize", prop="zero_size")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_zero_size(dtype):
    """An empty input launches nothing; its blocks' amax is 0, so its scales are those of an all-zero block."""
    for shape, granularity, block in [
        ((0, 8), "tensorwise", None),
        ((3, 0, 5), "rowwise", None),
        ((4, 0), "rowwise", None),
        ((0, 256), "blockwise", (128, 128)),
    ]:
        x = torch.empty(shape, dtype=dtype, device=DEVICE)
        with kp_core.record_launches() as rec:
            t = kp_precision.quantize(x, granularity=granularity, block=block)
            y = kp_precision.dequantize(t, dtype)
        assert rec.backends() <= {kp_core.REFERENCE}, f"an empty input launched {rec.launches}"
        _, scale, amax = ref_quantize(x, torch.float8_e4m3fn, granularity, block)
        assert_bits_equal("scale", t.scale, scale)
        assert_bits_equal("amax", t.amax, amax)
        assert y.shape == x.shape and y.dtype == dtype


def _t(d, shape=(4, 32), dtype=torch.float32):
    return torch.ones(shape, dtype=dtype, device=d)


_q = kp_precision.quantize
BAD_INPUTS = [
    # (description, call, error type, words the message must contain)
    ("integer input", lambda d: _q(_t(d, dtype=torch.int32)), TypeError, "input"),
    ("float64 input", lambda d: _q(_t(d, dtype=torch.float64)), TypeError, "input"),
    ("0-dim input", lambda d: _q(_t(d, ())), ValueError, "input"),
    ("not a tensor", lambda d: _q([[1.0]]), TypeError, "input"),
    ("not a float8 dtype", lambda d: _q(_t(d), torch.float16), TypeError, "dtype"),
    ("unknown granularity", lambda d: _q(_t(d), granularity="columnwise"), ValueError, "granularity"),
    ("block with rowwise", lambda d: _q(_t(d), granularity="rowwise", block=(1, 128)), ValueError, "block"),
    ("block not a power of two", lambda d: _q(_t(d), granularity="blockwise", block=(1, 96)), ValueError, "block"),
    ("block too narrow", lambda d: _q(_t(d), granularity="blockwise", block=(128, 8)), ValueError, "block"),
    ("block too big", lambda d: _q(_t(d), granularity="blockwise", block=(256, 128)), ValueError, "block"),
    (
        "square block on 3-D",
        lambda d: _q(_t(d, (2, 4, 32)), granularity="blockwise", block=(16, 16)),
        ValueError,
        "2-D",
    ),
    ("given scale with rowwise", lambda d: _q(_t(d), granularity="rowwise", scale=_t(d, ())), ValueError, "scale"),
    ("given scale float64", lambda d: _q(_t(d), scale=_t(d, (), torch.float64)), TypeError, "scale"),
    ("given scale of 2 values", lambda d: _q(_t(d), scale=_t(d, (2,))), ValueError, "scale"),
    ("given scale on another device", lambda d: _q(_t(d), scale=torch.ones((), device="meta")), ValueError, "scale"),
    ("dequantize a tensor", lambda d: kp_precision.dequantize(_t(d)), TypeError, "Float8Tensor"),
    ("dequantize to int", lambda d: kp_precision.dequantize(_q(_t(d)), torch.int32), TypeError, "dtype"),
    (
        "dequantize a wrong scale",
        lambda d: kp_precision.dequantize(_q(_t(d))._replace(scale=_t(d, (3,)))),
        ValueError,
        "scale",
    ),
]


test_bad_input = kc.bad_input_test("quantize", BAD_INPUTS, DEVICE)


DEQ_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.conformance(kernel="quantize", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    x = kc.make_input((37, 130), dtype, DEVICE, "row_strided", seed=1)
    with kp_core.record_launches() as rec:
        for block, given in (
            ((0, 0), None),
            ((0, 0), torch.tensor(0.5, device=DEVICE)),
            ((1, 0), None),
            ((16, 32), None),
        ):
            torch.library.opcheck(quantize_mod.QUANTIZE.op, (x, given, torch.float8_e4m3fn, *block, True))
            data, scale, _ = quantize_mod.QUANTIZE(x, given, torch.float8_e5m2, *block, False)
            # not opcheck's test_schema here: it compares the inputs before and after with torch.allclose,
            # which float8 tensors do not support; test_no_mutation and the guard check that instead
            torch.library.opcheck(quantize_mod.DEQUANTIZE.op, (data, scale, *block, dtype), test_utils=DEQ_CHECKS)
        torch.library.opcheck(quantize_mod.TRANSPOSE.op, (data,), test_utils=DEQ_CHECKS)
        torch.library.opcheck(quantize_mod.TRANSPOSE.op, (x,))
    kc.assert_kernel_ran(rec, *OPS)


@pytest.mark.conformance(kernel="quantize", prop="compile")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_compile_fullgraph_equals_eager(dtype):
    """A Float8Tensor goes in and out of a compiled function (no graph break) with eager's bits."""
    torch._dynamo.reset()

    def f(x):
        t = kp_precision.quantize(x * 2, granularity="rowwise")
        return t, kp_precision.dequantize(t, dtype) + 1

    compiled = torch.compile(f, fullgraph=True)
    x = kc.make_input((33, 257), dtype, DEVICE, "contiguous", seed=5)
    results = []
    for fn in (f, compiled):
        with kp_core.record_launches() as rec:
            results.append(fn(x))
        kc.assert_kernel_ran(rec, "kp::quantize", "kp::dequantize")
    (a, ya), (b, yb) = results
    assert isinstance(b, kp_precision.Float8Tensor) and b.block == a.block
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    assert torch.equal(ya, yb)


def test_reference_is_independent():
    """The recipe here must not route through kp; and torch's cast does round ties to even."""
    x = torch.tensor([[17.0, 18.0, 19.0, -448.0]])  # e4m3 near 16: steps of 2, so 17 and 19 are ties
    with kp_core.record_launches() as rec:
        data, scale, amax = ref_quantize(x, torch.float8_e4m3fn, "tensorwise", None, torch.ones(()))
    assert rec.count() == 0
    assert data.float().tolist() == [[16.0, 18.0, 20.0, -448.0]] and scale == 1 and amax == 448


@pytest.mark.conformance(kernel="quantize", prop="values")
@pytest.mark.parametrize("dtype", FP8 + DTYPES, ids=kc.dtype_id)
def test_transpose(dtype):
    """kp::transpose (the float8 training backward's transposing copies of float8 data and of 16- and 32-bit
    inputs, gradients and weights): bit for bit data.t().contiguous(), on random bytes (NaN and inf bit patterns
    among them), on shapes that end in partial tiles both ways and on row-strided data."""
    bits_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[dtype.itemsize]
    for m, n in ((1, 1), (17, 33), (130, 70), (64, 256)):
        # random bytes in every byte of each element: a transpose that mixed up bytes of neighbours would show
        raw = torch.randint(0, 256, (m, n * dtype.itemsize), generator=torch.Generator().manual_seed(m * n))
        assert raw.numel() < 4096 or raw.unique().numel() == 256  # the large shapes hold every byte value
        bits = raw.to(torch.uint8).to(DEVICE).view(bits_dtype)
        for data in (bits.view(dtype), torch.cat([bits, bits], 1)[:, :n].view(dtype)):
            with kp_core.record_launches() as rec:
                out = quantize_mod.TRANSPOSE(data)
            kc.assert_kernel_ran(rec, "kp::transpose")
            assert out.dtype == dtype and out.is_contiguous()
            assert torch.equal(out.view(bits_dtype), data.view(bits_dtype).t()), (m, n)


def _cast_result(r):
    return [r.data.view(torch.uint8), r.scale]


X = fuzz.Tensor(DTYPES, ranked=False, first=True)
FUZZ_TARGETS = [
    fuzz.Target(
        "kp_precision.quantize",
        "kp-precision",
        kp_precision.quantize,
        lambda d: dict(input=torch.randn(4, 32, device=d), granularity="rowwise"),
        dict(
            input=X,
            dtype=fuzz.Scalar(bad=(torch.float16, torch.int8, "e4m3")),
            granularity=fuzz.Scalar(bad=("columnwise", None)),
            power_of_2=fuzz.Scalar(bad=(1, None)),
        ),
        zero=lambda d: dict(input=torch.randn(0, 32, device=d), granularity="rowwise"),
        results=_cast_result,
    ),
    fuzz.Target(
        "kp_precision.quantize(scale)",
        "kp-precision",
        kp_precision.quantize,
        lambda d: dict(input=torch.randn(4, 32, device=d), scale=torch.tensor(0.01, device=d)),
        dict(input=X, scale=fuzz.Tensor((torch.float32,), ranked=False, values=False)),  # any one-value shape
        results=_cast_result,
    ),
    fuzz.Target(
        "kp_precision.dequantize",
        "kp-precision",
        kp_precision.dequantize,
        lambda d: dict(tensor=kp_precision.quantize(torch.randn(4, 32, device=d)), dtype=torch.float16),
        dict(tensor=fuzz.Scalar(bad=(torch.ones(4, 32), None)), dtype=fuzz.Scalar(bad=(torch.int32, "float16"))),
    ),
]


test_bad_input_fuzz = kc.fuzz_test("quantize", FUZZ_TARGETS)
