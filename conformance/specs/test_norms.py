"""Conformance spec for kp-norms: RMSNorm forward and backward against an independent float64 reference."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import kp_conformance as kc
import kp_core
import kp_norms
from kp_norms.ops import rms_norm as rms_mod

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TIER = kc.current()
DEVICE = kc.device()
KERNEL_BACKEND = kp_core.INTERPRET if kc.interpreting() else kp_core.TRITON

kc.declare(
    kc.Spec(
        name="rms_norm",
        ops=(rms_mod.OP, rms_mod.OP_BWD),
        reference="y = x * rsqrt(mean(x^2) + eps) * w in float64 (Zhang & Sennrich 2019, eq. 4; torch.nn.RMSNorm docs)",
        dtypes=DTYPES,
        properties=(
            "values",
            "gradients",
            "no_mutation",
            "determinism",
            "nan_inf",
            "zero_size",
            "bad_input",
            "opcheck",
            "compile",
        ),
    )
)


def reference(x64, normalized_shape, w64, eps):
    """RMSNorm from its definition, plain PyTorch, float64. Independent of kp's code."""
    dims = tuple(range(-len(normalized_shape), 0))
    y = x64 * torch.rsqrt(x64.pow(2).mean(dims, keepdim=True) + eps)
    return y if w64 is None else y * w64


def effective_eps(eps, dtype):
    # PyTorch (and kp) take the compute dtype's epsilon when eps is None.
    return eps if eps is not None else torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


def skip_if_not_covered(dtype):
    reason = kc.not_covered_reason(dtype)
    if reason:
        pytest.skip(reason)


def assert_kernel_ran(record, *ops):
    for op in ops:
        ran = record.backends(op)
        assert ran == {KERNEL_BACKEND}, f"{op}: expected only {KERNEL_BACKEND} launches, got {ran or 'none'}"


def make_case(shape, normalized_shape, dtype, layout, affine, scale, seed):
    x = kc.make_input(shape, dtype, DEVICE, layout, scale=scale, seed=seed)
    w = kc.make_input(normalized_shape, dtype, DEVICE, "contiguous", seed=seed + 1) if affine else None
    return x, w


case = dict(
    shape=kc.row_shapes(TIER),
    layout=st.sampled_from(kc.LAYOUTS),
    affine=st.booleans(),
    eps=st.sampled_from([None, 1e-6, 1e-5]),
    scale=st.sampled_from([1.0, 0.01, 30.0]),
    seed=st.integers(0, 2**16),
)


@pytest.mark.conformance(kernel="rms_norm", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(**case)
def test_values(dtype, shape, layout, affine, eps, scale, seed):
    skip_if_not_covered(dtype)
    shape, norm = shape
    x, w = make_case(shape, norm, dtype, layout, affine, scale, seed)
    with kp_core.record_launches() as rec:
        y = kp_norms.rms_norm(x, norm, w, eps)
    if x.numel():
        assert_kernel_ran(rec, rms_mod.OP)
    ref = reference(x.double(), norm, None if w is None else w.double(), effective_eps(eps, dtype))
    kc.check_close("y", y, ref, F.rms_norm(x, norm, w, eps), dtype)


@pytest.mark.conformance(kernel="rms_norm", prop="gradients")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(**case)
def test_gradients(dtype, shape, layout, affine, eps, scale, seed):
    skip_if_not_covered(dtype)
    shape, norm = shape
    x, w = make_case(shape, norm, dtype, layout, affine, scale, seed)
    dy = kc.make_input(shape, dtype, DEVICE, "contiguous", seed=seed + 2)

    def grads(fn, x, w, dy):
        x = x.detach().requires_grad_()
        w = None if w is None else w.detach().requires_grad_()
        fn(x, norm, w, eps).backward(dy)
        return x.grad, None if w is None else w.grad

    with kp_core.record_launches() as rec:
        dx, dw = grads(kp_norms.rms_norm, x, w, dy)
    if x.numel():
        assert_kernel_ran(rec, rms_mod.OP, rms_mod.OP_BWD)
    e = effective_eps(eps, dtype)
    ref_dx, ref_dw = grads(
        lambda x, n, w, _: reference(x, n, w, e), x.double(), None if w is None else w.double(), dy.double()
    )
    low_dx, low_dw = grads(F.rms_norm, x, w, dy)
    kc.check_close("dx", dx, ref_dx, low_dx, dtype)
    if w is not None:
        kc.check_close("dw", dw, ref_dw, low_dw, dtype)


FIXED_SHAPES = [((7, 33), (33,)), ((3, 5, 257), (257,)), ((4, 2, 64), (2, 64)), ((2, 16385), (16385,))]


@pytest.mark.conformance(kernel="rms_norm", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("layout", kc.LAYOUTS)
def test_no_mutation(dtype, layout):
    skip_if_not_covered(dtype)
    for i, (shape, norm) in enumerate(FIXED_SHAPES):
        x, w = make_case(shape, norm, dtype, layout, True, 1.0, i)
        dy = kc.make_input(shape, dtype, DEVICE, layout, seed=i + 7)
        before = [t.clone() for t in (x, w, dy)]
        with kp_core.record_launches() as rec:
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            kp_norms.rms_norm(x, norm, w).sum()  # forward alone on the originals
            kp_norms.rms_norm(xg, norm, wg).backward(dy)
        assert_kernel_ran(rec, rms_mod.OP, rms_mod.OP_BWD)
        for t, b in zip((x, w, dy), before):
            assert torch.equal(t, b), "an input was modified"


@pytest.mark.conformance(kernel="rms_norm", prop="determinism")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_determinism(dtype):
    """Bitwise-equal results on repeated calls, the weight gradient included (no atomics)."""
    skip_if_not_covered(dtype)
    rows = 4096 if DEVICE.type == "cuda" else 67
    for i, n in enumerate((4097, 20000)):
        x, w = make_case((rows, n), (n,), dtype, "contiguous", True, 1.0, i)
        dy = kc.make_input((rows, n), dtype, DEVICE, "contiguous", seed=i + 3)
        outs = []
        for _ in range(2):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            with kp_core.record_launches() as rec:
                y = kp_norms.rms_norm(xg, (n,), wg)
                y.backward(dy)
            assert_kernel_ran(rec, rms_mod.OP, rms_mod.OP_BWD)
            outs.append((y.detach(), xg.grad, wg.grad))
        for a, b in zip(*outs):
            assert torch.equal(a, b), "repeated calls differ"


@pytest.mark.conformance(kernel="rms_norm", prop="nan_inf")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_nan_inf_propagate_per_row(dtype):
    skip_if_not_covered(dtype)
    for n in (33, 4096, 20000):
        x, w = make_case((5, n), (n,), dtype, "contiguous", True, 1.0, n)
        x[1, 3] = float("nan")
        x[3, 0] = float("inf")
        x[4, n - 1] = float("-inf")
        with kp_core.record_launches() as rec:
            y = kp_norms.rms_norm(x, (n,), w)
        assert_kernel_ran(rec, rms_mod.OP)
        ref = reference(x.double(), (n,), w.double(), effective_eps(None, dtype))
        assert torch.equal(torch.isnan(y), torch.isnan(ref)), "NaN pattern differs from the reference"
        assert torch.equal(torch.isinf(y), torch.isinf(ref)), "Inf pattern differs from the reference"
        clean = [0, 2]  # rows with only finite values stay correct
        kc.check_close("finite rows", y[clean], ref[clean], F.rms_norm(x[clean], (n,), w), dtype)


@pytest.mark.conformance(kernel="rms_norm", prop="zero_size")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_zero_size(dtype):
    for shape, norm in [((0, 8), (8,)), ((3, 0, 5), (5,)), ((4, 0), (0,)), ((2, 0, 3), (0, 3))]:
        x = torch.zeros(shape, dtype=dtype, device=DEVICE, requires_grad=True)
        w = torch.ones(norm, dtype=dtype, device=DEVICE, requires_grad=True)
        with kp_core.record_launches() as rec:
            y = kp_norms.rms_norm(x, norm, w)
            y.sum().backward()
        # Documented behaviour: an empty input launches no kernel (nothing to compute, no empty grid).
        assert rec.backends() <= {kp_core.REFERENCE}, f"an empty input launched {rec.launches}"
        expected = F.rms_norm(x, norm, w)
        assert y.shape == expected.shape and y.dtype == expected.dtype
        assert x.grad.shape == x.shape
        assert torch.equal(w.grad, torch.zeros_like(w)), "an empty batch must give a zero weight gradient"


BAD_INPUTS = [
    # (description, call, error type, words the message must contain)
    (
        "integer input",
        lambda d: kp_norms.rms_norm(torch.ones(2, 4, dtype=torch.int32, device=d), (4,)),
        TypeError,
        "input",
    ),
    ("bool input", lambda d: kp_norms.rms_norm(torch.ones(2, 4, dtype=torch.bool, device=d), (4,)), TypeError, "input"),
    ("not a tensor", lambda d: kp_norms.rms_norm([[1.0, 2.0]], (2,)), TypeError, "input"),
    ("shape mismatch", lambda d: kp_norms.rms_norm(torch.ones(2, 4, device=d), (5,)), ValueError, "normalized_shape"),
    ("too many dims", lambda d: kp_norms.rms_norm(torch.ones(4, device=d), (1, 4)), ValueError, "normalized_shape"),
    (
        "empty normalized_shape",
        lambda d: kp_norms.rms_norm(torch.ones(4, device=d), ()),
        ValueError,
        "normalized_shape",
    ),
    (
        "weight shape",
        lambda d: kp_norms.rms_norm(torch.ones(2, 4, device=d), (4,), torch.ones(3, device=d)),
        ValueError,
        "weight",
    ),
    (
        "weight dtype",
        lambda d: kp_norms.rms_norm(torch.ones(2, 4, device=d), (4,), torch.ones(4, dtype=torch.float16, device=d)),
        TypeError,
        "weight",
    ),
    (
        "integer weight",
        lambda d: kp_norms.rms_norm(torch.ones(2, 4, device=d), (4,), torch.ones(4, dtype=torch.int64, device=d)),
        TypeError,
        "weight",
    ),
    (
        "weight on another device",
        lambda d: kp_norms.rms_norm(torch.ones(2, 4, device=d), (4,), torch.ones(4, device="meta")),
        ValueError,
        "weight",
    ),
    ("negative eps", lambda d: kp_norms.rms_norm(torch.ones(2, 4, device=d), (4,), None, -1.0), ValueError, "eps"),
    (
        "module input dtype",
        lambda d: kp_norms.RMSNorm(4, device=d)(torch.ones(2, 4, dtype=torch.int64, device=d)),
        TypeError,
        "input",
    ),
]


@pytest.mark.conformance(kernel="rms_norm", prop="bad_input")
@pytest.mark.parametrize("what,call,error,words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(what, call, error, words):
    with pytest.raises(error, match=words):
        call(DEVICE)


@pytest.mark.conformance(kernel="rms_norm", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    skip_if_not_covered(dtype)
    for layout in ("contiguous", "row_strided", "transposed"):
        x = kc.make_input((37, 130), dtype, DEVICE, layout, seed=1)
        w = kc.make_input((130,), dtype, DEVICE, "contiguous", seed=2).requires_grad_()
        x.requires_grad_()
        with kp_core.record_launches() as rec:
            torch.library.opcheck(rms_mod.rms_norm_op, (x, w, 1e-6))
            torch.library.opcheck(rms_mod.rms_norm_op, (x, None, 1e-6))
            y, rstd = rms_mod.rms_norm_op(x.detach(), w.detach(), 1e-6)
            dy = kc.make_input((37, 130), dtype, DEVICE, layout, seed=3)
            torch.library.opcheck(rms_mod.rms_norm_backward_op, (dy, x.detach(), w.detach(), rstd))
        assert_kernel_ran(rec, rms_mod.OP, rms_mod.OP_BWD)


@pytest.mark.conformance(kernel="rms_norm", prop="compile")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_compile_fullgraph_equals_eager(dtype):
    skip_if_not_covered(dtype)
    torch._dynamo.reset()

    def f(x, w):
        return kp_norms.rms_norm(x * 2, x.shape[-1:], w, 1e-6) + 1

    compiled = torch.compile(f, fullgraph=True)
    for layout, (shape, _) in zip(("contiguous", "transposed"), FIXED_SHAPES[:2]):
        x, w = make_case(shape, shape[-1:], dtype, layout, True, 1.0, 5)
        dy = kc.make_input(shape, dtype, DEVICE, "contiguous", seed=6)
        results = []
        for fn in (f, compiled):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            with kp_core.record_launches() as rec:
                y = fn(xg, wg)
                y.backward(dy)
            assert_kernel_ran(rec, rms_mod.OP, rms_mod.OP_BWD)
            results.append((y.detach(), xg.grad, wg.grad))
        for name, a, b in zip(("y", "dx", "dw"), *results):
            # The op is opaque to the compiler, so the same kernel computes both: results match to the bit
            # except for what Inductor fuses around it (x * 2, + 1), which is exact in every dtype here.
            assert torch.equal(a, b), (
                f"{name}: compiled differs from eager by {(a.double() - b.double()).abs().max():.3e}"
            )


def test_reference_is_independent():
    """The reference must not route through kp (sanity check on the spec itself)."""
    x = torch.randn(3, 8, dtype=torch.float64)
    with kp_core.record_launches() as rec:
        reference(x, (8,), None, 1e-6)
    assert rec.count() == 0
    assert math.isclose(reference(torch.ones(1, 4, dtype=torch.float64), (4,), None, 0.0)[0, 0].item(), 1.0)
