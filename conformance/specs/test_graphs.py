"""Conformance spec for kp-graphs: graphed calls against the eager call of the same function on the same
(padded) inputs, bit for bit, in every bucket; graphs never stale; clear errors.

Replay needs CUDA graphs: on CPU those cells are not covered, and the padded eager path, which shares the bucket
logic, is checked instead. Every replay cell proves the graph ran (the callable's replay count moved, no eager
call) rather than the eager fallback."""

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import kp_conformance as kc
import kp_graphs
from kp_conformance import fuzz
from kp_graphs.buckets import pad_to

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICE = kc.device()
GPU = DEVICE.type == "cuda"

kc.declare(
    kc.Spec(
        name="graphs",
        package="kp-graphs",
        ops=(),
        reference="the function itself, run eagerly on the same inputs padded to the same bucket",
        dtypes=DTYPES,
        properties=(
            "values",
            "padded_eager",
            "gradients",
            "training_step",
            "stale",
            "capture_errors",
            "decode",
            "bad_input",
        ),
        requires="CUDA graphs for replay; CPU covers the bucket logic through the padded eager path",
    )
)


def replay_or_skip():
    if not GPU:
        pytest.skip("not covered on CPU: no CUDA graphs (the padded eager path is its own cell)")


def stack(width, layers, dtype, seed):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]).to(DEVICE, dtype)


@st.composite
def cases(draw):
    sizes = sorted(draw(st.sets(st.integers(1, 24), min_size=1, max_size=4)))
    calls = draw(st.lists(st.integers(1, sizes[-1]), min_size=1, max_size=6))
    return sizes, calls, draw(st.sampled_from((16, 48))), draw(st.integers(0, 2**16))


def expected(model, x, bucket):
    """What a replay must return: the eager call on the bucket-padded batch, its first rows."""
    return model(pad_to(x, (0,), bucket, 0))[: x.shape[0]]


@pytest.mark.conformance(kernel="graphs", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(case=cases())
def test_values(dtype, case):
    replay_or_skip()
    sizes, calls, width, seed = case
    model = stack(width, 2, dtype, seed)
    g = kp_graphs.graphed(model, buckets=sizes)
    with torch.no_grad():
        for i, n in enumerate(calls):
            x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed + i)).to(DEVICE, dtype)
            before = sum(g.stats.replays.values())
            out = g(x)
            assert sum(g.stats.replays.values()) == before + 1 and not g.stats.eager, "the graph did not run"
            assert torch.equal(out, expected(model, x, g.buckets.choose((n,)))), (sizes, n)
    assert g.stats.captures == len({g.buckets.choose((n,)) for n in calls})


@pytest.mark.conformance(kernel="graphs", prop="padded_eager")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(case=cases())
def test_padded_eager(dtype, case):
    """CPU tensors run the bucket logic eagerly on every machine: padded, called, cut back."""
    sizes, calls, width, seed = case
    model = stack(width, 2, dtype, seed).cpu()
    g = kp_graphs.graphed(model, buckets=sizes)
    with torch.no_grad():
        for n in calls:
            x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed)).to(dtype)
            assert torch.equal(g(x), expected(model, x, g.buckets.choose((n,))))
    assert g.stats.eager == {"not on a CUDA device": len(calls)} and not g.stats.replays


@pytest.mark.conformance(kernel="graphs", prop="gradients")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(case=cases())
def test_gradients(dtype, case):
    """Under autograd the outputs and the gradients of the input and of every parameter equal eager autograd on
    the same padded batch, bit for bit, accumulated over the calls: through a forward and a backward graph per
    bucket on the GPU (each call a replay), through the padded eager path on CPU."""
    sizes, calls, width, seed = case
    model = stack(width, 2, dtype, seed)
    twin = copy.deepcopy(model)
    g = kp_graphs.graphed(model, buckets=sizes)
    for i, n in enumerate(calls):
        x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed + i)).to(DEVICE, dtype)
        x.requires_grad_()
        x_twin = x.detach().clone().requires_grad_()
        before = sum(g.stats.replays.values())
        out = g(x)
        if GPU:
            assert sum(g.stats.replays.values()) == before + 1 and not g.stats.eager, "the graphs did not run"
        want = twin(pad_to(x_twin, (0,), g.buckets.choose((n,)), 0))[:n]
        assert torch.equal(out, want), (sizes, n)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed - i)).to(DEVICE, dtype)
        out.backward(grad)
        want.backward(grad)
        assert torch.equal(x.grad, x_twin.grad), (sizes, n)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad), sizes


@pytest.mark.conformance(kernel="graphs", prop="training_step")
@pytest.mark.parametrize("opt", ["Adam", "AdamW"])
def test_whole_training_step(opt):
    """A whole step (zero grads, forward, masked loss, backward, a capturable optimizer's step) in one graph per
    bucket: losses, weights and optimizer state equal an eager twin's that takes the same steps on the same
    padded batches, bit for bit (a bucket's first call is its eager warmup); padded rows are masked out."""
    replay_or_skip()
    model = stack(32, 2, torch.float32, 3)
    twin = copy.deepcopy(model)
    make = getattr(torch.optim, opt)
    optims = [make(m.parameters(), lr=1e-2, capturable=True) for m in (model, twin)]

    def stepper(m, o):
        def step(x, y, mask):
            o.zero_grad(set_to_none=True)
            loss = ((m(x) - y).square() * mask).sum() / mask.sum()
            loss.backward()
            o.step()
            return loss.detach()

        return step

    g = kp_graphs.graphed(stepper(model, optims[0]), buckets=[4, 8], warmup=1, training_step=True)
    eager = stepper(twin, optims[1])
    gen = torch.Generator().manual_seed(4)
    for i, n in enumerate((3, 8, 4, 6, 1)):
        x, y = (torch.randn(n, 32, generator=gen).to(DEVICE) for _ in "xy")
        mask = torch.ones(n, 1, device=DEVICE)
        bucket = g.buckets.choose((n,))
        padded = [pad_to(t, (0,), bucket, 0) for t in (x, y, mask)]
        assert torch.equal(g(x, y, mask), eager(*padded)), i
    # each bucket's first call warmed it up eagerly, the others replayed
    assert sum(g.stats.replays.values()) == 3 and g.stats.eager == {"warming up a training step's bucket": 2}
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        for k, v in optims[0].state[p].items():
            assert torch.equal(v, optims[1].state[q][k]), k
    assert g.stats.captures == 2


@pytest.mark.conformance(kernel="graphs", prop="stale")
def test_stale_graphs_are_never_replayed():
    replay_or_skip()
    model = stack(32, 2, torch.float32, 0)
    g = kp_graphs.graphed(model, buckets=[4, 8])
    x = torch.randn(3, 32, device=DEVICE)
    with torch.no_grad():
        g(x)
        model[0][0].weight = nn.Parameter(torch.randn(32, 32, device=DEVICE))  # replaced
        assert torch.equal(g(x), expected(model, x, (4,)))
        model[1][0].weight.data = torch.randn(32, 32, device=DEVICE)  # new storage
        assert torch.equal(g(x), expected(model, x, (4,)))
        model[1][0].bias.add_(1.0)  # in place: the graph reads it
        assert torch.equal(g(x), expected(model, x, (4,)))
    assert g.stats.invalidations == 2 and g.stats.captures == 3


@pytest.mark.conformance(kernel="graphs", prop="capture_errors")
@pytest.mark.parametrize("what", ["item", "nonzero"])
def test_capture_unsafe_functions_get_a_clear_error(what):
    replay_or_skip()
    fn = {"item": lambda x: x * x.sum().item(), "nonzero": lambda x: x[torch.nonzero(x[:, 0] > 0)[:, 0]]}[what]
    g = kp_graphs.graphed(fn, buckets=[4])
    with torch.no_grad(), pytest.raises(kp_graphs.CaptureError, match="synchronisation"):
        g(torch.randn(4, 8, device=DEVICE))
    torch.cuda.synchronize()
    assert (torch.ones(3, device=DEVICE) * 2).sum().item() == 6  # the device still works
    torch.randn(4, device=DEVICE)  # and its random numbers (a failed capture must not leave them in capture)
    h = kp_graphs.graphed(lambda x: x * 2, buckets=[4])  # and the next capture
    with torch.no_grad():
        assert torch.equal(h(torch.ones(4, 8, device=DEVICE)), torch.full((4, 8), 2.0, device=DEVICE))
    assert h.stats.captures == 1


class _Decode:
    """One attention decoding step over a static KV cache with kp-attention's kvcache kernel: q, k, v (n, 1, H, D)
    of sequences 0..n-1; the new keys and values are written into the cache in place at `lengths`."""

    def __init__(self, paged, seed):
        g = torch.Generator().manual_seed(seed)
        self.batch, self.len, self.page = 8, 256, 16
        shape = (self.batch * self.len // self.page, self.page, 2, 64) if paged else (self.batch, self.len, 2, 64)
        self.k = torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16)
        self.v = torch.randn(shape, generator=g).to(DEVICE, torch.bfloat16)
        order = torch.randperm(self.batch * self.len // self.page, generator=g).int()
        self.table = order.view(self.batch, -1).to(DEVICE) if paged else None
        self.lengths = torch.randint(8, 64, (self.batch,), generator=g, dtype=torch.int32).to(DEVICE)
        self.paged = paged

    def __call__(self, q, k, v):
        import kp_attention

        n = q.shape[0]
        kc, vc = (self.k, self.v) if self.paged else (self.k[:n], self.v[:n])
        table = self.table[:n] if self.paged else None
        lengths = self.lengths[:n]
        return kp_attention.flash_attention_with_kvcache(q, kc, vc, lengths, k=k, v=v, block_table=table)


@pytest.mark.conformance(kernel="graphs", prop="decode")
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_decode_loop_with_a_kv_cache(paged):
    """A decode loop through graphed: batches that change every step, cache lengths that grow; each replay equals
    the eager step on the same padded batch bit for bit, and so does the cache it writes."""
    replay_or_skip()
    step, twin = _Decode(paged, 0), _Decode(paged, 0)
    g = kp_graphs.graphed(step, buckets=[2, 4, 8])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n in (3, 8, 1, 2, 5, 8, 4, 7):
            q, k, v = (torch.randn(n, 1, h, 64, generator=gen).to(DEVICE, torch.bfloat16) for h in (4, 2, 2))
            bucket = g.buckets.choose((n,))
            before = sum(g.stats.replays.values())
            out = g(q, k, v)
            assert sum(g.stats.replays.values()) == before + 1 and not g.stats.eager, "the graph did not run"
            want = twin(*(pad_to(t, (0,), bucket, 0) for t in (q, k, v)))[:n]
            assert torch.equal(out, want), n
            assert torch.equal(step.k, twin.k) and torch.equal(step.v, twin.v), n
            for d in (step, twin):
                d.lengths[:n] += 1
    assert g.stats.captures == 3


BAD_INPUTS = [  # a call's own check, which no argument domain below derives
    (
        "inputs disagree",
        lambda: kp_graphs.graphed(nn.Identity(), buckets=[2])(torch.zeros(2, 3), torch.zeros(3, 3)),
        ValueError,
        "disagree",
    ),
]
test_bad_input = kc.bad_input_test("graphs", BAD_INPUTS)

FUZZ_TARGETS = [
    fuzz.Target(
        "kp_graphs.graphed",
        "kp-graphs",
        kp_graphs.graphed,
        lambda d: dict(fn=nn.Identity(), buckets=[2, 8], pad=0, warmup=3, name="identity"),
        dict(
            fn=fuzz.Scalar(bad=(None, 3)),
            buckets=fuzz.Scalar(bad=("x", [0], [-2], [2.5], [], None)),
            warmup=fuzz.Scalar(bad=(0, -1, 1.5, "3")),
            copy_outputs=fuzz.Scalar(bad=(1, None)),
            training_step=fuzz.Scalar(bad=(1, "yes")),
        ),
        launches=False,
    ),
]
test_bad_input_fuzz = kc.fuzz_test("graphs", FUZZ_TARGETS)
