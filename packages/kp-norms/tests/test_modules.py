"""kp-norms' own tests: module and patch behaviour, both backends. Numerics live in conformance/specs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kp_core
import kp_norms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON


def test_functional_runs_the_kernel_and_matches_torch():
    x, w = torch.randn(6, 5, 33, device=DEVICE), torch.randn(5, 33, device=DEVICE)
    with kp_core.record_launches() as rec:
        y = kp_norms.rms_norm(x, (5, 33), w, 1e-5)
    assert rec.backends("kp::norm") == {KERNEL}
    torch.testing.assert_close(y, F.rms_norm(x, (5, 33), w, 1e-5))


def test_reference_backend_is_selectable(monkeypatch):
    monkeypatch.setenv("KP_BACKEND", "reference")
    x = torch.randn(4, 17, requires_grad=True)
    with kp_core.record_launches() as rec:
        kp_norms.rms_norm(x, (17,)).sum().backward()
    assert rec.backends() == {"reference"}
    torch.testing.assert_close(x.grad, torch.func.grad(lambda t: F.rms_norm(t, (17,)).sum())(x.detach()))


@pytest.mark.parametrize("shape,kw", [(8, {}), ((4, 8), {"eps": 1e-6}), (8, {"elementwise_affine": False})])
def test_module_is_a_drop_in_for_torch(shape, kw):
    ours, theirs = kp_norms.RMSNorm(shape, **kw), nn.RMSNorm(shape, **kw)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
    if ours.weight is not None:
        with torch.no_grad():
            theirs.weight.uniform_()
        ours.load_state_dict(theirs.state_dict())
        theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, *((shape,) if isinstance(shape, int) else shape))
    torch.testing.assert_close(ours(x), theirs(x))


@pytest.mark.parametrize(
    "shape,kw", [(8, {}), ((4, 8), {"eps": 1e-6}), (8, {"elementwise_affine": False}), (8, {"bias": False})]
)
def test_layer_norm_module_is_a_drop_in_for_torch(shape, kw):
    ours, theirs = kp_norms.LayerNorm(shape, **kw), nn.LayerNorm(shape, **kw)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    assert dict(ours.named_parameters()).keys() == dict(theirs.named_parameters()).keys()
    assert repr(ours).split("(", 1)[1] == repr(theirs).split("(", 1)[1]
    with torch.no_grad():
        for p in theirs.parameters():
            p.uniform_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, *((shape,) if isinstance(shape, int) else shape), device=DEVICE)
    with kp_core.record_launches() as rec:
        y = ours.to(DEVICE)(x)
    assert rec.backends("kp::norm") == {KERNEL}
    torch.testing.assert_close(y, theirs.to(DEVICE)(x))


def test_gemma_style_module_starts_at_zero_and_scales_by_one_plus_w():
    m = kp_norms.RMSNorm(16, eps=1e-6, offset=1.0)
    assert torch.equal(m.weight, torch.zeros(16)) and "offset=1.0" in repr(m)
    with torch.no_grad():
        m.weight.uniform_()
    x = torch.randn(4, 16)
    torch.testing.assert_close(m(x), F.rms_norm(x, (16,), None, 1e-6) * (1 + m.weight))


def test_llama_casting_promotes_like_hf():
    x, w = torch.randn(4, 16, dtype=torch.float16, device=DEVICE), torch.randn(16, device=DEVICE)
    y = kp_norms.rms_norm(x, (16,), w, 1e-6, casting="llama")
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, w * h.to(torch.float16))


def test_module_dtype_device_arguments():
    m = kp_norms.RMSNorm(16, device="cpu", dtype=torch.float64)
    assert m.weight.dtype == torch.float64 and torch.equal(m.weight, torch.ones(16, dtype=torch.float64))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1 = nn.RMSNorm(32, eps=1e-6)
        self.lin = nn.Linear(32, 32)
        self.inner = nn.Sequential(nn.RMSNorm(32), nn.ReLU())

    def forward(self, x):
        return self.inner(self.lin(self.norm1(x)))


def test_patch_swaps_in_place_and_unpatch_restores():
    torch.manual_seed(0)
    model = Block()
    with torch.no_grad():
        model.norm1.weight.uniform_()
    x = torch.randn(4, 32)
    expected = model(x)
    keys = model.state_dict().keys()
    original = model.norm1

    changed = kp_norms.patch(model)
    assert changed == ["norm1", "inner.0"]
    assert isinstance(model.norm1, kp_norms.RMSNorm) and isinstance(model.inner[0], kp_norms.RMSNorm)
    assert model.norm1.weight is original.weight  # shared, so optimizers keep working
    assert model.state_dict().keys() == keys
    with kp_core.record_launches() as rec:
        torch.testing.assert_close(model(x), expected)
    assert rec.count(op="kp::norm") == 2

    assert kp_norms.unpatch(model) == ["norm1", "inner.0"]
    assert model.norm1 is original and type(model.inner[0]) is nn.RMSNorm
    assert kp_norms.patch(model, rms_norm=False) == []
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        kp_norms.patch("not a model")
