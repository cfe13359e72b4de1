"""Conformance spec for kp-precision's fused linear + activation (kp::linear_activation).

Reference: F.linear then the activation, in float64, with autograd for the gradients; PyTorch's own run in the
input's dtype (F.linear, the activation, autograd) for the 2x rule, on the output and every gradient.
"""

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
from kp_precision.ops import linear_activation as la_mod

DTYPES = (torch.float16, torch.bfloat16)
TIER = kc.current()
DEVICE = kc.device()
OP = "kp::linear_activation"
OPS = (OP, "kp::linear_activation_backward")
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
EPILOGUE = {
    None: lambda t: t,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}

kc.declare(
    kc.Spec(
        name="linear_activation",
        package="kp-precision",
        ops=OPS,
        reference=(
            "F.linear then the activation in float64 (autograd for gradients); PyTorch in the input's dtype for "
            "the 2x rule"
        ),
        dtypes=DTYPES,
        properties=("values", "activations", "no_mutation", "zero_size", "bad_input", "opcheck", "compile"),
    )
)


def check(shape, n, dtype, activation, bias, seed, family="normal", grad=True):
    k = shape[-1]
    x = kc.make_input(shape, dtype, DEVICE, "contiguous", seed=seed, family=family)
    w = kc.make_input((n, k), dtype, DEVICE, "contiguous", seed=seed + 1) / max(1.0, k**0.5)
    b = kc.make_input((n,), dtype, DEVICE, "contiguous", seed=seed + 2) if bias else None
    gy = kc.make_input((*shape[:-1], n), dtype, DEVICE, "contiguous", seed=seed + 3)
    inputs = [t for t in (x, w, b) if t is not None]

    def run(fn, d):
        """(y, gradients of x, w and b) of fn on the inputs in dtype d."""
        leaves = [t.detach().to(d).requires_grad_(grad) for t in inputs]
        y = fn(*leaves)
        if not grad:
            return [y.detach()]
        y.backward(gy.to(d))
        return [y.detach()] + [t.grad for t in leaves]

    with kp_core.record_launches() as rec:
        ours = run(lambda *t: kp_precision.linear_activation(*t, activation=activation), dtype)
    if ours[0].numel() and k:
        kc.assert_kernel_ran(rec, OP)
    torch_fn = lambda *t: EPILOGUE[activation](F.linear(*t))  # noqa: E731
    ref, low = run(torch_fn, torch.float64), run(torch_fn, dtype)
    for name, o, r, lp in zip(("y", "dx", "dweight", "dbias"), ours, ref, low, strict=False):
        kc.check_close(f"linear_activation {activation} {name} {shape}x{n}", o, r, lp, dtype)


@st.composite
def cases(draw):
    cap = min(512, max(16, TIER.max_cols // 4))
    k = draw(st.one_of(st.sampled_from([1, 16, 31, 64, 130]), st.integers(1, cap)))
    n = draw(st.one_of(st.sampled_from([1, 16, 33, 96]), st.integers(1, cap)))
    m = draw(st.one_of(st.sampled_from([1, 2, 17, 33]), st.integers(1, max(1, min(1024, TIER.max_numel // max(k, n))))))
    return dict(
        shape=(m, k) if draw(st.booleans()) else (1, m, k),
        n=n,
        activation=draw(st.sampled_from(ACTIVATIONS)),
        bias=draw(st.booleans()),
        family=draw(st.sampled_from(kc.GLU_FAMILIES)),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.conformance(kernel="linear_activation", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=cases())
def test_values(dtype, c):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    check(c["shape"], c["n"], dtype, c["activation"], c["bias"], c["seed"], c["family"])


@pytest.mark.conformance(kernel="linear_activation", prop="activations")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_activations(dtype, activation):
    """Each activation with and without bias, training (the pre-activation stored, the backward run) and
    inference (nothing stored), on a shape that crosses tiles."""
    kc.skip_if_not_covered(dtype, uses_dot=True)
    for bias, grad in ((True, True), (False, False)):
        check((37, 80), 48, dtype, activation, bias, seed=3, family="large", grad=grad)


@pytest.mark.conformance(kernel="linear_activation", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("tma", (True, False), ids=("tma", "pointers"))
def test_both_kernels(dtype, tma):
    """Each forward kernel pinned in turn: the TMA one (Triton with tensor descriptors, 16-byte aligned rows) and
    the pointer one (every other case), on a shape that crosses tiles in both directions, training."""
    kc.skip_if_not_covered(dtype, uses_dot=True)
    if tma and la_mod.TensorDescriptor is None:
        pytest.skip("this Triton has no host tensor descriptors (3.4+): the TMA kernel cannot run here")
    with kp_core.pinned("_linear_activation", tma=tma), kp_core.record_launches() as rec:
        check((70, 96), 80, dtype, "gelu", True, seed=5)
    forward = rec.kernels(OP) & {"_linear_activation", "_scaled_mm"}
    assert forward == {"_linear_activation" if tma else "_scaled_mm"}, rec.launches


@pytest.mark.conformance(kernel="linear_activation", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_no_mutation(dtype):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    x = kc.make_input((9, 64), dtype, DEVICE, "row_strided", seed=1).requires_grad_()
    w = kc.make_input((32, 64), dtype, DEVICE, "contiguous", seed=2).requires_grad_()
    b = kc.make_input((32,), dtype, DEVICE, "contiguous", seed=3).requires_grad_()
    before = [t.detach().clone() for t in (x, w, b)]
    kp_precision.linear_activation(x, w, b, "silu").sum().backward()
    assert all(torch.equal(t.detach(), o) for t, o in zip((x, w, b), before, strict=True)), "an input was modified"


@pytest.mark.conformance(kernel="linear_activation", prop="zero_size")
def test_zero_size():
    """Empty outputs launch nothing; K = 0 gives act(bias)."""
    for m, k, n in ((0, 16, 8), (4, 16, 0), (4, 0, 8)):
        x = torch.zeros(m, k, dtype=torch.float16, device=DEVICE)
        w = torch.zeros(n, k, dtype=torch.float16, device=DEVICE)
        b = torch.full((n,), -1.5, dtype=torch.float16, device=DEVICE)
        with kp_core.record_launches() as rec:
            y = kp_precision.linear_activation(x, w, b, "gelu")
        assert rec.backends() <= {kp_core.REFERENCE} and y.shape == (m, n)
        torch.testing.assert_close(y, F.gelu(b.float()).half().expand(m, n), rtol=0, atol=0)


_t = lambda d, shape=(4, 32), dtype=torch.float16: torch.ones(shape, dtype=dtype, device=d)  # noqa: E731
BAD_INPUTS = [
    ("float32 input", lambda d: kp_precision.linear_activation(_t(d, dtype=torch.float32), _t(d)), TypeError, "input"),
    (
        "weight of another dtype",
        lambda d: kp_precision.linear_activation(_t(d), _t(d, dtype=torch.bfloat16)),
        TypeError,
        "weight",
    ),
    ("weight 1-D", lambda d: kp_precision.linear_activation(_t(d), _t(d, (32,))), ValueError, "weight"),
    ("K mismatch", lambda d: kp_precision.linear_activation(_t(d), _t(d, (8, 16))), ValueError, "weight"),
    ("bias length", lambda d: kp_precision.linear_activation(_t(d), _t(d, (8, 32)), _t(d, (4,))), ValueError, "bias"),
    (
        "bias dtype",
        lambda d: kp_precision.linear_activation(_t(d), _t(d, (8, 32)), _t(d, (8,), torch.float32)),
        TypeError,
        "bias",
    ),
    (
        "unknown activation",
        lambda d: kp_precision.linear_activation(_t(d), _t(d, (8, 32)), activation="tanh"),
        ValueError,
        "activation",
    ),
    (
        "weight on another device",
        lambda d: kp_precision.linear_activation(_t(d), torch.ones(8, 32, dtype=torch.float16, device="meta")),
        ValueError,
        "weight",
    ),
]


test_bad_input = kc.bad_input_test("linear_activation", BAD_INPUTS, DEVICE)


@pytest.mark.conformance(kernel="linear_activation", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    x = kc.make_input((17, 48), dtype, DEVICE, "contiguous", seed=1).requires_grad_()
    w = kc.make_input((32, 48), dtype, DEVICE, "contiguous", seed=2).requires_grad_()
    b = kc.make_input((32,), dtype, DEVICE, "contiguous", seed=3).requires_grad_()
    with kp_core.record_launches() as rec:
        torch.library.opcheck(la_mod.LINEAR_ACTIVATION.op, (x, w, b, "gelu_tanh", True))
    kc.assert_kernel_ran(rec, OP)


@pytest.mark.conformance(kernel="linear_activation", prop="compile")
def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    layer = kp_precision.FusedLinearActivation(64, 48, activation="silu", device=DEVICE, dtype=torch.float16)
    x = kc.make_input((20, 64), torch.float16, DEVICE, "contiguous", seed=4)
    results = []
    for fn in (layer, torch.compile(layer, fullgraph=True)):
        layer.zero_grad(set_to_none=True)
        with kp_core.record_launches() as rec:
            y = fn(x)
            y.float().sum().backward()
        kc.assert_kernel_ran(rec, OP)
        results.append((y, layer.weight.grad, layer.bias.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert isinstance(layer, nn.Linear) and layer.state_dict().keys() == nn.Linear(64, 48).state_dict().keys()


FUZZ_TARGETS = [
    fuzz.Target(
        "kp_precision.linear_activation",
        "kp-precision",
        kp_precision.linear_activation,
        lambda d: dict(
            input=torch.randn(8, 32, device=d).half(),
            weight=torch.randn(48, 32, device=d).half(),
            bias=torch.randn(48, device=d).half(),
            activation="gelu",
        ),
        dict(
            input=fuzz.Tensor(DTYPES, sized=(1,), ranked=False, words=("weight",), first=True),
            weight=fuzz.Tensor(DTYPES, sized=(1,), words=("input",)),
            bias=fuzz.Tensor(DTYPES, sized=(0,), words=("weight",)),
            activation=fuzz.Scalar(bad=("tanh", 1)),
        ),
        torch_fn=lambda input, weight, bias, activation="gelu": F.gelu(F.linear(input, weight, bias)),
        zero=lambda d: dict(
            input=torch.randn(0, 32, device=d).half(), weight=torch.randn(48, 32, device=d).half(), bias=None
        ),
    ),
]


test_bad_input_fuzz = kc.fuzz_test("linear_activation", FUZZ_TARGETS)
