"""kp-norms' own tests of the gated activations: the kernel runs, matches torch, both backends, both forms.
Numerics over shapes, dtypes and layouts live in conformance/specs/test_glu.py."""

import pytest
import torch
import torch.nn.functional as F

import kp_core
import kp_norms
from kp_norms.ops import glu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON

CASES = [  # (ours on (gate, up), ours on packed input, torch's formula on (gate, up))
    (kp_norms.swiglu, kp_norms.swiglu_packed, lambda g, u: F.silu(g) * u),
    (kp_norms.geglu, kp_norms.geglu_packed, lambda g, u: F.gelu(g) * u),
    (
        lambda g, u: kp_norms.geglu(g, u, approximate="tanh"),
        lambda x: kp_norms.geglu_packed(x, approximate="tanh"),
        lambda g, u: F.gelu(g, approximate="tanh") * u,
    ),
]
IDS = ["swiglu", "geglu", "geglu_tanh"]


def grads(fn, inputs, dy):
    inputs = [t.detach().requires_grad_() for t in inputs]
    y = fn(*inputs)
    y.backward(dy)
    return y.detach(), *(t.grad for t in inputs)


@pytest.mark.parametrize("ours,_,theirs", CASES, ids=IDS)
def test_split_runs_the_kernel_and_matches_torch(ours, _, theirs):
    g, u, dy = (torch.randn(3, 5, 129, device=DEVICE, dtype=torch.float64) for _ in range(3))
    with kp_core.record_launches() as rec:
        got = grads(ours, (g, u), dy)
    assert rec.backends(glu.OP) == {KERNEL} and rec.backends(glu.OP_BWD) == {KERNEL}
    for a, b in zip(got, grads(theirs, (g, u), dy)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("_,ours,theirs", CASES, ids=IDS)
def test_packed_matches_chunked_torch_and_writes_one_gradient(_, ours, theirs):
    x = torch.randn(7, 2 * 33, device=DEVICE, dtype=torch.float64)
    dy = torch.randn(7, 33, device=DEVICE, dtype=torch.float64)
    with kp_core.record_launches() as rec:
        y, dx = grads(ours, (x,), dy)
    assert rec.backends(glu.OP_PACKED) == {KERNEL} and rec.backends(glu.OP_PACKED_BWD) == {KERNEL}
    y_ref, dx_ref = grads(lambda x: theirs(*x.chunk(2, -1)), (x,), dy)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)


def test_strided_views_are_read_in_place():
    """Halves of one wider tensor (row stride 2H) and a transposed view give torch's answer, inputs unchanged."""
    wide = torch.randn(6, 40, device=DEVICE)
    g, u = wide[:, :17], wide[:, 20:37]
    t = torch.randn(17, 6, device=DEVICE).t()  # not unit-stride along the last dim: copied by the launcher
    before = wide.clone()
    torch.testing.assert_close(kp_norms.swiglu(g, u), F.silu(g) * u)
    torch.testing.assert_close(kp_norms.swiglu(t, u), F.silu(t) * u)
    assert torch.equal(wide, before)


def test_reference_backend_is_selectable(monkeypatch):
    monkeypatch.setenv("KP_BACKEND", "reference")
    g, u, dy = (torch.randn(4, 17, dtype=torch.float64) for _ in range(3))
    with kp_core.record_launches() as rec:
        got = grads(lambda g, u: kp_norms.geglu(g, u, approximate="tanh"), (g, u), dy)
        y, dx = grads(kp_norms.swiglu_packed, (torch.cat([g, u], -1),), dy)
    assert rec.backends() == {kp_core.REFERENCE}
    for a, b in zip(got, grads(lambda g, u: F.gelu(g, approximate="tanh") * u, (g, u), dy)):
        torch.testing.assert_close(a, b)
    y_ref, dg, du = grads(lambda g, u: F.silu(g) * u, (g, u), dy)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, torch.cat([dg, du], -1))


def test_low_precision_rounds_once():
    """fp16 in, fp16 out, computed in fp32: equal to torch's fp32 result rounded once."""
    g, u = (torch.randn(8, 64, device=DEVICE, dtype=torch.float16) for _ in range(2))
    y = kp_norms.swiglu(g, u)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, (F.silu(g.float()) * u.float()).half(), atol=0, rtol=2**-10)


def test_errors_name_the_argument():
    g = torch.ones(2, 4, device=DEVICE)
    with pytest.raises(ValueError, match="up"):
        kp_norms.swiglu(g, torch.ones(2, 5, device=DEVICE))
    with pytest.raises(TypeError, match="up"):
        kp_norms.swiglu(g, g.double())
    with pytest.raises(ValueError, match="input"):
        kp_norms.swiglu_packed(torch.ones(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="approximate"):
        kp_norms.geglu(g, g, approximate="erf")
