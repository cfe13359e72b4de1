"""kp-losses' own tests of fused_linear_cross_entropy: it equals F.cross_entropy of the full logits in float64 for
every reduction and option, over one chunk or many; only the gradients asked for are made; chunking; bad input;
compile and opcheck. The 2x rule in low precision: conformance/specs/test_cross_entropy.py."""

import pytest
import torch
import torch.nn.functional as F

import kp_core
import kp_losses
from kp_losses import functional
from kp_losses.ops import cross_entropy as ce
from kp_losses.ops import linear_cross_entropy as lce

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON


def problem(n=37, h=24, v=130, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=dtype).to(DEVICE)
    w = (torch.randn(v, h, generator=g, dtype=dtype) / h**0.5).to(DEVICE)
    b = torch.randn(v, generator=g, dtype=dtype).to(DEVICE)
    t = torch.randint(0, v, (n,), generator=g).to(DEVICE)
    t[::5] = -100
    return x, w, b, t


def grads(fn, tensors, **kwargs):
    """(loss, d input, d weight, d bias) of fn(input, weight, target, bias) for a random loss gradient (drawn in
    float64, whatever the loss's dtype: the same gradient for every run)."""
    x, w, t, b = tensors
    leaves = [None if v is None else v.detach().requires_grad_() for v in (x, w, b)]
    loss = fn(leaves[0], leaves[1], t, leaves[2], **kwargs)
    grad = torch.randn(loss.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    loss.backward(grad.to(DEVICE, loss.dtype))
    return loss.detach(), *(None if v is None else v.grad for v in leaves)


def theirs(x, w, t, b=None, ce_weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, **extra):
    """F.cross_entropy of the full logits, with z_loss and softcap by their formulas."""
    z = x @ w.T + (0 if b is None else b)
    cap = extra.get("softcap")
    if cap:
        z = cap * torch.tanh(z / cap)
    rows = F.cross_entropy(
        z, t, ce_weight, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    counted = t != ignore_index
    wt = torch.ones_like(rows) if ce_weight is None else ce_weight[t.clamp(min=0)]
    rows = rows + extra.get("z_loss", 0.0) * torch.logsumexp(z, 1) ** 2 * counted * wt
    if reduction == "none":
        return rows
    return rows.sum() if reduction == "sum" else rows.sum() / (wt * counted).sum()


CASES = [
    dict(reduction="mean"),
    dict(reduction="sum", bias=True),
    dict(reduction="none", bias=True),
    dict(reduction="mean", ce_weight=True, label_smoothing=0.2),
    dict(reduction="none", ce_weight=True, z_loss=1e-2, softcap=3.0),
    dict(reduction="mean", bias=True, z_loss=1e-3, softcap=2.0, label_smoothing=0.1),
]


@pytest.mark.parametrize("chunk", [None, 1, 8])
@pytest.mark.parametrize("case", CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) for c in CASES])
def test_equals_cross_entropy_of_the_full_logits(case, chunk):
    x, w, b, t = problem()
    case = dict(case)
    bias = b if case.pop("bias", False) else None
    if case.pop("ce_weight", False):
        case["ce_weight"] = torch.rand(w.shape[0], generator=torch.Generator().manual_seed(4), dtype=x.dtype).to(DEVICE)
    with kp_core.record_launches() as rec:
        ours = grads(kp_losses.fused_linear_cross_entropy, (x, w, t, bias), chunk_size=chunk, **case)
    # the chunk's kernels ran, in the forward for "mean"/"sum" and again in the backward for "none"
    assert rec.backends(lce.OP) == {KERNEL}
    assert rec.backends(lce.OP_BWD) == ({KERNEL} if case["reduction"] == "none" else set())
    want = grads(lambda x, w, t, b: theirs(x, w, t, b, **case), (x, w, t, bias))
    for a, b_ in zip(ours, want):
        if b_ is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b_)


def test_many_chunks_in_float32_sum_the_weight_gradient_in_float32():
    """Thirty-seven chunks of one row: d(weight) summed in fp32 stays at fp32's error of the whole sum."""
    x, w, b, t = problem(dtype=torch.float32)
    ours = grads(kp_losses.fused_linear_cross_entropy, (x, w, t, b), chunk_size=1)
    want = grads(lambda x, w, t, b: theirs(x.double(), w.double(), t, b.double()), (x, w, t, b))
    for a, b_ in zip(ours, want):
        torch.testing.assert_close(a.double(), b_.double(), rtol=1e-5, atol=1e-6)


def test_only_the_gradients_asked_for():
    """A frozen head (LoRA): no d(weight) GEMM; frozen hidden states: no d(input)."""
    x, w, b, t = problem()
    for frozen in ("weight", "input"):
        xx = x.detach().requires_grad_(frozen != "input")
        ww = w.detach().requires_grad_(frozen != "weight")
        kp_losses.fused_linear_cross_entropy(xx, ww, t).backward()
        assert (ww.grad is None) == (frozen == "weight") and (xx.grad is None) == (frozen == "input")
    with torch.no_grad(), kp_core.record_launches() as rec:
        loss = kp_losses.fused_linear_cross_entropy(x, w, t, chunk_size=8)
    assert [launch.kernel for launch in rec.launches] == ["_ce_fwd"] * 5  # no gradient pass without grad
    torch.testing.assert_close(loss, theirs(x, w, t))


def test_leading_dims_and_the_module():
    x, w, b, t = problem(n=24)
    head = torch.nn.Linear(24, 130, dtype=torch.float64, device=DEVICE)
    with torch.no_grad():
        head.weight.copy_(w), head.bias.copy_(b)
    module = kp_losses.LinearCrossEntropyLoss(head, reduction="none", chunk_size=5)
    assert "chunk_size=5" in repr(module)
    loss = module(x.reshape(4, 6, 24), t.reshape(4, 6))
    assert loss.shape == (4, 6)
    torch.testing.assert_close(loss.reshape(-1), theirs(x, w, t, b, reduction="none"))
    with pytest.raises(TypeError, match="head must be a torch.nn.Linear"):
        kp_losses.LinearCrossEntropyLoss(torch.nn.Identity())
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        kp_losses.LinearCrossEntropyLoss(head, chunk_size=0)


def test_inputs_are_not_mutated():
    x, w, b, t = problem()
    before = [v.clone() for v in (x, w, b, t)]
    grads(kp_losses.fused_linear_cross_entropy, (x, w, t, b), chunk_size=4, label_smoothing=0.1)
    assert all(torch.equal(a, c) for a, c in zip((x, w, b, t), before))


def test_chunk_rows():
    assert lce.chunk_rows(1000, 50, 2, torch.device("cpu"), 7) == 7
    assert lce.chunk_rows(5, 50, 2, torch.device("cpu"), 7) == 5
    rows = lce.chunk_rows(100000, 128256, 2, torch.device("cpu"), 0)
    assert rows % lce.ROW_MULTIPLE == 0 and rows * 128256 * 2 <= lce.CHUNK_BYTES
    assert lce.chunk_rows(10, 1 << 30, 2, torch.device("cpu"), 0) == 1  # one row's logits over budget: one row
    # every row in one chunk where the logits take no more than the fp32 sum of d(weight) plus a chunk
    sum_bytes = 128256 * 4096 * 4
    assert lce.chunk_rows(8192, 128256, 2, torch.device("cpu"), 0, sum_bytes) == 8192
    assert lce.chunk_rows(16384, 32000, 2, torch.device("cpu"), 0, 32000 * 2048 * 4) < 16384


BAD = [
    (dict(input=torch.ones(3, 4, dtype=torch.int64)), TypeError, "input must have dtype"),
    (dict(weight=torch.ones(5, 4, dtype=torch.float64)), TypeError, "weight must have the dtype of input"),
    (dict(weight=torch.ones(5, 4, dtype=torch.int64)), TypeError, "weight must have dtype in"),
    (dict(weight=torch.ones(5, 3)), ValueError, "input's last dim \\(4\\) must be weight's dim 1 \\(3\\)"),
    (dict(weight=torch.ones(0, 4)), ValueError, "weight has no classes"),
    (dict(bias=torch.ones(4)), ValueError, "bias must have shape \\(5,\\)"),
    (dict(target=torch.zeros(3, 1, dtype=torch.int64)), ValueError, "target must have shape \\(3,\\)"),
    (dict(ce_weight=torch.ones(4)), ValueError, "ce_weight must have one entry per class \\(5\\)"),
    (dict(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (dict(target=torch.full((3,), 5)), ValueError, "target holds 5, outside \\[0, 5\\)"),
]


@pytest.mark.parametrize("change,error,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_names_the_argument(change, error, match, monkeypatch):
    monkeypatch.setattr(functional, "VALIDATE_TARGETS", "sync")  # a bad target at the call, on a GPU too
    call = {
        **dict(input=torch.randn(3, 4), weight=torch.randn(5, 4), target=torch.zeros(3, dtype=torch.int64)),
        **change,
    }
    call = {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in call.items()}
    with pytest.raises(error, match=match):
        kp_losses.fused_linear_cross_entropy(**call)


def test_compile_fullgraph_equals_eager():
    x, w, b, t = problem(dtype=torch.float32)
    fn = lambda x, w, t, b: kp_losses.fused_linear_cross_entropy(x, w, t, b, chunk_size=8, z_loss=1e-3)  # noqa: E731
    torch._dynamo.reset()
    for a, c in zip(grads(fn, (x, w, t, b)), grads(torch.compile(fn, fullgraph=True), (x, w, t, b))):
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("reduction", [lce.MEAN, lce.NONE])
def test_opcheck(reduction):
    x, w, b, t = problem(n=9, h=8, v=20, dtype=torch.float32)
    args = (x.requires_grad_(), w.requires_grad_(), t, b.requires_grad_(), None, -100, 0.1, 1e-3, 0.0, reduction)
    torch.library.opcheck(lce.LINEAR_CROSS_ENTROPY.op, (*args, True, True, True, 4, 0))


def test_row_dtype_is_the_kernels_arithmetic():
    assert ce.row_dtype(torch.bfloat16) == torch.float32 and ce.row_dtype(torch.float32) == torch.float64


FLOAT8 = [(recipe, reduction) for recipe in ("tensorwise", "rowwise") for reduction in ("mean", "none")]


@pytest.mark.parametrize("recipe,reduction", FLOAT8, ids=[f"{r}-{d}" for r, d in FLOAT8])
def test_float8_head_is_a_float8_linears_error_away_over_chunks(recipe, reduction):
    """float8=...: 37 rows (padded to 48 inside) in chunks of 16, so d(weight) sums three chunks' products; the
    loss and every gradient within 10 % (relative L2, kp.optimize's float8 budget) of the full-precision loss, and
    not equal to it; kp-precision's quantize and scaled_mm ran. The recipe itself, exactly, and the rule against
    PyTorch's float8 GEMMs: the conformance spec."""
    x, w, b, t = problem(n=37, h=32, v=48, dtype=torch.float32)
    with kp_core.record_launches() as rec:
        ours = grads(
            kp_losses.fused_linear_cross_entropy, (x, w, t, b), reduction=reduction, chunk_size=16, float8=recipe
        )
    assert {"kp::quantize", "kp::scaled_mm", lce.OP} <= {launch.op for launch in rec.launches}
    want = grads(theirs, (x.double(), w.double(), t, b.double()), reduction=reduction)
    for name, a, r in zip(("loss", "dinput", "dweight", "dbias"), ours, want):
        assert a.shape == r.shape and a.dtype == torch.float32, name
        rel = float((a.double() - r).norm() / r.norm())
        assert 1e-5 < rel < 0.1 or (name in ("loss", "dbias") and rel < 0.1), f"{name}: {rel:.2e}"


def test_float8_frozen_head_casts_no_weight_gradient():
    x, w, b, t = problem(n=16, h=32, v=48, dtype=torch.float32)
    x.requires_grad_()
    with kp_core.record_launches() as rec:
        kp_losses.fused_linear_cross_entropy(x, w, t, float8="rowwise").backward()
    assert x.grad is not None and w.grad is None
    # x, w for the logits; the gradient and w.T for d(input); nothing cast along the rows for d(weight)
    assert len([launch for launch in rec.launches if launch.op == "kp::quantize"]) == 4


FLOAT8_BAD = [
    (dict(float8="blockwise"), ValueError, "float8 must be None or one of \\('tensorwise', 'rowwise'\\)"),
    (dict(float8="rowwise", dtype=torch.float64), TypeError, "float8 takes float16, bfloat16 or float32"),
    (dict(float8="rowwise", v=40), ValueError, "float8 needs weight's dims to be multiples of 16"),
]


@pytest.mark.parametrize("change,error,match", FLOAT8_BAD, ids=[m[:30] for _, _, m in FLOAT8_BAD])
def test_float8_bad_arguments(change, error, match):
    change = dict(change)
    x, w, b, t = problem(n=8, h=32, v=change.pop("v", 48), dtype=change.pop("dtype", torch.float32))
    with pytest.raises(error, match=match):
        kp_losses.fused_linear_cross_entropy(x, w, t, **change)


def test_float8_without_kp_precision_says_how_to_get_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "kp_precision", None)  # as if not installed
    x, w, b, t = problem(n=8, h=32, v=48, dtype=torch.float32)
    with pytest.raises(ImportError, match="pip install 'kp-losses\\[float8\\]'"):
        kp_losses.fused_linear_cross_entropy(x, w, t, float8="tensorwise")
