"""Conformance spec for kp-precision's float8 scaled matmul (kp::scaled_mm).

Reference: the float8 operands decoded by torch's own cast, times their scales expanded to every element, one
float64 matmul, then bias and the activation in float64. PyTorch's low-precision run of the same computation,
for the 2x rule: torch._scaled_mm of the same float8 operands with the same use_fast_accum (on a GPU the float8
tensor cores' own narrower accumulator), the scales applied in float32 after the sum or per 128-deep slice
(kp_conformance.references.scaled_mm_lowp), then bias and activation in float32 and one cast.

The spec pins the route of precise calls to torch._scaled_mm off (kp_core setting "scaled_mm_route"), so that
every cell checks kp's kernel; test_route checks the route itself.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import kp_conformance as kc
import kp_core
import kp_precision
from kp_conformance import fuzz
from kp_conformance.references import scaled_mm_lowp
from kp_precision.ops import scaled_mm as mm
from kp_precision.ops import scaled_mm_route as route

DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the output's dtype
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
TIER = kc.current()
DEVICE = kc.device()
OP = "kp::scaled_mm"
SCALES_A = ("tensor", "row", "block", "square")  # (), (M, 1), (M, K/128), (M/128, K/128)
SCALES_B = ("tensor", "column", "block", "square")  # (), (1, N), (K/128, N), (K/128, N/128)
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
EDGES = (16, 32, 112, 128, 144, 256, 272)  # multiples of 16 around the 128-wide scale blocks

kc.declare(
    kc.Spec(
        name="scaled_mm",
        package="kp-precision",
        ops=(OP,),
        reference=(
            "float64 PyTorch: float8 operands decoded by torch's cast, times their scales per element (tensorwise, "
            "per row / column, 128-deep blocks), one matmul, + bias, activation; the 2x rule against torch._scaled_mm "
            "of the same operands and use_fast_accum, scaled in float32 after the sum or per 128-deep slice"
        ),
        dtypes=DTYPES,
        properties=(
            "values",
            "recipes",
            "every_value",
            "specials",
            "no_mutation",
            "determinism",
            "zero_size",
            "bad_input",
            "opcheck",
            "compile",
            "route",
        ),
    )
)


@pytest.fixture(autouse=True)
def _kernel_only():
    """Precise calls run kp's kernel here, not torch._scaled_mm (test_route turns the route back on)."""
    with kp_core.pinned("scaled_mm_route", cublas=False):
        yield


def operand(rows, k, fp8, seed, family="normal", padded=False):
    """(rows, k) float8 with a unit column stride, values spread over the format's range; padded: rows of a
    wider buffer (a row stride past k)."""
    x = kc.make_input((rows, k + 16 * padded), torch.float32, DEVICE, "contiguous", seed=seed, family=family)
    x = x / x.abs().amax().clamp(min=1e-30) * (torch.finfo(fp8).max / 2)
    return x.to(fp8)[:, :k]


def make_scale(kind, rows, k, operand_name, seed):
    """A float32 scale of the recipe `kind` for an operand of `rows` rows (M of a, N of b) and depth k: random
    powers of two and not, 2**-8 .. 2**2. b's are made as (rows, K-blocks) and transposed, as a weight's are."""
    g = torch.Generator().manual_seed(seed)
    kb, rb = kp_core.cdiv(k, 128), kp_core.cdiv(rows, 128)
    shape = {"tensor": (), "row": (rows, 1), "column": (rows, 1), "block": (rows, kb), "square": (rb, kb)}[kind]
    s = torch.exp2(torch.rand(shape, generator=g) * 10 - 8).to(DEVICE)
    return s if operand_name == "a" or kind == "tensor" else s.t()


def expand(scale, rows, k, operand_name):
    """The scale of every element of the operand, as (rows, k) float64 (b's as (N, K))."""
    s = scale.double()
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, k)
    s = s if operand_name == "a" else s.t()
    per_row = 1 if s.shape[0] == rows else 128
    s = s.repeat_interleave(per_row, 0)[:rows]
    return s.expand(rows, k) if s.shape[1] == 1 else s.repeat_interleave(128, 1)[:, :k]


EPILOGUE = {
    None: lambda t: t,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


def references(a, b, sa, sb, bias, activation, out_dtype, fast=False):
    """(float64 reference, PyTorch's low-precision result) of act(a*sa @ b*sb + bias)."""
    m, k = a.shape
    n = b.shape[1]
    a64 = a.double() * expand(sa, m, k, "a")
    b64 = b.double() * expand(sb, n, k, "b").t()
    ref = a64 @ b64
    low = scaled_mm_lowp(a, b, expand(sa, m, k, "a").float(), expand(sb, n, k, "b").float().t(), fast)
    if bias is not None:
        ref, low = ref + bias.double(), low + bias.float()
    return EPILOGUE[activation](ref), EPILOGUE[activation](low).to(out_dtype)


def run(a, b, sa, sb, bias, activation, out_dtype, fast=False):
    """kp's result, proving the kernel ran."""
    with kp_core.record_launches() as rec:
        y = kp_precision.scaled_mm(
            a, b, sa, sb, bias=bias, activation=activation, out_dtype=out_dtype, use_fast_accum=fast
        )
    if y.numel() and a.shape[1]:
        kc.assert_kernel_ran(rec, OP)
    return y


def check(c, out_dtype):
    m, k, n = c["m"], c["k"], c["n"]
    a = operand(m, k, c["fp8_a"], c["seed"], c["family"], c["padded"])
    b = operand(n, k, c["fp8_b"], c["seed"] + 1, "normal", c["padded"]).t()  # column-major (K, N)
    sa = make_scale(c["scale_a"], m, k, "a", c["seed"])
    sb = make_scale(c["scale_b"], n, k, "b", c["seed"] + 2)
    bias = None
    if c["bias"]:
        bias = kc.make_input((n,), c["bias_dtype"] or out_dtype, DEVICE, "contiguous", seed=c["seed"] + 3) * 10
    y = run(a, b, sa, sb, bias, c["activation"], out_dtype, c["fast"])
    ref, low = references(a, b, sa, sb, bias, c["activation"], out_dtype, c["fast"])
    kc.check_close(f"scaled_mm {c}", y, ref, low, out_dtype)


def dims(tier):
    """(m, k, n) strategies: m any size, k and n multiples of 16, edges around the 128-wide scale blocks."""
    cap = min(math.isqrt(tier.max_numel) // 2, 8192)
    m = st.one_of(st.sampled_from([d for d in (1, 2, 15, 16, 17, 33, 127, 129) if d <= cap]), st.integers(1, cap))
    k = st.one_of(
        st.sampled_from([d for d in EDGES if d <= max(cap, 16)]),
        st.integers(1, max(cap // 16, 1)).map(lambda v: 16 * v),
    )
    return m, k


def pairs(fp8):
    """The float8 dtypes b may have with a of `fp8`: not e5m2 with e5m2 (refused, as torch._scaled_mm does)."""
    return FP8 if fp8 == torch.float8_e4m3fn else (torch.float8_e4m3fn,)


@st.composite
def cases(draw):
    m_st, k_st = dims(TIER)
    fp8_a = draw(st.sampled_from(FP8))
    return dict(
        m=draw(m_st),
        k=draw(k_st),
        n=draw(k_st),
        fp8_a=fp8_a,
        fp8_b=draw(st.sampled_from(pairs(fp8_a))),
        fast=draw(st.booleans()),
        scale_a=draw(st.sampled_from(SCALES_A)),
        scale_b=draw(st.sampled_from(SCALES_B)),
        bias=draw(st.booleans()),
        bias_dtype=draw(st.sampled_from([None, torch.float32])),
        activation=draw(st.sampled_from(ACTIVATIONS)),
        family=draw(st.sampled_from(kc.FAMILIES)),
        padded=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.conformance(kernel="scaled_mm", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=cases())
def test_values(dtype, c):
    kc.skip_if_not_covered(dtype)
    check(c, dtype)


@pytest.mark.conformance(kernel="scaled_mm", prop="recipes")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("scale_b", SCALES_B)
@pytest.mark.parametrize("scale_a", SCALES_A)
def test_recipes(dtype, scale_a, scale_b):
    """Every pairing of the scales' recipes, on a shape that crosses tiles and ends in a partial scale block
    (K = 272 = 2 * 128 + 16), with and without bias, every activation, every float8 pairing, both
    accumulations."""
    kc.skip_if_not_covered(dtype)
    i = SCALES_A.index(scale_a) * 4 + SCALES_B.index(scale_b)
    for j, bias in enumerate((False, True)):
        c = dict(m=37, k=272, n=80, scale_a=scale_a, scale_b=scale_b, bias=bias, bias_dtype=None, padded=bool(j))
        fp8_a = FP8[i % 2]
        c.update(fp8_a=fp8_a, fp8_b=pairs(fp8_a)[(i // 2 + j) % len(pairs(fp8_a))], family="normal", seed=i * 7 + j)
        c["fast"] = (i + j) % 2 == 1
        c["activation"] = ACTIVATIONS[(i + j) % len(ACTIVATIONS)]
        check(c, dtype)


def finite_values(fp8):
    v = torch.arange(256, dtype=torch.uint8).view(fp8)
    return v[v.float().isfinite()]


@pytest.mark.conformance(kernel="scaled_mm", prop="every_value")
@pytest.mark.parametrize("soft", [False, True], ids=["hardware", "integer"])
@pytest.mark.parametrize("fp8", FP8, ids=kc.dtype_id)
def test_every_value(fp8, soft):
    """Every finite float8 value (subnormals, +-0, the largest) through each operand: times an identity of the
    other format, scale 1, float32 out, the product is the value itself, exactly. Both ways the kernel reads
    float8: the hardware's (tl.dot on float8 tiles) and its own integer decoding (the interpreter's path, pinned
    on a GPU). The interpreter's own decoding is wrong for e5m2 (and NaN): its hardware path runs e4m3fn only."""
    others = pairs(fp8)
    if kc.interpreting() and not soft:
        if fp8 == torch.float8_e5m2:
            pytest.skip("not covered on interpret: Triton's interpreter decodes float8_e5m2 wrongly")
        others = (fp8,)
    v = finite_values(fp8)
    v = torch.cat([v, v[: -len(v) % 16]]).view(-1, 16).to(DEVICE)  # rows of 16
    one = torch.ones((), device=DEVICE)
    with kp_core.pinned("fp8_convert", soft=soft):
        for other in others:
            eye = torch.eye(16, device=DEVICE).to(other)
            y = run(v, eye.t(), one, one, None, None, torch.float32)
            assert torch.equal(y, v.float()), f"a's values times an identity of {other}"
            y = run(eye, v.t(), one, one, None, None, torch.float32)
            assert torch.equal(y, v.float().t()), f"b's values times an identity of {other}"


@pytest.mark.conformance(kernel="scaled_mm", prop="specials")
@pytest.mark.parametrize("fp8", FP8, ids=kc.dtype_id)
def test_specials(fp8):
    """A NaN (and, in e5m2, an inf) in a makes its output row NaN (inf * 0, inf - inf) or inf, as in float64."""
    a = operand(20, 64, fp8, 1)
    b = operand(32, 64, torch.float8_e4m3fn, 2).t()
    bits = a.view(torch.uint8)
    bits[3, 5] = 0x7F  # NaN in both formats
    if fp8 == torch.float8_e5m2:
        bits[7, 9] = 0x7C  # +inf
    one = torch.ones((), device=DEVICE)
    y = run(a, b, one, one, None, None, torch.float32)
    ref = a.double() @ b.double()
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y.isinf(), ref.isinf())
    fin = ref.isfinite()
    low = scaled_mm_lowp(a, b, torch.ones(20, 64, device=DEVICE), torch.ones(64, 32, device=DEVICE))
    kc.check_close("specials (finite part)", y[fin], ref[fin], low[fin], torch.float32)


@pytest.mark.conformance(kernel="scaled_mm", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_no_mutation(dtype):
    a = operand(33, 144, torch.float8_e4m3fn, 1, padded=True)
    b = operand(48, 144, torch.float8_e4m3fn, 2).t()
    sa, sb = make_scale("block", 33, 144, "a", 3), make_scale("square", 48, 144, "b", 4)
    bias = torch.ones(48, dtype=dtype, device=DEVICE)
    before = [t.view(torch.uint8).clone() if t.dtype in FP8 else t.clone() for t in (a, b, sa, sb, bias)]
    kp_precision.scaled_mm(a, b, sa, sb, bias=bias, activation="gelu", out_dtype=dtype)
    for name, t, old in zip(("a", "b", "scale_a", "scale_b", "bias"), (a, b, sa, sb, bias), before, strict=True):
        assert torch.equal(t.view(torch.uint8) if t.dtype in FP8 else t, old), f"scaled_mm modified {name}"


@pytest.mark.conformance(kernel="scaled_mm", prop="determinism")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_determinism(dtype):
    m, k, n = (1024, 4096, 1024) if DEVICE.type == "cuda" else (40, 272, 48)
    a, b = operand(m, k, torch.float8_e4m3fn, 1), operand(n, k, torch.float8_e4m3fn, 2).t()
    for kinds in (("tensor", "tensor"), ("block", "square")):
        sa, sb = make_scale(kinds[0], m, k, "a", 3), make_scale(kinds[1], n, k, "b", 4)
        first, second = (kp_precision.scaled_mm(a, b, sa, sb, out_dtype=dtype) for _ in range(2))
        assert torch.equal(first, second)


@pytest.mark.conformance(kernel="scaled_mm", prop="zero_size")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_zero_size(dtype):
    """Empty outputs launch nothing; K = 0 is an empty sum: the epilogue of zeros (bias, activation)."""
    one = torch.ones((), device=DEVICE)
    for m, k, n in ((0, 32, 16), (8, 32, 0), (8, 0, 16)):
        a = torch.zeros((m, k), device=DEVICE).to(torch.float8_e4m3fn)
        b = torch.zeros((n, k), device=DEVICE).to(torch.float8_e4m3fn).t()
        bias = torch.full((n,), -2.0, dtype=dtype, device=DEVICE)
        with kp_core.record_launches() as rec:
            y = kp_precision.scaled_mm(a, b, one, one, bias=bias, activation="silu", out_dtype=dtype)
        assert rec.backends() <= {kp_core.REFERENCE}, f"an empty matmul launched {rec.launches}"
        assert y.shape == (m, n) and y.dtype == dtype
        torch.testing.assert_close(y, F.silu(bias.float()).to(dtype).expand(m, n), rtol=0, atol=0)


def _fp8(d, shape=(32, 32), dtype=torch.float8_e4m3fn):
    return torch.zeros(shape, device=d).to(dtype)


def _mm(d, a=None, b=None, sa=None, sb=None, **kw):
    a = _fp8(d) if a is None else a
    b = _fp8(d).t() if b is None else b
    one = torch.ones((), device=d)
    return kp_precision.scaled_mm(a, b, one if sa is None else sa, one if sb is None else sb, **kw)


BAD_INPUTS = [
    # (description, call, error type, words the message must contain)
    ("a not float8", lambda d: _mm(d, a=torch.ones(32, 32, device=d)), TypeError, "a must"),
    ("b bfloat16", lambda d: _mm(d, b=torch.ones(32, 32, device=d, dtype=torch.bfloat16)), TypeError, "b must"),
    ("a 3-D", lambda d: _mm(d, a=_fp8(d, (2, 32, 32))), ValueError, "a must have 2"),
    ("K mismatch", lambda d: _mm(d, b=_fp8(d, (32, 48)).t()), ValueError, "b must have"),
    ("K not a multiple of 16", lambda d: _mm(d, a=_fp8(d, (32, 24)), b=_fp8(d, (32, 24)).t()), ValueError, "16"),
    ("N not a multiple of 16", lambda d: _mm(d, b=_fp8(d, (40, 32)).t()), ValueError, "16"),
    ("b row-major", lambda d: _mm(d, b=_fp8(d)), ValueError, "column-major"),
    ("a column-major", lambda d: _mm(d, a=_fp8(d).t()), ValueError, "row-major"),
    ("scale_a float16", lambda d: _mm(d, sa=torch.ones((), device=d, dtype=torch.float16)), TypeError, "scale_a"),
    ("scale_a wrong shape", lambda d: _mm(d, sa=torch.ones(32, 2, device=d)), ValueError, "scale_a"),
    ("scale_b as rows", lambda d: _mm(d, sb=torch.ones(32, 1, device=d).t().t()), ValueError, "scale_b"),
    ("scale_b on another device", lambda d: _mm(d, sb=torch.ones((), device="meta")), ValueError, "scale_b"),
    (
        "b on another device",
        lambda d: _mm(d, b=torch.empty(32, 32, device="meta", dtype=torch.float8_e4m3fn).t()),
        ValueError,
        "b must be on",
    ),
    ("bias wrong length", lambda d: _mm(d, bias=torch.ones(16, device=d)), ValueError, "bias"),
    ("bias float64", lambda d: _mm(d, bias=torch.ones(32, device=d, dtype=torch.float64)), TypeError, "bias"),
    ("unknown activation", lambda d: _mm(d, activation="tanh"), ValueError, "activation"),
    ("out_dtype float8", lambda d: _mm(d, out_dtype=torch.float8_e4m3fn), TypeError, "out_dtype"),
    (
        "both float8_e5m2",
        lambda d: _mm(d, a=_fp8(d, dtype=torch.float8_e5m2), b=_fp8(d, dtype=torch.float8_e5m2).t()),
        TypeError,
        "one must be float8_e4m3fn",
    ),
    ("use_fast_accum not a bool", lambda d: _mm(d, use_fast_accum=1), TypeError, "use_fast_accum"),
]


test_bad_input = kc.bad_input_test("scaled_mm", BAD_INPUTS, DEVICE)


@pytest.mark.conformance(kernel="scaled_mm", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    a, b = operand(33, 160, torch.float8_e4m3fn, 1), operand(48, 160, torch.float8_e5m2, 2).t()
    sa, sb = make_scale("row", 33, 160, "a", 3), make_scale("square", 48, 160, "b", 4)
    bias = torch.ones(48, dtype=dtype, device=DEVICE)
    with kp_core.record_launches() as rec:
        # not test_schema: it compares inputs before and after with torch.allclose, which float8 does not support
        # (test_no_mutation and the guard check that instead)
        torch.library.opcheck(
            mm.SCALED_MM.op,
            (a, b, sa, sb, bias, "gelu", dtype, False),
            test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"),
        )
    kc.assert_kernel_ran(rec, OP)


@pytest.mark.conformance(kernel="scaled_mm", prop="compile")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_compile_fullgraph_equals_eager(dtype):
    """Quantise, multiply and dequantise-free epilogue in one compiled graph, with eager's bits."""
    torch._dynamo.reset()

    def f(x, w):
        qx = kp_precision.quantize(x, granularity="rowwise")
        qw = kp_precision.quantize(w, granularity="rowwise")
        return kp_precision.scaled_mm(qx.data, qw.data.t(), qx.scale, qw.scale.t(), activation="relu", out_dtype=dtype)

    compiled = torch.compile(f, fullgraph=True)
    x = kc.make_input((33, 160), torch.float32, DEVICE, "contiguous", seed=5)
    w = kc.make_input((48, 160), torch.float32, DEVICE, "contiguous", seed=6)
    results = []
    for fn in (f, compiled):
        with kp_core.record_launches() as rec:
            results.append(fn(x, w))
        kc.assert_kernel_ran(rec, OP)
    assert torch.equal(*results)


def test_reference_is_independent():
    """The reference must not route through kp, and it must see each recipe's scale where it belongs."""
    a = torch.ones(2, 256).to(torch.float8_e4m3fn)
    b = torch.ones(16, 256).to(torch.float8_e4m3fn).t()
    sa = torch.tensor([[1.0, 2.0], [4.0, 8.0]])  # (M, K/128): 1 x 128 blocks
    with kp_core.record_launches() as rec:
        ref, low = references(a, b, sa, torch.ones(()), None, None, torch.float32)
    assert rec.count() == 0
    assert ref[:, 0].tolist() == [128 * 3.0, 128 * 12.0] and torch.equal(low, ref.float())


@pytest.mark.conformance(kernel="scaled_mm", prop="route")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_route_epilogue(dtype, activation):
    """The routed call's epilogue kernel on every tier: bias, activation and one cast of a float32 product (what
    cuBLASLt returns), against float64 of the same float32 values; PyTorch's float32 epilogue for the 2x rule.
    With a float32 output it writes in place, so the product's own tensor comes back."""
    kc.skip_if_not_covered(dtype)
    y32 = kc.make_input((37, 80), torch.float32, DEVICE, "contiguous", seed=7, family="large")
    for bias in (None, kc.make_input((80,), dtype, DEVICE, "contiguous", seed=8)):
        given_y = y32.clone()
        with kp_core.record_launches() as rec:
            out = route.epilogue(given_y, bias, activation or "none", dtype)
        kc.assert_kernel_ran(rec, OP)
        assert (out.data_ptr() == given_y.data_ptr()) == (dtype == torch.float32)
        plus = y32.double() if bias is None else y32.double() + bias.double()
        low = y32 if bias is None else y32 + bias.float()
        kc.check_close(
            f"route epilogue {activation} bias={bias is not None}",
            out,
            EPILOGUE[activation](plus),
            EPILOGUE[activation](low).to(dtype),
            dtype,
        )


@pytest.mark.conformance(kernel="scaled_mm", prop="route")
def test_route():
    """On a GPU, a precise call whose scales are constant along K goes to torch._scaled_mm where the installed
    torch takes its dtypes and scale kinds, and a blockwise call (1 x 128 blocks of a; 128 x 128 or 1 x 128 of b)
    to torch.nn.functional.scaled_mm, the epilogue in float32 (2x rule as everywhere); a fast call goes there only
    with no bias and no activation (the kernel fuses them), and every call under the interpreter runs the kernel.
    Tensorwise e4m3, which every torch with float8 takes, must route, precise and plain fast, and both blockwise
    pairs must on an sm_90 GPU whose torch has the blockwise recipes."""
    m, k, n = 64, 256, 128  # two K-blocks: with one, a 1 x 128 scale is a per-row one (and routed as that)
    a, b = operand(m, k, torch.float8_e4m3fn, 1), operand(n, k, torch.float8_e4m3fn, 2).t()
    bias = kc.make_input((n,), torch.float32, DEVICE, "contiguous", seed=3)
    gpu = DEVICE.type == "cuda" and not kc.interpreting()
    routed = []
    # (scale kinds, fast, plain: no bias and no activation)
    cases = (
        (("tensor", "tensor"), False, False),
        (("row", "column"), False, False),
        (("tensor", "tensor"), True, False),
        (("tensor", "tensor"), True, True),
    )
    blockwise = ((("block", "square"), False, False), (("block", "block"), False, False))
    for kinds, fast, plain in (*cases, *blockwise):
        sa, sb = make_scale(kinds[0], m, k, "a", 4), make_scale(kinds[1], n, k, "b", 5)
        layouts = (mm.scale_layout(sa, m, k, "a"), mm.scale_layout(sb, n, k, "b"))
        bias_, act = (None, None) if plain else (bias, "gelu")
        with kp_core.pinned("scaled_mm_route", cublas=True), kp_core.record_launches() as rec:
            y = kp_precision.scaled_mm(
                a, b, sa, sb, bias=bias_, activation=act, out_dtype=torch.float32, use_fast_accum=fast
            )
            routes = gpu and route.routes(a, b, sa, sb, layouts, fast, plain)
        if routes:  # cuBLASLt's product, then kp's epilogue kernel (a plain call needs none), never the GEMM kernel
            assert route.LIBRARY in rec.backends(OP), f"{kinds}: expected cuBLASLt, got {rec.launches}"
            assert "_scaled_mm" not in rec.kernels(OP), rec.launches
            assert ("_epilogue" in rec.kernels(OP)) != plain, rec.launches
            routed.append((kinds, fast))
        else:
            kc.assert_kernel_ran(rec, OP)
        ref, low = references(a, b, sa, sb, bias_, act, torch.float32, fast)
        kc.check_close(f"route {kinds} fast={fast} plain={plain}", y, ref, low, torch.float32)
    for kinds, fast in ((("tensor", "tensor"), False), (("tensor", "tensor"), True)):
        assert (kinds, fast) in routed or not gpu, f"a tensorwise call (fast={fast}) did not go to torch._scaled_mm"
    if gpu and hasattr(F, "ScalingType") and torch.cuda.get_device_capability(DEVICE) == (9, 0):
        assert {(("block", "square"), False), (("block", "block"), False)} <= set(routed), f"not routed: {routed}"


def _operands(d):
    a = torch.randn(32, 32, device=d).to(torch.float8_e4m3fn)
    b = torch.randn(48, 32, device=d).to(torch.float8_e4m3fn).t()  # column-major (K, N)
    return dict(a=a, b=b, scale_a=torch.rand(32, 1, device=d) + 0.5, scale_b=torch.rand(1, 48, device=d) + 0.5)


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FUZZ_TARGETS = [
    fuzz.Target(
        "kp_precision.scaled_mm",
        "kp-precision",
        kp_precision.scaled_mm,
        lambda d: dict(_operands(d), bias=torch.randn(48, device=d).bfloat16()),
        dict(
            a=fuzz.Tensor(FP8, sized=(1,), words=("b",), first=True),
            b=fuzz.Tensor(FP8, sized=(0, 1), words=("a",)),
            # a one-value scale of any shape is tensorwise: no rank refusals
            scale_a=fuzz.Tensor((torch.float32,), sized=(0,), ranked=False, values=False),
            scale_b=fuzz.Tensor((torch.float32,), sized=(1,), ranked=False, values=False),
            bias=fuzz.Tensor((torch.bfloat16, torch.float32), sized=(0,), words=("out_dtype",), values=False),
            activation=fuzz.Scalar(bad=("tanh", 1)),
            out_dtype=fuzz.Scalar(bad=(torch.int32, torch.float8_e4m3fn, "bfloat16")),
        ),
    ),
]


test_bad_input_fuzz = kc.fuzz_test("scaled_mm", FUZZ_TARGETS)
