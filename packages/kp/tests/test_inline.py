"""Under torch.compile on a GPU, kp's ops are traced into the graph and inductor launches their kernels from its
own code (kp_core.library's inlining): the compiled code holds each kernel the op launches and no call back into
a kp op, and forward and gradients equal those of the same graph with the ops called as units, bit for bit. On
a CPU (Triton's interpreter) the op stays one unit of the graph, which the conformance suite's compile cases
cover."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import kp_core
import kp_norms.functional as N
import kp_precision
from kp_precision.recipes import Float8Config
from kp_precision.training import Float8Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor launches Triton kernels on a GPU")
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _fresh_compile():
    """Each test traces its graph: AOTAutograd's cache keys a graph before kp's ops are traced into it, so it
    could hand back one compiled with the other choice (an earlier test's, or an earlier run's on this machine)."""
    from torch._functorch import config as aot_config

    with aot_config.patch(enable_autograd_cache=False), torch._inductor.config.patch(fx_graph_cache=False):
        yield


def _rms(x, w):
    return N.rms_norm(x, (x.shape[-1],), w, 1e-5)


def _norm_float8_rowwise(x, w):
    out = N.norm_float8(x, w, eps=1e-5, granularity="rowwise")
    return out.output, out.data.view(torch.uint8), out.scale


def _glu_float8(gate, up):
    out = N.glu_float8(gate, up, granularity="tensorwise")
    return out.output, out.data.view(torch.uint8), out.scale


def _quantize(x):
    q = kp_precision.quantize(x, granularity="rowwise")
    return q.data.view(torch.uint8), q.scale


def _linear(recipe):
    torch.manual_seed(0)
    layer = Float8Linear(256, 128, bias=False, device=DEVICE, dtype=torch.bfloat16, config=Float8Config(recipe))
    return layer


def _inputs(*shapes, grad=True):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    return [torch.randn(s, device=DEVICE, dtype=torch.bfloat16, generator=g).requires_grad_(grad) for s in shapes]


CASES = {
    "rms_norm": (_rms, [(64, 512), (512,)]),
    "swiglu": (N.swiglu, [(64, 1024), (64, 1024)]),
    "glu_float8 tensorwise": (_glu_float8, [(64, 1024), (64, 1024)]),
    "quantize rowwise": (_quantize, [(64, 512)]),
}
NO_GRAD = {"quantize rowwise"}  # a cast has no gradient


def _run(fn, args, params=()):
    """Outputs, then the gradients of every input and parameter (a backward from the float outputs)."""
    outs = fn(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [a for a in (*args, *params) if a.requires_grad]
    floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
    if floats:
        loss = sum((o.float() * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum() for o in floats)
        grads = torch.autograd.grad(loss, leaves)
    else:
        grads = ()
    return [o.detach() for o in outs], list(grads)


def _check(fn, args, params=()):
    """fn compiled with kp's ops as units (launches recorded, which keeps them so) and compiled with them traced
    into the graph: the same kernels, the same bits; only who launches them differs."""
    torch._dynamo.reset()
    with kp_core.record_launches() as record:
        expected = _run(torch.compile(fn, fullgraph=True), args, params)
    # Triton kernels only: a float8 matmul may run torch._scaled_mm (backend "library"), an aten op in any graph
    kernels = {launch.kernel for launch in record.launches if launch.backend == kp_core.TRITON}
    assert kernels and kp_core.REFERENCE not in record.backends()
    torch._dynamo.reset()
    got, codes = run_and_get_code(lambda: _run(torch.compile(fn, fullgraph=True), args, params))
    code = "\n".join(codes)
    missing = [k for k in kernels if k not in code]
    assert not missing, f"kernels not in inductor's code: {missing}"
    assert "torch.ops.kp." not in code, "a kp op is still called as a unit"
    for a, b in zip([*expected[0], *expected[1]], [*got[0], *got[1]], strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_op_launches_its_kernels_from_inductors_code(name):
    fn, shapes = CASES[name]
    _check(fn, _inputs(*shapes, grad=name not in NO_GRAD))


def test_compiled_float8_linear_forward_and_backward():
    """Rowwise: its casts are kp's kernels under compile. A tensorwise layer has none there (its casts are
    inductor's, its matmuls cuBLASLt's: kp-precision's test_float8_compiled)."""
    layer = _linear("rowwise")
    (x,) = _inputs((96, 256))
    _check(layer, [x], list(layer.parameters()))


def test_norm_float8_stays_one_op():
    """norm_float8 is not declared inline=True (kp_norms.ops.norm): compiled, it is still called as a unit."""
    x, w = _inputs((64, 512), (512,))
    torch._dynamo.reset()
    _, codes = run_and_get_code(lambda: _run(torch.compile(_norm_float8_rowwise, fullgraph=True), [x, w]))
    assert "torch.ops.kp.norm_float8" in "\n".join(codes)


def test_recorded_or_disabled_calls_stay_one_op(monkeypatch):
    """Recording launches needs each launch to pass through Python: the op is then called as a unit, as with
    KP_INLINE=0."""
    (x, w) = _inputs((64, 512), (512,), grad=False)
    torch._dynamo.reset()
    with kp_core.record_launches() as record:
        _, codes = run_and_get_code(torch.compile(_rms, fullgraph=True), x, w)
    assert "torch.ops.kp.norm" in "\n".join(codes) and record.count("kp::norm") == 1
    monkeypatch.setenv("KP_INLINE", "0")
    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(_rms, fullgraph=True), x, w)
    assert "torch.ops.kp.norm" in "\n".join(codes)
