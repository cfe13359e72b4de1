"""2:4 activations (SparseActivationLinear): the input's 2:4 mask is kp's, the output and gradients match a float64
masked-dense computation, sparsify_for_training places it, and (GPU) the sparse-tensor-core route is within twice
the dense route's error. Tensors live on the device under test."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kp_core
import kp_sparsity
from kp_sparsity.ops import cusparselt
from kp_sparsity.ops import prune as prune_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = "interpret" if kp_core.interpreter_enabled() else kp_core.TRITON


def expected(layer, x, dy):
    """float64 (y, dx, dW, db) with x_s = x * (the 2:4 magnitude mask of each token's features)."""
    x64 = x.detach().double()
    groups = x64.reshape(-1, x.shape[-1] // 4, 4).abs()
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(2, -1, sorted=False).indices, True)
    keep = keep.reshape(x.shape)
    w = layer.weight.detach().double().requires_grad_()
    xs = (x64 * keep).requires_grad_()
    y = F.linear(xs, w, layer.bias.detach().double())
    y.backward(dy.double())
    return y.detach(), xs.grad * keep, w.grad, dy.double().reshape(-1, dy.shape[-1]).sum(0)


def test_output_and_gradients_match_the_masked_dense_computation():
    torch.manual_seed(0)
    layer = kp_sparsity.SparseActivationLinear(32, 24, device=DEVICE)
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True)  # no ties in |x| per group
    dy = torch.randn(2, 5, 24, device=DEVICE)
    with kp_core.record_launches() as rec:
        y = layer(x)
    assert rec.backends(prune_mod.OP) == {KERNEL}
    y.backward(dy)
    for got, want in zip((y, x.grad, layer.weight.grad, layer.bias.grad), expected(layer, x, dy)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_sparsify_for_training_places_activation_layers():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 6)).to(DEVICE)
    decisions = kp_sparsity.sparsify_for_training(
        model, activation_filter_fn=lambda _m, fqn: fqn in ("2", "3"), route="dense", mask_every=None
    )
    assert isinstance(model[0], kp_sparsity.SparseTrainingLinear)
    assert isinstance(model[2], kp_sparsity.SparseActivationLinear)
    assert isinstance(model[3], kp_sparsity.SparseActivationLinear)  # 6 outputs: fine for 2:4 inputs
    assert [d.route for d in decisions] == ["dense"] * 3 and decisions[1].why == "2:4 activations"
    model(torch.randn(4, 16, device=DEVICE)).sum().backward()


def test_bad_arguments():
    with pytest.raises(ValueError, match="in_features must be a multiple of 4"):
        kp_sparsity.SparseActivationLinear(6, 8)
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        kp_sparsity.SparseActivationLinear.from_dense(nn.Conv1d(4, 4, 1))
    layer = kp_sparsity.SparseActivationLinear(64, 64, route="sparse")
    with pytest.raises(ValueError, match="route 'sparse' cannot run here"):
        layer(torch.randn(64, 64))  # fp32 on the CPU


@pytest.mark.skipif(DEVICE != "cuda", reason="2:4 sparse tensor cores: GPU only")
@pytest.mark.parametrize("tokens", [256, 100], ids=["packed", "tokens_not_a_multiple_of_64"])
def test_sparse_route_matches_the_float64_computation(tokens):
    torch.manual_seed(0)
    layer = kp_sparsity.SparseActivationLinear(512, 256, device=DEVICE, dtype=torch.bfloat16)
    x = torch.randn(tokens, 512, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(tokens, 256, device=DEVICE, dtype=torch.bfloat16)
    results = {}
    for route in ("sparse", "dense"):
        layer.route = route
        layer.weight.grad = layer.bias.grad = None
        xi = x.clone().requires_grad_()
        with kp_core.record_launches() as rec:
            y = layer(xi)
        assert rec.count(cusparselt.OP) == (route == "sparse" and tokens % 64 == 0)
        y.backward(dy)
        results[route] = (y, xi.grad, layer.weight.grad, layer.bias.grad)
    want = expected(layer, x, dy)
    for name, s, d, w in zip(("y", "dx", "dW", "db"), results["sparse"], results["dense"], want):
        err_s, err_d = (s.double() - w).abs().max().item(), (d.double() - w).abs().max().item()
        assert err_s <= 2 * err_d + 1e-3, (name, err_s, err_d)
