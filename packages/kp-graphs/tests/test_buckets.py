"""The bucket logic and the padded eager path, on CPU tensors on every machine (a GPU's replay path is
test_replay.py's)."""

import warnings

import pytest
import torch

import kp_graphs
from kp_graphs.buckets import Buckets, fill_into, pad_to, trim

DEVICE = torch.device("cpu")


def test_choose_takes_the_smallest_bucket_that_holds_the_call():
    b = Buckets([8, 1, 4, 2])
    assert b.sizes == {0: (1, 2, 4, 8)}
    assert [b.choose((n,)) for n in (1, 2, 3, 5, 8, 9)] == [(1,), (2,), (4,), (8,), (8,), None]
    two = Buckets({0: [1, 4], 1: [128, 512]})
    assert two.choose((3, 129)) == (4, 512) and two.choose((5, 1)) is None and two.choose((1, 513)) is None


@pytest.mark.parametrize(
    "spec,error,words",
    [
        ("abc", TypeError, "sequence of sizes"),
        ([], ValueError, "positive ints"),
        ({}, ValueError, "names no dimension"),
        ([0, 2], ValueError, "positive ints"),
        ([2.5], ValueError, "positive ints"),
        ({-1: [2]}, ValueError, "non-negative"),
    ],
)
def test_bad_bucket_specs(spec, error, words):
    with pytest.raises(error, match=words):
        Buckets(spec)


def test_inputs_must_agree_on_bucketed_sizes():
    b = Buckets({0: [4], 1: [16]})
    x, y = torch.zeros(3, 5), torch.zeros(3, 7)
    assert b.actual([x, "not a tensor", x]) == (3, 5)
    with pytest.raises(ValueError, match="disagree on the size of bucketed dimension 1: #0 has 5, #2 has 7"):
        b.actual([x, 1.0, y])
    with pytest.raises(ValueError, match="input #1 has 1 dimension"):
        b.actual([x, torch.zeros(3)])


def test_pad_fill_and_trim_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, generator=g)
    p = pad_to(x, (0, 1), (4, 8), -7.0)
    assert p.shape == (4, 8, 2) and torch.equal(p[:3, :5], x)
    assert bool((p[3:] == -7).all()) and bool((p[:, 5:] == -7).all())
    dst = torch.full((4, 8, 2), 123.0)
    fill_into(dst, x, -7.0)
    assert torch.equal(dst, p)  # every padded element rewritten, none left from before
    assert torch.equal(trim(p, (0, 1), (4, 8), (3, 5)), x)
    # an output without the bucketed size there is returned whole
    assert trim(torch.zeros(2, 8), (0, 1), (4, 8), (3, 5)).shape == (2, 5)
    assert pad_to(x, (0,), (3,), 0) is x


def test_padded_eager_matches_the_plain_call_and_counts():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8).to(DEVICE)
    g = kp_graphs.graphed(lin, buckets=[1, 2, 4, 8], name="lin")
    with torch.no_grad():
        for n in (1, 3, 8):
            x = torch.randn(n, 16, device=DEVICE)
            out = g(x)
            assert out.shape == (n, 8)
            # what the padded call computes: the first n rows of the bucket-sized batch
            assert torch.equal(out, lin(pad_to(x, (0,), g.buckets.choose((n,)), 0))[:n])
        with pytest.warns(UserWarning, match="beyond the largest bucket"):
            big = g(torch.randn(9, 16, device=DEVICE))
        assert big.shape == (9, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            g(torch.randn(10, 16, device=DEVICE))  # warned once per reason
    s = g.stats
    assert sum(s.eager.values()) + sum(s.replays.values()) == 5 and s.calls == 5
    assert s.eager[next(r for r in s.eager if r.startswith("sizes"))] == 2
    assert "| lin | 5 |" in kp_graphs.report()


def test_pytree_inputs_and_non_tensor_arguments():
    def fn(batch, scale=1.0):
        return {"y": batch["a"] * scale + batch["b"], "n": batch["a"].shape[0]}

    g = kp_graphs.graphed(fn, buckets=[4])
    a, b = torch.ones(3, 2, device=DEVICE), torch.full((3, 2), 2.0, device=DEVICE)
    with torch.no_grad():
        out = g({"a": a, "b": b}, scale=3.0)
    assert torch.equal(out["y"], torch.full((3, 2), 5.0, device=DEVICE))
    assert out["n"] == 4  # the function saw the bucket's size: what a graph would have captured
    with pytest.raises(TypeError, match="hashable"):
        g({"a": a, "b": b}, scale={1.0})


def test_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        kp_graphs.graphed(3, buckets=[1])
    with pytest.raises(ValueError, match="warmup"):
        kp_graphs.graphed(torch.nn.Identity(), buckets=[1], warmup=0)
    with pytest.raises(TypeError, match="pad"):
        kp_graphs.graphed(torch.nn.Identity(), buckets=[1], pad="x")
    with pytest.raises(ValueError, match="at least one tensor"):
        kp_graphs.graphed(lambda n: n, buckets=[1])(3)


def test_autograd_through_the_padded_eager_path():
    """Off the GPU a training call is padded, run and cut back under autograd: the gradients are those of the
    padded computation (the padded rows get none from above)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(lin.state_dict())
    g = kp_graphs.graphed(lin, buckets=[4])
    x = torch.randn(3, 4, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    g(x).square().sum().backward()
    ref(pad_to(x_ref, (0,), (4,), 0))[:3].square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)


def test_pad_per_positional_argument():
    """Labels padded with an ignore index, inputs with 0: the function sees both, padded to the bucket."""
    seen = {}

    def fn(x, labels):
        seen["x"], seen["labels"] = x, labels
        return x

    g = kp_graphs.graphed(fn, buckets=[4], pad=(0, -100))
    with torch.no_grad():
        g(torch.ones(3, 2), torch.zeros(3, dtype=torch.long))
    assert seen["labels"].tolist() == [0, 0, 0, -100] and seen["x"][3].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="one per positional argument"):
        g(torch.ones(3, 2))
    with pytest.raises(TypeError, match="pad must be a number or a tuple"):
        kp_graphs.graphed(fn, buckets=[4], pad=(0, "x"))
