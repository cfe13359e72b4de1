"""kp-losses' own tests of cross_entropy: the kernels run and match torch in float64 for every option and layout,
the edge cases torch defines, bad input, compile and opcheck. Numerics over vocabularies and dtypes against the
2x rule live in conformance/specs/test_cross_entropy.py."""

import pytest
import torch
import torch.nn.functional as F

import kp_core
import kp_losses
from kp_losses import functional
from kp_losses.ops import cross_entropy as ce

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON
F64 = dict(device=DEVICE, dtype=torch.float64)


def logits_and_target(n=9, c=700, seed=0, ignored=(2,)):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(n, c, generator=g, dtype=torch.float64)).to(DEVICE)
    t = torch.randint(0, c, (n,), generator=g).to(DEVICE)
    t[list(ignored)] = -100
    return x, t


def loss_and_grad(fn, x, *args, **kwargs):
    x = x.detach().requires_grad_()
    loss = fn(x, *args, **kwargs)
    grad = torch.randn(loss.shape, generator=torch.Generator().manual_seed(7), dtype=loss.dtype).to(DEVICE)
    loss.backward(grad)
    return loss.detach(), x.grad


OPTIONS = [
    {},
    {"weight": "w"},
    {"label_smoothing": 0.2},
    {"weight": "w", "label_smoothing": 0.3},
    {"reduction": "sum"},
    {"reduction": "none", "weight": "w", "label_smoothing": 0.1},
    {"ignore_index": 5},
]


@pytest.mark.parametrize("options", OPTIONS, ids=[",".join(o) or "plain" for o in OPTIONS])
def test_runs_both_kernels_and_matches_torch(options):
    x, t = logits_and_target()
    t[t == -100] = options.get("ignore_index", -100)
    w = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    kw = {k: (w if v == "w" else v) for k, v in options.items()}
    with kp_core.record_launches() as rec:
        ours = loss_and_grad(kp_losses.cross_entropy, x, t, **kw)
    assert rec.backends(ce.OP) == {KERNEL} and rec.backends(ce.OP_BWD) == {KERNEL}
    for a, b in zip(ours, loss_and_grad(F.cross_entropy, x, t, **kw)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("shape", [(11,), (4, 11), (3, 11, 5), (2, 11, 3, 2)], ids=str)
def test_input_layouts_as_torch(shape):
    """(C,), (N, C) and (N, C, d...) logits, as F.cross_entropy reads them (classes in dim 1)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(DEVICE)
    tshape = () if len(shape) == 1 else (shape[0], *shape[2:])
    t = torch.randint(0, 11, tshape, generator=g).to(DEVICE)
    for reduction in ("mean", "none"):
        ours = loss_and_grad(kp_losses.cross_entropy, x, t, reduction=reduction)
        for a, b in zip(ours, loss_and_grad(F.cross_entropy, x, t, reduction=reduction)):
            torch.testing.assert_close(a, b)


def test_strided_logits_are_read_in_place():
    """A row-strided view (every other row) and a column-sliced one (vocabulary padding cut off)."""
    x, t = logits_and_target(n=10, c=300)
    for view in (x[::2], x[:, :250]):
        tt = t[: view.shape[0]].clamp(max=249)
        for a, b in zip(loss_and_grad(kp_losses.cross_entropy, view, tt), loss_and_grad(F.cross_entropy, view, tt)):
            torch.testing.assert_close(a, b)


def test_z_loss_and_softcap_by_their_formulas():
    x, t = logits_and_target(c=333)
    counted = t != -100

    def theirs(x, t):
        z = 30.0 * torch.tanh(x / 30.0)
        lse = torch.logsumexp(z, 1)
        rows = F.cross_entropy(z, t, reduction="none") + 1e-3 * lse * lse * counted
        return rows.sum() / counted.sum()

    ours = loss_and_grad(kp_losses.cross_entropy, x, t, z_loss=1e-3, softcap=30.0)
    for a, b in zip(ours, loss_and_grad(theirs, x, t)):
        torch.testing.assert_close(a, b)


def test_every_row_ignored_gives_torchs_nan_and_zero_gradients():
    x, t = logits_and_target(n=4, ignored=range(4))
    ours = loss_and_grad(kp_losses.cross_entropy, x, t, label_smoothing=0.1)
    theirs = loss_and_grad(F.cross_entropy, x, t, label_smoothing=0.1)
    assert ours[0].isnan() and theirs[0].isnan()
    assert torch.equal(ours[1], theirs[1]) and not ours[1].any()


def test_minus_inf_logits_are_probability_zero():
    """A vocabulary masked with -inf (a first slice all -inf too) gives torch's finite loss and zero gradient there."""
    x, t = logits_and_target(n=3, c=600, ignored=())
    x[:, :300] = float("-inf")
    t = t.clamp(min=300)
    ours = loss_and_grad(kp_losses.cross_entropy, x, t)
    theirs = loss_and_grad(F.cross_entropy, x, t)
    assert ours[0].isfinite()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


def test_input_and_target_are_not_mutated():
    x, t = logits_and_target()
    x0, t0 = x.clone(), t.clone()
    loss_and_grad(kp_losses.cross_entropy, x, t, label_smoothing=0.1)
    assert torch.equal(x, x0) and torch.equal(t, t0)


def test_target_dtypes_int32_and_uint8():
    x, t = logits_and_target(c=200, ignored=())
    want = F.cross_entropy(x, t)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        torch.testing.assert_close(kp_losses.cross_entropy(x, t.to(dtype)), want)


def test_target_out_of_range_raises_or_is_nan(monkeypatch):
    monkeypatch.setattr(functional, "VALIDATE_TARGETS", "sync")  # at the call, on a GPU too
    x, t = logits_and_target(c=50, ignored=())
    t[3] = 50
    with pytest.raises(ValueError, match="target holds 50, outside \\[0, 50\\)"):
        kp_losses.cross_entropy(x, t)
    t[3] = -7
    with pytest.raises(ValueError, match="target holds -7"):
        kp_losses.cross_entropy(x, t)
    monkeypatch.setattr(functional, "VALIDATE_TARGETS", False)
    loss, grad = loss_and_grad(kp_losses.cross_entropy, x, t, reduction="none")
    assert loss[3].isnan() and grad[3].isnan().all()
    others = torch.arange(len(t), device=DEVICE) != 3
    torch.testing.assert_close(loss[others], F.cross_entropy(x[others], t[others], reduction="none"))


def test_the_default_check_raises_at_the_call_on_a_cpu_and_at_a_later_call_on_a_gpu():
    x, t = logits_and_target(c=50, ignored=())
    t[2] = 77
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="target holds 77"):
            kp_losses.cross_entropy(x, t)
        return
    assert kp_losses.cross_entropy(x, t).isnan()  # no sync: NaN now, the error at a later call
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="an earlier call's target"):
        kp_losses.cross_entropy(x, t.clamp(max=49))


BAD = [
    (dict(input=torch.ones(3, 4, dtype=torch.int64)), TypeError, "input must have dtype"),
    (dict(input=torch.ones(3, 0)), ValueError, "input has no classes"),
    (dict(target=torch.zeros(3)), TypeError, "class-probability targets are not supported"),
    (dict(target=torch.zeros(4, dtype=torch.int64)), ValueError, "target must have shape \\(3,\\)"),
    (dict(weight=torch.ones(5)), ValueError, "weight must have one entry per class \\(4\\)"),
    (dict(weight=torch.ones(4, dtype=torch.int64)), TypeError, "weight must have dtype"),
    (dict(reduction="avg"), ValueError, "reduction must be one of"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing must be in \\[0, 1\\]"),
    (dict(z_loss=-1.0), ValueError, "z_loss must be finite and >= 0"),
    (dict(softcap=0.0), ValueError, "softcap must be finite and > 0"),
    (dict(softcap="30"), TypeError, "softcap must be a float or None"),
    (dict(ignore_index=1.0), TypeError, "ignore_index must be an int"),
]


@pytest.mark.parametrize("change,error,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_names_the_argument(change, error, match):
    call = {**dict(input=torch.randn(3, 4), target=torch.zeros(3, dtype=torch.int64)), **change}
    call = {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in call.items()}
    with pytest.raises(error, match=match):
        kp_losses.cross_entropy(**call)


def test_reference_path_matches_the_kernels(monkeypatch):
    x, t = logits_and_target()
    w = torch.rand(x.shape[1], dtype=torch.float64).to(DEVICE)
    kw = dict(weight=w, label_smoothing=0.2, z_loss=1e-3, softcap=20.0, reduction="none")
    kernel = loss_and_grad(kp_losses.cross_entropy, x, t, **kw)
    monkeypatch.setenv("KP_BACKEND", "reference")
    with kp_core.record_launches() as rec:
        reference = loss_and_grad(kp_losses.cross_entropy, x, t, **kw)
    assert rec.backends(ce.OP) == {kp_core.REFERENCE}
    for a, b in zip(kernel, reference):
        torch.testing.assert_close(a, b)


def test_compile_fullgraph_equals_eager():
    x, t = logits_and_target(c=130)
    x = x.float()
    fn = lambda x, t: kp_losses.cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-4)  # noqa: E731
    torch._dynamo.reset()
    eager = loss_and_grad(fn, x, t)
    compiled = loss_and_grad(torch.compile(fn, fullgraph=True), x, t)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)


def test_opcheck():
    x, t = logits_and_target(n=5, c=40)
    w = torch.rand(40, dtype=torch.float64).to(DEVICE)
    args = (x.float().requires_grad_(), t, w.float(), -100, 0.1, 1e-3, 10.0)
    torch.library.opcheck(ce.CROSS_ENTROPY.op, args)


def test_module_is_the_function():
    x, t = logits_and_target()
    module = kp_losses.CrossEntropyLoss(label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    assert "z_loss=0.0001" in repr(module)
    torch.testing.assert_close(
        module(x, t), kp_losses.cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-4, softcap=30.0)
    )
