"""Graph capture and replay on a GPU: bit for bit equal to eager, never stale, clear errors. Not covered on
CPU (no CUDA graphs there): these tests skip, and the CPU run covers the bucket logic (test_buckets.py)."""

import pytest
import torch
from torch import nn

import kp_graphs
from kp_graphs.buckets import pad_to

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="graph replay: not covered on CPU")


def mlp(layers=8, width=256, dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_equals_eager_bit_for_bit_in_every_bucket(dtype):
    model = mlp(dtype=dtype)
    g = kp_graphs.graphed(model, buckets=[1, 2, 4, 8, 16])
    with torch.no_grad():
        for n in (1, 2, 3, 4, 5, 8, 13, 16):
            x = torch.randn(n, 256, device="cuda", dtype=dtype)
            # eager on the same padded batch: rows do not mix, so the first n rows are the reference
            assert torch.equal(g(x), model(pad_to(x, (0,), g.buckets.choose((n,)), 0))[:n]), n
    assert g.stats.captures == 5 and sum(g.stats.replays.values()) == 8 and not g.stats.eager


def test_outputs_are_not_overwritten_by_the_next_replay():
    model = mlp(layers=2)
    g = kp_graphs.graphed(model, buckets=[4])
    with torch.no_grad():
        a = g(torch.ones(4, 256, device="cuda"))
        kept = a.clone()
        g(torch.zeros(4, 256, device="cuda"))
    assert torch.equal(a, kept)


def captured(model):
    """model graphed at one bucket, its graph captured by a first call (under no_grad); (graphed, that input)."""
    g = kp_graphs.graphed(model, buckets=[4])
    x = torch.randn(4, 256, device="cuda")
    g(x)
    return g, x


def test_a_replaced_or_resized_parameter_recaptures():
    model = mlp(layers=2)
    with torch.no_grad():
        g, x = captured(model)
        model[0].weight = nn.Parameter(torch.randn(256, 256, device="cuda"))
        assert torch.equal(g(x), model(x))
        model[1].bias.data = torch.randn(256, device="cuda")  # new storage behind the same parameter
        assert torch.equal(g(x), model(x))
    assert g.stats.invalidations == 2 and g.stats.captures == 3


def test_in_place_updates_are_seen_without_recapture():
    model = mlp(layers=2)
    with torch.no_grad():
        g, x = captured(model)
        model[0].weight.mul_(0.5)  # an optimiser step: same storage, the graph reads the new values
        assert torch.equal(g(x), model(x))
    assert g.stats.captures == 1 and g.stats.invalidations == 0


def test_a_new_dtype_is_a_new_graph():
    g = kp_graphs.graphed(lambda x: x * 2 + 1, buckets=[8])
    with torch.no_grad():
        for dtype in (torch.float32, torch.float16, torch.float32):
            x = torch.randn(5, 3, device="cuda").to(dtype)
            out = g(x)
            assert out.dtype == dtype and torch.equal(out, x * 2 + 1)
    assert g.stats.captures == 2


@pytest.mark.parametrize(
    "fn,words",
    [
        (lambda x: x * x.sum().item(), "host synchronisation"),
        (lambda x: x[torch.nonzero(x > 0)[:, 0]].sum(0, keepdim=True).expand_as(x), "synchronisation"),
    ],
)
def test_capture_unsafe_functions_get_a_clear_error(fn, words):
    g = kp_graphs.graphed(fn, buckets=[4])
    with torch.no_grad(), pytest.raises(kp_graphs.CaptureError, match=words):
        g(torch.randn(4, 8, device="cuda"))
    torch.cuda.synchronize()  # the device is usable afterwards
    assert torch.equal(torch.ones(2, device="cuda") + 1, torch.full((2,), 2.0, device="cuda"))


def test_capture_all_shares_one_pool_largest_first():
    model = mlp(layers=4, width=512)
    g = kp_graphs.graphed(model, buckets=[1, 8, 64])
    with torch.no_grad():
        g.capture_all(torch.randn(1, 512, device="cuda"))
        assert g.stats.captures == 3
        for n in (1, 7, 64):
            x = torch.randn(n, 512, device="cuda")
            assert torch.equal(g(x), model(pad_to(x, (0,), g.buckets.choose((n,)), 0))[:n])
    assert g.stats.captures == 3


def train_copy(model):
    import copy

    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.grad = None
    return twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_replays_forward_and_backward_graphs(dtype):
    """Gradients through the graphs equal eager autograd on the same padded batch, bit for bit, for the input
    and every parameter, over several steps and buckets (the graphs' buffers reused between calls)."""
    model = mlp(layers=3, width=128, dtype=dtype)
    ref = train_copy(model)
    g = kp_graphs.graphed(model, buckets=[2, 4, 8])
    for step, n in enumerate((3, 8, 1, 3)):
        x = torch.randn(n, 128, device="cuda", dtype=dtype, generator=None).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        bucket = g.buckets.choose((n,))[0]
        out = g(x)
        want = ref(pad_to(x_ref, (0,), (bucket,), 0))[:n]
        assert torch.equal(out, want), step
        grad = torch.randn_like(out)
        out.backward(grad)
        want.backward(grad)
        assert torch.equal(x.grad, x_ref.grad), step
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), step  # accumulated over the steps, as eager
    assert g.stats.captures == 3 and not g.stats.eager


def test_a_training_step_with_an_optimizer_matches_eager():
    model = mlp(layers=2, width=64)
    ref = train_copy(model)
    g = kp_graphs.graphed(model, buckets=[4])
    opt, opt_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for _ in range(3):
        x = torch.randn(4, 64, device="cuda")
        for fn, o in ((g, opt), (ref, opt_ref)):
            o.zero_grad(set_to_none=True)
            fn(x).square().mean().backward()
            o.step()  # in place: the graphs read the new weights
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert g.stats.captures == 1 and g.stats.invalidations == 0


def test_a_second_forward_before_the_backward_runs_eagerly():
    """The graphs hold one step's activations: a second forward of the bucket while the first output still
    awaits its backward must not overwrite them."""
    model = mlp(layers=2, width=64)
    ref = train_copy(model)
    g = kp_graphs.graphed(model, buckets=[4])
    x1, x2 = torch.randn(4, 64, device="cuda"), torch.randn(4, 64, device="cuda")
    y1 = g(x1)
    with pytest.warns(UserWarning, match="previous backward has not run"):
        y2 = g(x2)
    (y1.sum() + y2.sum()).backward()
    (ref(x1).sum() + ref(x2).sum()).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)  # summed in another order than eager's
    del y1, y2
    g(x1).sum().backward()  # no output pending: replayed again
    assert sum(g.stats.replays.values()) == 2
