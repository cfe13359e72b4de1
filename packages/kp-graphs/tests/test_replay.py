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
    # each bucket's first call captured its graph, later calls found it
    assert g.stats.bucket_hit_rates() == {(1,): 0.0, (2,): 0.0, (4,): 0.5, (8,): 0.5, (16,): 0.5}


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
        model[1] = nn.Linear(256, 256).cuda()  # a submodule swapped
        assert torch.equal(g(x), model(x))
        nn.Linear(8, 8)  # a module made elsewhere: the check looks again and finds this one unchanged
        assert torch.equal(g(x), model(x))
        model.double()  # a dtype change: every parameter gets new storage
        assert torch.equal(g(x.double()), model(x.double()))
    assert g.stats.invalidations == 4 and g.stats.captures == 5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_inputs_on_another_gpu_are_captured_and_replayed_there():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU()).to("cuda:1")
    g = kp_graphs.graphed(model, buckets=[4])
    with torch.no_grad(), torch.cuda.device(0):
        for n in (3, 4, 2):
            x = torch.randn(n, 64, device="cuda:1")
            out = g(x)
            assert out.device == x.device and torch.equal(out, model(pad_to(x, (0,), (4,), 0))[:n])
    assert g.stats.captures == 1 and sum(g.stats.replays.values()) == 3


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


def _print_and_double(x):
    print(x)  # copies x to the host
    return x * 2


_GEN = []


def _noise(x):
    """Random numbers from a generator of its own, which no graph registered."""
    if not _GEN:
        _GEN.append(torch.Generator(device="cuda").manual_seed(0))
    return x + torch.randn(x.shape, device=x.device, generator=_GEN[0])


def _other_stream(x):
    side = torch.cuda.Stream()  # not forked from the capture stream: its work is outside the graph
    with torch.cuda.stream(side):
        return x * 2


_KEPT = []


def _keeps(x):
    _KEPT.append(x + 1)  # made during capture and kept: it would live in the pool, unknown to the graph
    return x * 2


@pytest.mark.parametrize(
    "fn,words",
    [
        (lambda x: x * x.sum().item(), r"host synchronisation.*test_replay.py:\d+: .*item\(\)"),
        (lambda x: x[torch.nonzero(x > 0)[:, 0]].sum(0, keepdim=True).expand_as(x), r"synchronisation.*nonzero"),
        (_print_and_double, r"synchronisation.*print\(x\)"),
        (_noise, "generator"),
        (_other_stream, "stream"),
        (_keeps, r"keeps \d+ bytes allocated during capture"),
    ],
    ids=["item", "nonzero", "print", "generator", "other stream", "kept allocation"],
)
def test_capture_unsafe_functions_get_a_clear_error(fn, words):
    g = kp_graphs.graphed(fn, buckets=[4])
    with torch.no_grad(), pytest.raises(kp_graphs.CaptureError, match=words):
        g(torch.randn(4, 8, device="cuda"))
    # the process is usable afterwards: the device, its random numbers, its allocator and the next capture
    torch.cuda.synchronize()
    assert torch.equal(torch.ones(2, device="cuda") + 1, torch.full((2,), 2.0, device="cuda"))
    torch.randn(8, device="cuda").sum().item()
    model = mlp(layers=2)
    h = kp_graphs.graphed(model, buckets=[4])
    with torch.no_grad():
        x = torch.randn(4, 256, device="cuda")
        assert torch.equal(h(x), model(x)) and torch.equal(h(x + 1), model(x + 1))
    assert h.stats.captures == 1 and sum(h.stats.replays.values()) == 2


def test_a_cpu_tensor_among_cuda_inputs_runs_eagerly():
    g = kp_graphs.graphed(lambda x, w: x * w.to(x.device), buckets=[4])
    with torch.no_grad(), pytest.warns(UserWarning, match="CPU tensor among CUDA inputs"):
        out = g(torch.ones(3, 2, device="cuda"), torch.full((3, 2), 2.0))
    assert torch.equal(out, torch.full((3, 2), 2.0, device="cuda"))
    assert g.stats.eager == {"a CPU tensor among CUDA inputs": 1} and not g.stats.captures


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


def test_training_capture_with_an_earlier_forward_still_alive():
    """An eager forward whose autograd graph is still alive (a loss kept for logging) made the parameters'
    gradient nodes on the default stream; the captured backward must not follow them there (it did: the graph
    came out empty and the replayed gradients stale)."""
    model = mlp(layers=3, width=128)
    ref = train_copy(model)
    kept = model(torch.randn(4, 128, device="cuda")).sum()  # alive through the capture below
    g = kp_graphs.graphed(model, buckets=[4])
    for step in range(3):
        x = torch.randn(4, 128, device="cuda")
        for p in (*model.parameters(), *ref.parameters()):
            p.grad = None
        out, want = g(x), ref(x)
        assert torch.equal(out, want), step
        out.sum().backward()
        want.sum().backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), step
    assert g.stats.captures == 1 and not g.stats.eager and kept.grad_fn is not None


def test_training_refuses_a_parameter_read_through_a_kept_reference():
    """The graphs differentiate with respect to aliases swapped in for the module's registered parameters; a
    parameter read through a reference kept elsewhere would get no gradient, so the capture refuses it."""

    class Kept(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(64, 64, device="cuda")
            self.kept = [self.lin.weight]  # a plain list: not a registration functional_call can swap

        def forward(self, x):
            return self.lin(x) + x @ self.kept[0]

    g = kp_graphs.graphed(Kept(), buckets=[4])
    with pytest.raises(ValueError, match=r"lin\.weight other than as the module's attributes"):
        g(torch.randn(4, 64, device="cuda"))


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


def _whole_step(model, opt, scaler=None):
    """One training step as a user writes it: zero the gradients, forward, loss, backward, optimizer step."""

    def step(x, labels):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.float16, enabled=scaler is not None, cache_enabled=False):
            loss = nn.functional.cross_entropy(model(x).float(), labels, ignore_index=-100)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss

    return step


@pytest.mark.parametrize("amp", [False, True], ids=["fp32 Adam", "fp16 autocast + GradScaler, fused Adam"])
def test_a_whole_training_step_equals_eager_bit_for_bit(amp):
    """Forward, backward and a capturable optimizer's step in one graph per bucket: the losses, weights and
    optimizer state equal an eager twin's that takes the same steps on the same padded batches (a bucket's first
    call is its warmup, run eagerly; its second captures), whose padded labels the loss ignores."""
    model = mlp(layers=3, width=64)
    twin = train_copy(model)
    kw = dict(lr=1e-2, capturable=True, fused=amp or None)
    opt, opt_twin = torch.optim.Adam(model.parameters(), **kw), torch.optim.Adam(twin.parameters(), **kw)
    scalers = (torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")) if amp else (None, None)
    g = kp_graphs.graphed(
        _whole_step(model, opt, scalers[0]), buckets=[4, 8], pad=(0, -100), warmup=1, training_step=True
    )
    eager = _whole_step(twin, opt_twin, scalers[1])
    for i, n in enumerate((3, 8, 3, 5, 8)):
        x, labels = torch.randn(n, 64, device="cuda"), torch.randint(0, 64, (n,), device="cuda")
        bucket = (g.buckets.choose((n,))[0],)
        xp, lp = pad_to(x, (0,), bucket, 0), pad_to(labels, (0,), bucket, -100)
        assert torch.equal(g(x, labels), eager(xp, lp)), i
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        for k, v in opt.state[p].items():
            assert torch.equal(v, opt_twin.state[q][k]), k
    assert g.stats.captures == 2 and sum(g.stats.replays.values()) == 3
    assert g.stats.eager == {"warming up a training step's bucket": 2}
    if amp:
        assert scalers[0].get_scale() == scalers[1].get_scale()  # .item(): after the loop, outside any capture


def test_a_non_capturable_optimizer_is_named():
    model = mlp(layers=1, width=16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # capturable=False
    g = kp_graphs.graphed(_whole_step(model, opt), buckets=[4], pad=(0, -100), warmup=1, training_step=True)
    x, labels = torch.randn(4, 16, device="cuda"), torch.randint(0, 16, (4,), device="cuda")
    g(x, labels)  # the bucket's warmup: an eager step
    with pytest.raises(kp_graphs.CaptureError, match="capturable=True"):
        g(x, labels)  # its capture
