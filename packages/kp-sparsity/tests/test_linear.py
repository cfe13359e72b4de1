"""sparsify() and SparseLinear: Wanda calibration, pruning in place, routing; the 2:4 matmul on a GPU."""

import copy

import pytest
import torch
from torch import nn

import kp_sparsity

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def mlp(dtype=torch.float32, device=DEVICE):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 6), nn.Linear(6, 8)).to(device, dtype)


def test_wanda_dense_route_prunes_every_layer_by_its_activations():
    """route='dense' prunes in place (any dtype, any device): each layer's weight is its Wanda 2:4 pruning, with
    column scales the L2 norms of its inputs over the calibration batches, computed here by hand."""
    model = mlp()
    batches = [torch.randn(5, 64, device=DEVICE) for _ in range(3)]
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    inputs = {"0": torch.cat(batches)}
    with torch.no_grad():
        inputs["2"] = model[1](model[0](inputs["0"]))
        inputs["3"] = model[2](inputs["2"])
    decisions = kp_sparsity.sparsify(model, method="wanda", calibration=batches, route="dense")
    routes = {d.name: d for d in decisions}
    assert {n: d.route for n, d in routes.items()} == {"0": "dense", "2": "dense", "3": "unchanged"}
    assert "shape (8, 6)" in routes["3"].why  # 6 inputs: no groups of 4
    for name in ("0", "2"):
        scale = inputs[name].square().sum(0).sqrt()
        want = kp_sparsity.prune_2_4(weights[name], column_scale=scale)
        torch.testing.assert_close(model.get_submodule(name).weight, want, rtol=0, atol=0)


def test_bad_arguments():
    model = mlp()
    with pytest.raises(ValueError, match="method must be"):
        kp_sparsity.sparsify(model, method="random")
    with pytest.raises(ValueError, match="route must be"):
        kp_sparsity.sparsify(model, route="fast")
    with pytest.raises(ValueError, match="needs calibration"):
        kp_sparsity.sparsify(model, method="wanda")
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        kp_sparsity.SparseLinear.from_dense(nn.Conv1d(4, 4, 1))


@pytest.mark.skipif(DEVICE != "cuda", reason="2:4 matmul: GPU only")
@pytest.mark.parametrize("route", ["sparse", "auto"])
def test_sparse_route_runs_the_pruned_model(route):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(DEVICE, torch.bfloat16)
    pruned = copy.deepcopy(model)
    kp_sparsity.sparsify(pruned, route="dense")
    decisions = kp_sparsity.sparsify(model, route=route, tokens=256)
    assert all(d.route in ("sparse", "dense") for d in decisions)
    if route == "auto":
        assert all(d.dense_ms > 0 and d.sparse_ms > 0 for d in decisions)
    else:
        assert all(isinstance(m, kp_sparsity.SparseLinear) for m in (model[0], model[2]))
    x = torch.randn(64, 256, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(model(x).float(), pruned(x).float(), rtol=2e-2, atol=2e-2)
