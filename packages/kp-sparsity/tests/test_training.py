"""Sparse training: SparseTrainingLinear's gradients against a float64 masked-dense computation, the mask
schedule, fixed masks staying 2:4 through an optimizer, accuracy of sparse fine-tuning on a small model trained
here, torch.compile, and (GPU) the sparse-tensor-core route against the dense one. Tensors live on the device
under test."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kp_core
import kp_sparsity
from kp_sparsity.ops import prune as prune_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = "interpret" if kp_core.interpreter_enabled() else kp_core.TRITON


def is_transposable_2_4(mask):
    m, k = mask.shape
    return bool((mask.view(m, k // 4, 4).sum(-1) == 2).all() and (mask.t().reshape(k, m // 4, 4).sum(-1) == 2).all())


def expected_grads(layer, x, dy):
    """float64 (dx, dW, db): dx = dy W_s, dW = dy^T x straight through (+ decay * (W - W_s)), or masked when the
    mask is fixed; W_s = W * mask."""
    mask, w = layer.mask, layer.weight.detach().double()
    w_s = (w * mask).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    F.linear(x64, w_s, layer.bias.detach().double()).backward(dy.double())
    dw = w_s.grad * mask if layer.mask_every is None else w_s.grad + layer.decay * w * ~mask
    return x64.grad, dw, dy.double().reshape(-1, dy.shape[-1]).sum(0)


@pytest.mark.parametrize("mask_every", [1, None], ids=["sr_ste", "fixed"])
def test_gradients_match_the_masked_dense_computation(mask_every):
    torch.manual_seed(0)
    layer = kp_sparsity.SparseTrainingLinear(32, 24, device=DEVICE, mask_every=mask_every, decay=0.05)
    assert is_transposable_2_4(layer.mask)
    if mask_every is None:
        assert not layer.weight[~layer.mask].any()  # pruned in place
    x = torch.randn(2, 5, 32, device=DEVICE, requires_grad=True)
    dy = torch.randn(2, 5, 24, device=DEVICE)
    y = layer(x)
    w_s = layer.weight.detach() * layer.mask
    torch.testing.assert_close(y, F.linear(x.detach(), w_s, layer.bias.detach()))
    y.backward(dy)
    for got, want in zip((x.grad, layer.weight.grad, layer.bias.grad), expected_grads(layer, x, dy)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad[~layer.mask].abs().sum() > 0 if mask_every else True


def test_mask_is_recomputed_every_k_training_forwards():
    torch.manual_seed(0)
    layer = kp_sparsity.SparseTrainingLinear(16, 8, device=DEVICE, mask_every=2)
    seen = []
    with kp_core.record_launches() as rec:
        for _ in range(5):
            with torch.no_grad():
                layer.weight.copy_(torch.randn_like(layer.weight))  # as if the optimizer had moved it
            layer(torch.randn(3, 16, device=DEVICE)).sum().backward()
            seen.append(layer.mask.clone())
        layer.eval()
        layer(torch.randn(3, 16, device=DEVICE))
    # made at step 0, recomputed before the forwards of steps 2 and 4; none in eval
    assert rec.count(prune_mod.OP_T) == 2 and rec.backends(prune_mod.OP_T) == {KERNEL}
    assert torch.equal(seen[0], seen[1]) and torch.equal(seen[2], seen[3])
    assert not torch.equal(seen[1], seen[2]) and not torch.equal(seen[3], seen[4])
    want = kp_sparsity.mask_2_4(layer.weight.detach(), transposable=True)
    assert all(is_transposable_2_4(m) for m in seen) and torch.equal(want, seen[4])  # from the weight it saw


def test_fixed_mask_stays_through_adamw_and_the_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(DEVICE)
    decisions = kp_sparsity.sparsify_for_training(model, mask_every=None, route="dense")
    assert [d.route for d in decisions] == ["dense", "dense"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    masks = [model[0].mask.clone(), model[2].mask.clone()]
    for _ in range(3):
        model(torch.randn(4, 16, device=DEVICE)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for layer, mask in zip((model[0], model[2]), masks):
        assert torch.equal(layer.mask, mask) and not layer.weight[~mask].any()
    state = model.state_dict()
    assert torch.equal(state["0.mask"], masks[0])


def make_task(seed=0):
    """A teacher MLP's outputs on random inputs: the small model below learns them."""
    g = torch.Generator().manual_seed(seed)
    teacher = [torch.randn(64, 32, generator=g) / 32**0.5, torch.randn(16, 64, generator=g) / 8]
    x = torch.randn(2048, 32, generator=g)
    y = torch.tanh(x @ teacher[0].t()) @ teacher[1].t()
    return x.to(DEVICE), y.to(DEVICE)


def train(model, x, y, steps, lr=3e-3):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for i in range(steps):
        rows = slice((i * 256) % 2048, (i * 256) % 2048 + 256)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        return F.mse_loss(model(x), y).item()


def test_sparse_fine_tuning_recovers_what_one_shot_pruning_loses():
    """A dense student trained here; pruned one shot to 2:4 its loss rises; sparse fine-tuning (fixed mask, masked
    gradients) brings it back below half-way to dense; the same steps of dense training are the fair baseline."""
    x, y = make_task()
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 16)).to(DEVICE)
    train(dense, x, y, 300)
    one_shot = copy.deepcopy(dense)
    kp_sparsity.sparsify(one_shot, route="dense")
    tuned = copy.deepcopy(dense)
    kp_sparsity.sparsify_for_training(tuned, mask_every=None, route="dense")
    with torch.no_grad():
        losses = {"one_shot": F.mse_loss(one_shot(x), y).item()}
    losses["dense"] = train(dense, x, y, 100)
    losses["fine_tuned"] = train(tuned, x, y, 100)
    for m in (tuned[0], tuned[2], tuned[4]):
        assert is_transposable_2_4(m.mask) and not m.weight[~m.mask].any()
    assert losses["fine_tuned"] < losses["one_shot"] - (losses["one_shot"] - losses["dense"]) / 2, losses


def test_sr_ste_from_scratch_learns():
    """2:4 training from scratch (mask every step, SR-STE decay) learns the task: its loss falls well below the
    untrained model's."""
    x, y = make_task()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 16)).to(DEVICE)
    with torch.no_grad():
        start = F.mse_loss(model(x), y).item()
    kp_sparsity.sparsify_for_training(model, mask_every=1, route="dense")
    assert train(model, x, y, 60) < start / 3


def test_compile_fixed_mask_equals_eager():
    torch.manual_seed(0)
    layer = kp_sparsity.SparseTrainingLinear(32, 16, device=DEVICE, mask_every=None)
    x = torch.randn(8, 32, device=DEVICE, requires_grad=True)
    eager = layer(x)
    eager.sum().backward()
    want = (x.grad.clone(), layer.weight.grad.clone())
    x.grad = layer.weight.grad = layer.bias.grad = None
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    got = compiled(x)
    got.sum().backward()
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close((x.grad, layer.weight.grad), want)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mask_every must be"):
        kp_sparsity.SparseTrainingLinear(8, 8, mask_every=0)
    with pytest.raises(ValueError, match="decay must be"):
        kp_sparsity.SparseTrainingLinear(8, 8, decay=-1.0)
    with pytest.raises(ValueError, match=r"multiples of 4, got weight of shape \(6, 8\)"):
        kp_sparsity.SparseTrainingLinear(8, 6)
    with pytest.raises(TypeError, match="must be an nn.Linear"):
        kp_sparsity.SparseTrainingLinear.from_dense(nn.Conv1d(4, 4, 1))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 6))
    with pytest.raises(ValueError, match="route must be"):
        kp_sparsity.sparsify_for_training(model, route="fast")
    with pytest.raises(ValueError, match="cannot run 2:4"):
        kp_sparsity.sparsify_for_training(model, route="sparse")
    decisions = kp_sparsity.sparsify_for_training(model, route="auto")
    assert [d.route for d in decisions] == ["dense", "unchanged"]
    assert "multiples of 4" in decisions[1].why and decisions[0].why


@pytest.mark.skipif(DEVICE != "cuda", reason="2:4 sparse tensor cores: GPU only")
@pytest.mark.parametrize("mask_every", [1, None], ids=["sr_ste", "fixed"])
def test_sparse_route_matches_the_float64_computation(mask_every):
    """bf16 on sparse tensor cores (cuSPARSELt, both matmuls that read W_s) against float64, within twice the
    error of the same layer through bf16 dense matmuls (plus 1e-3)."""
    torch.manual_seed(0)
    layer = kp_sparsity.SparseTrainingLinear(512, 256, device=DEVICE, dtype=torch.bfloat16, mask_every=mask_every)
    x = torch.randn(4, 64, 512, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(4, 64, 256, device=DEVICE, dtype=torch.bfloat16)
    results = {}
    for route in ("sparse", "dense"):
        layer.route = route
        layer.weight.grad = layer.bias.grad = None
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        results[route] = (y, xi.grad, layer.weight.grad, layer.bias.grad)
    w_s = layer.weight.detach().double() * layer.mask
    want_y = F.linear(x.double(), w_s, layer.bias.detach().double())
    want = (want_y, *expected_grads(layer, x, dy))
    for name, s, d, w in zip(("y", "dx", "dW", "db"), results["sparse"], results["dense"], want):
        err_s, err_d = (s.double() - w).abs().max().item(), (d.double() - w).abs().max().item()
        assert err_s <= 2 * err_d + 1e-3, (name, err_s, err_d)


@pytest.mark.skipif(DEVICE != "cuda", reason="2:4 sparse tensor cores: GPU only")
def test_autocast_fp32_weights_train_through_the_sparse_route():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(DEVICE)
    ref = copy.deepcopy(model)
    decisions = kp_sparsity.sparsify_for_training(model, route="sparse", mask_every=None)
    kp_sparsity.sparsify_for_training(ref, route="dense", mask_every=None)
    assert [d.route for d in decisions] == ["sparse", "sparse"]
    x = torch.randn(128, 256, device=DEVICE)
    for m in (model, ref):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            m(x).float().square().mean().backward()
    assert model[0].weight.grad.dtype == torch.float32
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=5e-2, atol=5e-3)


@pytest.mark.skipif(DEVICE != "cuda", reason="the router times GPU matmuls")
def test_auto_route_picks_one_route_for_the_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.Linear(256, 6)).to(
        DEVICE, torch.bfloat16
    )
    decisions = kp_sparsity.sparsify_for_training(model, route="auto", tokens=512)
    timed = decisions[:2]
    assert all(d.dense_ms > 0 and d.sparse_ms > 0 for d in timed)
    assert len({d.route for d in timed}) == 1 and model[0].route == model[2].route == timed[0].route
    want = "sparse" if sum(d.sparse_ms for d in timed) < sum(d.dense_ms for d in timed) else "dense"
    assert timed[0].route == want and decisions[2].route == "unchanged"  # 6 outputs: no 4 x 4 blocks
