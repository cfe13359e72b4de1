"""Conformance spec for kp-graphs: graphed calls against the eager call of the same function on the same
(padded) inputs, bit for bit, in every bucket; graphs never stale; clear errors.

Replay needs CUDA graphs: on CPU those cells are not covered, and the padded eager path, which shares the bucket
logic, is checked instead. Every replay cell proves the graph ran (the callable's replay count moved, no eager
call) rather than the eager fallback."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import kp_conformance as kc
import kp_graphs
from kp_graphs.buckets import pad_to

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEVICE = kc.device()
GPU = DEVICE.type == "cuda"

kc.declare(
    kc.Spec(
        name="graphs",
        ops=(),
        reference="the function itself, run eagerly on the same inputs padded to the same bucket",
        dtypes=DTYPES,
        properties=("values", "padded_eager", "stale", "capture_errors", "bad_input"),
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


@pytest.mark.conformance(kernel="graphs", prop="bad_input")
@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda: kp_graphs.graphed(nn.Identity(), buckets="x"), TypeError, "sequence of sizes"),
        (lambda: kp_graphs.graphed(nn.Identity(), buckets=[0]), ValueError, "positive ints"),
        (lambda: kp_graphs.graphed(nn.Identity(), buckets=[2], warmup=0), ValueError, "warmup"),
        (
            lambda: kp_graphs.graphed(nn.Identity(), buckets=[2])(torch.zeros(2, 3), torch.zeros(3, 3)),
            ValueError,
            "disagree",
        ),
    ],
    ids=["buckets type", "bucket size", "warmup", "inputs disagree"],
)
def test_bad_input(call, error, words):
    with pytest.raises(error, match=words):
        call()
