"""Under torch.compile a tensorwise cast is the quantize op's PyTorch maths, which inductor fuses into its own
kernels (kp_precision.shared.cast): it must give the kernels' bits, so a compiled float8 layer computes what the
eager one does."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import kp_core
from kp_precision.recipes import Float8Config
from kp_precision.shared import cast
from kp_precision.training import Float8Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _values(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 80, generator=g)
    if kind == "tiny":  # an amax below the scale's floor (kp_core.float8.EPS)
        x = x * 1e-30
    if kind == "zeros":
        x = torch.zeros(48, 80)
    if kind == "wide":  # values across float32's exponents, some of them float8 subnormals once scaled
        x = x * torch.logspace(-20, 20, 80)
    return x.to(DEVICE, torch.bfloat16)


def _bits(q):
    return q.data.view(torch.uint8), q.scale, q.amax


@pytest.mark.parametrize("kind", ["normal", "tiny", "zeros", "wide"])
@pytest.mark.parametrize(
    ("fp8", "power_of_2", "delayed"), [(E4M3, False, False), (E5M2, True, False), (E4M3, False, True)]
)
def test_a_compiled_tensorwise_cast_gives_the_kernels_bits(kind, fp8, power_of_2, delayed):
    x = _values(kind)
    # delayed scaling: a given scale small enough that some values saturate
    scale = torch.tensor(x.float().abs().amax().item() / 1000 + 1e-30, device=DEVICE) if delayed else None
    with kp_core.record_launches() as rec:
        want = _bits(cast(x, fp8, (0, 0), power_of_2, scale))
    assert rec.backends("kp::quantize") and kp_core.REFERENCE not in rec.backends("kp::quantize")
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: _bits(cast(t, fp8, (0, 0), power_of_2, scale)), fullgraph=True)
    got, codes = run_and_get_code(compiled, x)
    assert "kp.quantize" not in "\n".join(codes), "the cast was not handed to inductor"
    for name, a, b in zip(("data", "scale", "amax"), got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), f"{name} differs: {a} vs {b}"


def test_a_compiled_tensorwise_float8_linear_equals_the_eager_one():
    """Forward and every gradient, bit for bit: the casts and transposes inductor makes are the kernels'."""
    torch.manual_seed(0)
    layer = Float8Linear(256, 128, bias=True, device=DEVICE, dtype=torch.bfloat16, config=Float8Config("tensorwise"))
    x = torch.randn(96, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(96, 128, device=DEVICE, dtype=torch.bfloat16)

    def run(fn):
        y = fn(x)
        grads = torch.autograd.grad(y, (x, *layer.parameters()), gy)
        return [y.detach(), *grads]

    eager = run(layer)
    torch._dynamo.reset()
    compiled = run(torch.compile(layer, fullgraph=True))
    for name, a, b in zip(("output", "grad x", "grad weight", "grad bias"), compiled, eager, strict=True):
        assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max()}"
