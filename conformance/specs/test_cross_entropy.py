"""Conformance spec for kp-losses: cross_entropy and fused_linear_cross_entropy, loss and every gradient, against
float64 references written from the formulas in plain PyTorch, held to the 2x rule against PyTorch's own
computation in the input's precision."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import kp_conformance as kc
import kp_core
import kp_losses
from kp_conformance import fuzz
from kp_conformance.references import quantize_fp8, scale_of_each, scaled_mm_lowp
from kp_losses.ops import cross_entropy as ce_mod
from kp_losses.ops import linear_cross_entropy as lce_mod

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TIER = kc.current()
DEVICE = kc.device()
CE_OPS = (ce_mod.OP, ce_mod.OP_BWD)
LCE_OPS = (lce_mod.OP, lce_mod.OP_BWD)
REDUCTIONS = ("mean", "sum", "none")

kc.declare(
    kc.Spec(
        name="cross_entropy",
        package="kp-losses",
        ops=CE_OPS + LCE_OPS,
        reference=(
            "torch.nn.functional.cross_entropy in float64 (its label smoothing and class weights, per row, then "
            "reduced by hand), on logits z = softcap * tanh(x / softcap) (Gemma 2) with z_loss * logsumexp(z)^2 "
            "added per counted row, weighted by the target's class weight (PaLM, section 5); the fused form on "
            "logits x @ W.T + b formed in float64; PyTorch's own low-precision run is the same code in the "
            "input's dtype; the float8 head: its recipe on plain-PyTorch float8 casts, in float64 and by PyTorch's "
            "float8 GEMMs"
        ),
        dtypes=DTYPES,
        properties=(
            "values",
            "gradients",
            "float8",
            "switches",
            "no_mutation",
            "determinism",
            "zero_size",
            "bad_input",
        ),
    )
)


def reference(x, t, weight, ignore_index, reduction, label_smoothing, z_loss, softcap):
    """PyTorch's own computation, as a user writes it, in x's dtype: F.cross_entropy of the (capped) logits plus
    z_loss * logsumexp^2 per counted row, reduced by hand."""
    z = softcap * torch.tanh(x / softcap) if softcap else x
    w = None if weight is None else weight.to(x.dtype)
    rows = F.cross_entropy(z, t, w, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    counted = t != ignore_index
    w_t = torch.ones_like(rows) if w is None else w[t.clamp(0, x.shape[1] - 1)]
    if z_loss:
        rows = rows + z_loss * torch.logsumexp(z, 1) ** 2 * counted * w_t
    return _reduced(rows, counted, w_t, reduction)


def reference64(x, t, weight, ignore_index, reduction, label_smoothing, z_loss, softcap):
    """The loss from its formulas in float64 (label smoothing: Szegedy et al. 2016, torch's weighted form; z-loss:
    PaLM, section 5), log-probabilities written as (z - m) - log sum exp(z - m) with m the row max held constant (the
    loss does not depend on it), so that autograd's softmax is exp(z - m) / sum exp(z - m): a few ulps at any
    logit offset. (torch's log_softmax backward takes exp(log p), off by log p's own ulp: 100 ulps of a float64
    gradient in a case the suite drew, where kp's kernel was within 4.)"""
    x = x.double()
    z = softcap * torch.tanh(x / softcap) if softcap else x
    m = z.max(1, keepdim=True).values.detach()
    zs = z - torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    log_s = torch.log(torch.exp(zs).sum(1, keepdim=True))
    logp = zs - log_s
    c = x.shape[1]
    w = torch.ones(c, dtype=x.dtype, device=x.device) if weight is None else weight.double()
    counted = t != ignore_index
    tc = t.clamp(0, c - 1)
    w_t = w[tc]
    lse = (m + log_s)[:, 0]
    rows = w_t * ((1 - label_smoothing) * -logp.gather(1, tc[:, None])[:, 0] + z_loss * lse * lse)
    rows = rows + label_smoothing / c * -(logp * w).sum(1)
    return _reduced(torch.where(counted, rows, torch.zeros_like(rows)), counted, w_t, reduction)


def _reduced(rows, counted, w_t, reduction):
    if reduction == "none":
        return rows
    total = rows.sum()
    return total if reduction == "sum" else total / (w_t * counted).sum()


# Classes: tiny, around the kernels' slices (the interpreter's 256, the GPU's 4096), odd, and vocabularies of
# real models (GPT-2 50257, Llama 3 128256, Qwen 2 152064, Gemma 256000, 262144), up to the tier's widest row.
CLASSES = (1, 2, 3, 5, 17, 255, 256, 257, 1000, 4095, 4097, 10007, 32000, 50257, 128256, 152064, 256000, 262144)


@st.composite
def ce_cases(draw, fused=False):
    widest = max(TIER.max_cols, 300)
    c = draw(st.sampled_from([n for n in CLASSES if n <= widest]))
    rows = draw(st.sampled_from([1, 2, 3, 7, 16, 33, 65]))
    rows = max(1, min(rows, TIER.max_numel // c))
    case = dict(
        c=c,
        n=rows,
        weight=draw(st.booleans()),
        ignored=draw(st.sampled_from([0.0, 0.3, 1.0])),  # the share of rows whose target is ignore_index
        ignore_index=draw(st.sampled_from([-100, 0])),
        reduction=draw(st.sampled_from(REDUCTIONS)),
        smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
        z_loss=draw(st.sampled_from([0.0, 1e-4, 1e-2])),
        softcap=draw(st.sampled_from([None, 30.0, 3.0])),
        scale=draw(st.sampled_from([1.0, 10.0])),
        family=draw(st.sampled_from(kc.FAMILIES)),
        seed=draw(st.integers(0, 2**16)),
    )
    if fused:
        case["h"] = draw(st.sampled_from([1, 8, 31, 64]))
        case["n"] = max(1, min(rows, TIER.max_numel // max(case["h"], c // 8)))
        case["bias"] = draw(st.booleans())
        case["chunk"] = draw(st.sampled_from([None, 1, 5]))
    else:
        case["layout"] = draw(st.sampled_from(kc.LAYOUTS))
    return case


def targets(case, device):
    g = torch.Generator().manual_seed(case["seed"] + 1)
    t = torch.randint(0, case["c"], (case["n"],), generator=g)
    if case["ignore_index"] >= 0:  # an ignore_index that is also a class: rows of that class count for nothing
        t = t.clamp(min=1) if case["c"] > 1 else t
    t[torch.rand(case["n"], generator=g) < case["ignored"]] = case["ignore_index"]
    return t.to(device)


def class_weight(case, device):
    if not case["weight"]:
        return None
    return torch.rand(case["c"], generator=torch.Generator().manual_seed(case["seed"] + 2), dtype=torch.float32).to(
        device
    )


def options(case):
    return dict(
        ignore_index=case["ignore_index"],
        reduction=case["reduction"],
        label_smoothing=case["smoothing"],
        z_loss=case["z_loss"],
        softcap=case["softcap"],
    )


def upstream(loss, seed):
    """A random gradient for the loss (a scalar's too), in its dtype."""
    g = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return g.to(loss.device, loss.dtype)


def loss_and_grads(fn, leaves, others, g=None, seed=0):
    leaves = [None if t is None else t.detach().requires_grad_() for t in leaves]
    loss = fn(*leaves, *others)
    loss.backward(upstream(loss, seed) if g is None else g)
    return loss.detach(), *[None if t is None else t.grad for t in leaves]


def no_row_counts(opts, t):
    """ "mean" over no counted row: torch's NaN loss and zero gradients."""
    return opts["reduction"] == "mean" and not bool((t != opts["ignore_index"]).any())


def check_all(names, ours, ref, low, dtype):
    for name, a, r, lo in zip(names, ours, ref, low):
        if a is not None:
            kc.check_close(name, a, r, lo, dtype)


@pytest.mark.conformance(kernel="cross_entropy", prop="gradients")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(case=ce_cases())
def test_values_and_gradients(dtype, case):
    kc.skip_if_not_covered(dtype)
    shape, layout, family = (case["n"], case["c"]), case["layout"], case["family"]
    x = kc.make_input(shape, dtype, DEVICE, layout, scale=case["scale"], seed=case["seed"], family=family)
    check_cross_entropy(x, targets(case, DEVICE), class_weight(case, DEVICE), options(case), dtype, case["seed"])


def check_cross_entropy(x, t, w, opts, dtype, seed):
    """cross_entropy's loss and gradient for a random upstream gradient, by the rule (NaN and zero gradients, as
    torch's, where "mean" counts no row); both kernels ran."""
    with kp_core.record_launches() as rec:
        ours = loss_and_grads(lambda x: kp_losses.cross_entropy(x, t, w, **opts), [x], [], seed=seed)
    kc.assert_kernel_ran(rec, *CE_OPS)
    g = upstream(ours[0], seed)
    w64 = None if w is None else w.double()
    ref = loss_and_grads(lambda x: reference64(x, t, w64, **opts), [x.double()], [], g.double())
    low = loss_and_grads(lambda x: reference(x, t, w, **opts), [x], [], g)
    if no_row_counts(opts, t):
        assert ours[0].isnan() and low[0].isnan() and not ours[1].any()
        return
    check_all(("loss", "dinput"), ours, ref, low, dtype)


def linear_problem(case, dtype):
    c, h, n = case["c"], case["h"], case["n"]
    x = kc.make_input((n, h), dtype, DEVICE, "contiguous", scale=1.0, seed=case["seed"], family=case["family"])
    wscale = case["scale"] / math.sqrt(h)
    weight = kc.make_input((c, h), dtype, DEVICE, "contiguous", scale=wscale, seed=case["seed"] + 3)
    bias = kc.make_input((c,), dtype, DEVICE, "contiguous", seed=case["seed"] + 4) if case["bias"] else None
    return x, weight, bias


@pytest.mark.conformance(kernel="linear_cross_entropy", prop="gradients")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(case=ce_cases(fused=True))
def test_linear_values_and_gradients(dtype, case):
    kc.skip_if_not_covered(dtype)
    x, weight, bias = linear_problem(case, dtype)
    t, w = targets(case, DEVICE), class_weight(case, DEVICE)
    opts = options(case)

    def ours_fn(x, weight, bias):
        return kp_losses.fused_linear_cross_entropy(x, weight, t, bias, w, chunk_size=case["chunk"], **opts)

    def theirs(ref, w_class):
        return lambda x, weight, bias: ref(F.linear(x, weight, bias), t, w_class, **opts)

    with kp_core.record_launches() as rec:
        ours = loss_and_grads(ours_fn, [x, weight, bias], [], seed=case["seed"])
    assert rec.backends(lce_mod.OP) == {kc.kernel_backend()}, rec.launches
    if case["reduction"] == "none":
        kc.assert_kernel_ran(rec, lce_mod.OP_BWD)
    g = upstream(ours[0], case["seed"])
    w64 = None if w is None else w.double()
    leaves64 = [v if v is None else v.double() for v in (x, weight, bias)]
    ref = loss_and_grads(theirs(reference64, w64), leaves64, [], g.double())
    low = loss_and_grads(theirs(reference, w), [x, weight, bias], [], g)
    if no_row_counts(opts, t):
        assert ours[0].isnan() and low[0].isnan() and not ours[1].any()
        return
    check_all(("loss", "dinput", "dweight", "dbias"), ours, ref, low, dtype)


# ---- the float8 head (fused_linear_cross_entropy(float8=...)): kp-precision's recipes, the rule on norms ----

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


class _Cast:
    """An operand cast by a recipe (kp_conformance.references.quantize_fp8, plain PyTorch): its float8 data and
    every element's scale; dequantised exactly in float64, or multiplied by PyTorch's float8 GEMM."""

    def __init__(self, t, fp8, rowwise, given=None):
        gran = "rowwise" if rowwise else "tensorwise"
        self.data, scale, _ = quantize_fp8(t.contiguous(), fp8, gran, given=given, power_of_2=rowwise)
        self.scale = scale_of_each(self.data, scale, gran)

    def t(self):
        c = object.__new__(_Cast)
        c.data, c.scale = self.data.t(), self.scale.t()
        return c

    def mm(self, other, lowp):
        if lowp:
            return scaled_mm_lowp(self.data, other.data, self.scale, other.scale)
        return (self.data.double() * self.scale.double()) @ (other.data.double() * other.scale.double())


def float8_head(x, weight, bias, t, g, recipe, reduction, lowp):
    """(loss, dinput, dweight, dbias) of the recipe as kp_losses.ops.linear_cross_entropy_float8 describes it, one
    chunk: float64 maths on the float8 operands (lowp=False), or PyTorch's own run (lowp=True): its float8 GEMMs,
    logits and gradient rounded to the input's dtype, cross_entropy in fp32. A reduced loss's gradient is cast for a
    loss gradient of 1, the GEMMs' results scaled by g (the op makes them in its forward, before g is known)."""
    rowwise = recipe == "rowwise"
    grad8 = E4M3 if rowwise else E5M2
    qx, qw = _Cast(x, E4M3, rowwise), _Cast(weight, E4M3, rowwise)
    z = qx.mm(qw.t(), lowp) + (0 if bias is None else bias.to(torch.float32 if lowp else torch.float64))
    z = (z.to(x.dtype).float() if lowp else z).detach().requires_grad_()
    loss = F.cross_entropy(z, t, reduction=reduction)
    # a reduced loss's gradients are made for a loss gradient of 1 and scaled by the actual one (a scalar) after
    # the GEMMs; "none" casts each row's own
    after = g.to(loss.dtype) if reduction != "none" else None
    (dz,) = torch.autograd.grad(loss, z, torch.ones_like(loss) if after is not None else g.to(loss.dtype))
    dz = dz.to(x.dtype) if lowp else dz  # ours: the kernels write it over the logits, in their dtype
    given = None
    if not rowwise:  # g's scale: its bound over e5m2's largest, |softmax - target| <= 1 x the row's gradient
        rows = g.abs().amax() if after is None else 1 / (t != -100).sum()
        given = rows.float() / torch.finfo(E5M2).max
    qg = _Cast(dz, grad8, rowwise, given)
    w_dx = _Cast(weight.t(), E4M3, True).t() if rowwise else qw
    dx = qg.mm(w_dx, lowp)
    if rowwise:  # d(weight) in the input's dtype (its contraction crosses the chunks)
        dw = dz.t().to(x.dtype).float() @ x.float() if lowp else dz.t() @ x.double()
    else:
        dw = qg.t().mm(qx, lowp)
    db = dz.sum(0, dtype=torch.float32 if lowp else torch.float64)
    grads = [d.to(x.dtype) if lowp else d for d in (dx, dw, db)]
    grads = grads if after is None else [d * after.to(d.dtype) for d in grads]
    return [loss.detach().to(x.dtype) if lowp else loss.detach(), *grads]


@pytest.mark.conformance(kernel="linear_cross_entropy", prop="float8")
@pytest.mark.parametrize("recipe", ("tensorwise", "rowwise"))
@pytest.mark.parametrize("reduction", ("mean", "none"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=kc.dtype_id)
@pytest.mark.parametrize("chunk", (None, 16), ids=("one-chunk", "three-chunks"))
def test_float8_head_by_its_recipe(dtype, reduction, recipe, chunk):
    """float8="tensorwise" / "rowwise": the loss and every gradient against the recipe in float64, within twice
    PyTorch's own run of the same recipe (its float8 GEMMs) plus 1e-3, each as a relative L2 error: the chunk's
    gradient is cast to float8 after it is rounded to the input's dtype, so a few elements round to a neighbouring
    float8 value in any low-precision run; the norm weighs them as the loss does. 37 rows (padded to 48 inside),
    one chunk or three (the recipe does not depend on the chunks: x cast whole, g's scale from its bound, d(weight)
    over every row); kp's own float8 matmul kernel (the route to cuBLAS pinned off) and quantize kernel ran."""
    n, h, v = 37, 32, 48
    x = kc.make_input((n, h), dtype, DEVICE, "contiguous", seed=11)
    weight = kc.make_input((v, h), dtype, DEVICE, "contiguous", scale=0.5, seed=12)
    bias = kc.make_input((v,), dtype, DEVICE, "contiguous", seed=13)
    t = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(14)).to(DEVICE)
    t[[3, 20]] = -100
    with kp_core.pinned("scaled_mm_route", cublas=False), kp_core.record_launches() as rec:
        ours = loss_and_grads(
            lambda x, w, b: kp_losses.fused_linear_cross_entropy(
                x, w, t, b, reduction=reduction, float8=recipe, chunk_size=chunk
            ),
            [x, weight, bias],
            [],
            seed=15,
        )
    kc.assert_kernel_ran(rec, lce_mod.OP, "kp::quantize", "kp::scaled_mm")
    g = upstream(ours[0], 15)
    ref = float8_head(x, weight, bias, t, g.double(), recipe, reduction, lowp=False)
    low = float8_head(x, weight, bias, t, g.float(), recipe, reduction, lowp=True)
    for name, a, r, lo in zip(("loss", "dinput", "dweight", "dbias"), ours, ref, low):
        err, bound = (float((u.double() - r).norm() / r.norm()) for u in (a, lo))
        assert err <= 2 * bound + 1e-3, f"{name}: relative error {err:.3e}, PyTorch's {bound:.3e}"
    plain = loss_and_grads(
        lambda x, w, b: kp_losses.fused_linear_cross_entropy(x, w, t, b, reduction=reduction), [x, weight, bias], []
    )
    assert not torch.equal(ours[1], plain[1])  # the float8 operands were used


# Each compile-time switch of both kernels on and off, forward and backward, in every tier whatever it draws.
SWITCHES = [dict(weight=w, smoothing=s, softcap=cap) for w in (False, True) for s in (0.0, 0.2) for cap in (None, 5.0)]


@pytest.mark.conformance(kernel="cross_entropy", prop="switches")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=kc.dtype_id)
@pytest.mark.parametrize("switch", SWITCHES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_every_switch(dtype, switch):
    kc.skip_if_not_covered(dtype)
    case = dict(c=600, n=9, ignored=0.3, ignore_index=-100, reduction="none", z_loss=1e-3, scale=3.0, seed=5, **switch)
    x = kc.make_input((case["n"], case["c"]), dtype, DEVICE, "contiguous", scale=3.0, seed=5)
    check_cross_entropy(x, targets(case, DEVICE), class_weight(case, DEVICE), options(case), dtype, 1)


@pytest.mark.conformance(kernel="cross_entropy", prop="values")
def test_out_of_range_targets_without_the_check_are_nan_rows(monkeypatch):
    """With the host check off (VALIDATE_TARGETS = False, as under capture), targets C, C + 100 and -1 give NaN
    rows (loss and gradient) and the kernels read nothing outside the logits (the guard checks every load); the
    other rows are untouched: the fused loss too."""
    monkeypatch.setattr(kp_losses.functional, "VALIDATE_TARGETS", False)
    c = 300
    x = kc.make_input((6, c), torch.float32, DEVICE, "contiguous", seed=4)
    t = torch.tensor([c, c + 100, -1, 0, c - 1, -100], device=DEVICE)
    good = torch.tensor([False, False, False, True, True, True], device=DEVICE)
    with kp_core.record_launches() as rec:
        loss, grad = loss_and_grads(lambda x: kp_losses.cross_entropy(x, t, reduction="none"), [x], [])
    kc.assert_kernel_ran(rec, *CE_OPS)
    assert loss[~good].isnan().all() and grad[~good].isnan().all()
    want = loss_and_grads(lambda x: reference64(x, t.clamp(max=c - 1), None, -100, "none", 0.0, 0.0, None), [x], [])
    torch.testing.assert_close(loss[good].double(), want[0][good])
    hidden, head = (kc.make_input(s, torch.float32, DEVICE, "contiguous", seed=5) for s in ((6, 8), (c, 8)))
    fused = kp_losses.fused_linear_cross_entropy(hidden, head, t, reduction="none", chunk_size=4)
    assert fused[~good].isnan().all() and fused[good].isfinite().all()


@pytest.fixture(autouse=True, scope="module")
def _targets_checked_at_the_call():
    """The bad-input fuzzer wants the ValueError at the call; on a GPU the default check reports at a later call
    (test_bad_targets_are_reported_by_a_later_call), so this spec checks synchronously ("sync") elsewhere."""
    kept, kp_losses.functional.VALIDATE_TARGETS = kp_losses.functional.VALIDATE_TARGETS, "sync"
    yield
    kp_losses.functional.VALIDATE_TARGETS = kept


@pytest.mark.conformance(kernel="cross_entropy", prop="bad_input")
@pytest.mark.parametrize("fused", [False, True], ids=["cross_entropy", "fused"])
def test_bad_targets_are_reported_by_a_later_call(monkeypatch, fused):
    """The default on a GPU (forced here on any device): a call with a target out of range raises nothing and
    gives NaN rows; the next call raises ValueError once its copy of the device's flag has landed; then calls run
    again."""
    monkeypatch.setattr(kp_losses.functional, "VALIDATE_TARGETS", True)
    monkeypatch.setattr(kp_losses.functional, "_reports_later", lambda target: True)
    c = 40
    x = kc.make_input((5, c), torch.float32, DEVICE, "contiguous", seed=6)
    head = kc.make_input((c, 8), torch.float32, DEVICE, "contiguous", seed=7)
    hidden = kc.make_input((5, 8), torch.float32, DEVICE, "contiguous", seed=8)

    def call(t):
        if fused:
            return kp_losses.fused_linear_cross_entropy(hidden, head, t, reduction="none")
        return kp_losses.cross_entropy(x, t, reduction="none")

    good = torch.tensor([0, 3, -100, c - 1, 7], device=DEVICE)
    bad = torch.tensor([0, c, -100, c - 1, -2], device=DEVICE)
    assert call(good).isfinite().all()
    loss = call(bad)  # raises nothing
    assert loss[[1, 4]].isnan().all() and loss[[0, 2, 3]].isfinite().all()
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()  # the flag's copy has landed
    with pytest.raises(ValueError, match="an earlier call's target held class indices outside"):
        call(good)
    assert call(good).isfinite().all()  # reported once


@pytest.mark.conformance(kernel="cross_entropy", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_no_mutation(dtype):
    kc.skip_if_not_covered(dtype)
    x = kc.make_input((7, 300), dtype, DEVICE, "row_strided", seed=1)
    t = torch.tensor([0, 5, -100, 299, 7, 8, 9], device=DEVICE)
    w = torch.rand(300, device=DEVICE)
    hidden, head = (kc.make_input(s, dtype, DEVICE, "contiguous", seed=2) for s in ((7, 16), (300, 16)))
    before = [v.clone() for v in (x, t, w, hidden, head)]
    with kp_core.record_launches() as rec:
        loss_and_grads(lambda x: kp_losses.cross_entropy(x, t, w, label_smoothing=0.1), [x], [])
        call = lambda h, m: kp_losses.fused_linear_cross_entropy(h, m, t, ce_weight=w, chunk_size=3)  # noqa: E731
        loss_and_grads(call, [hidden, head], [])
    kc.assert_kernel_ran(rec, *CE_OPS)
    assert rec.backends(lce_mod.OP) == {kc.kernel_backend()}
    for v, b in zip((x, t, w, hidden, head), before):
        assert torch.equal(v, b), "an input was modified"


@pytest.mark.conformance(kernel="cross_entropy", prop="determinism")
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=kc.dtype_id)
def test_determinism(dtype):
    """Bitwise-equal losses and gradients on repeated calls (no atomics anywhere)."""
    kc.skip_if_not_covered(dtype)
    rows, c = (512, 32000) if DEVICE.type == "cuda" else (5, 1000)
    x = kc.make_input((rows, c), dtype, DEVICE, "contiguous", scale=3.0, seed=3)
    t = torch.randint(0, c, (rows,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    runs = [loss_and_grads(lambda x: kp_losses.cross_entropy(x, t, label_smoothing=0.1), [x], []) for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b), "repeated calls differ"


@pytest.mark.conformance(kernel="cross_entropy", prop="zero_size")
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_zero_size(reduction):
    """No rows: torch's results (mean NaN, sum 0, none empty), no launch."""
    x = torch.randn(0, 7, device=DEVICE, requires_grad=True)
    t = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    with kp_core.record_launches() as rec:
        ours = kp_losses.cross_entropy(x, t, reduction=reduction)
        fused = kp_losses.fused_linear_cross_entropy(
            torch.randn(0, 4, device=DEVICE), torch.randn(7, 4, device=DEVICE), t
        )
    assert rec.backends() <= {kp_core.REFERENCE}, rec.launches
    theirs = F.cross_entropy(x, t, reduction=reduction)
    assert ours.shape == theirs.shape and torch.equal(ours.isnan(), theirs.isnan())
    assert fused.isnan()
    if reduction != "none":
        ours.backward()
        assert x.grad.shape == x.shape


def _logits(d):
    return dict(input=torch.randn(4, 9, device=d), target=torch.tensor([1, 8, 0, -100], device=d))


def _linear(d):
    return dict(
        input=torch.randn(4, 6, device=d),
        weight=torch.randn(9, 6, device=d),
        target=torch.tensor([1, 8, 0, -100], device=d),
    )


def _bad_targets(t):
    return torch.full_like(t, 9)


CE_TARGETS = [
    fuzz.Target(
        "kp_losses.cross_entropy",
        "kp-losses",
        kp_losses.cross_entropy,
        lambda d: dict(_logits(d), weight=torch.rand(9, device=d), label_smoothing=0.1),
        dict(
            input=fuzz.Tensor(DTYPES, ranked=False, first=True),
            target=fuzz.Tensor(
                (torch.int64, torch.int32, torch.int16, torch.uint8), sized=(0,), index=_bad_targets, values=False
            ),
            # class weights are finite by definition; torch's NaN or inf from one depends on its summation order
            weight=fuzz.Tensor(DTYPES, sized=(0,), values=False),
            ignore_index=fuzz.Scalar(bad=(1.5, None)),
            reduction=fuzz.Scalar(bad=("avg", None)),
            label_smoothing=fuzz.Scalar(bad=(-0.1, 2.0, None)),
            z_loss=fuzz.Scalar(bad=(-1.0, float("nan"))),
            softcap=fuzz.Scalar(bad=(0.0, -3.0, float("inf"))),
        ),
        torch_fn=lambda input, target, weight, label_smoothing: F.cross_entropy(
            input, target, weight.to(input.dtype), label_smoothing=label_smoothing
        ),
        zero=lambda d: dict(
            input=torch.randn(0, 9, device=d),
            target=torch.zeros(0, dtype=torch.int64, device=d),
            weight=torch.rand(9, device=d),
            label_smoothing=0.1,
        ),
    ),
    fuzz.Target(
        "kp_losses.fused_linear_cross_entropy",
        "kp-losses",
        kp_losses.fused_linear_cross_entropy,
        lambda d: dict(_linear(d), bias=torch.randn(9, device=d), chunk_size=2),
        dict(
            input=fuzz.Tensor(DTYPES, ranked=False, first=True, words=("weight",)),
            weight=fuzz.Tensor(DTYPES, sized=(0, 1), words=("input",)),
            target=fuzz.Tensor(
                (torch.int64, torch.int32, torch.int16, torch.uint8), sized=(0,), index=_bad_targets, values=False
            ),
            bias=fuzz.Tensor(DTYPES, sized=(0,), words=("input",)),
            chunk_size=fuzz.Scalar(bad=(0, -1, 2.5)),
            float8=fuzz.Scalar(bad=("blockwise", "e4m3")),
        ),
        torch_fn=lambda input, weight, target, bias, chunk_size: F.cross_entropy(F.linear(input, weight, bias), target),
        zero=lambda d: dict(
            input=torch.randn(0, 6, device=d),
            weight=torch.randn(9, 6, device=d),
            target=torch.zeros(0, dtype=torch.int64, device=d),
            bias=torch.randn(9, device=d),
            chunk_size=2,
        ),
        aliases=(("input", "weight"),),
    ),
]

test_bad_input_fuzz = kc.fuzz_test("cross_entropy", CE_TARGETS)


@pytest.mark.conformance(kernel="cross_entropy", prop="values")
def test_opcheck():
    x = kc.make_input((5, 70), torch.float32, DEVICE, "row_strided", seed=1).requires_grad_()
    t = torch.tensor([0, 69, -100, 3, 4], device=DEVICE)
    with kp_core.record_launches() as rec:
        torch.library.opcheck(ce_mod.CROSS_ENTROPY.op, (x, t, None, -100, 0.1, 1e-3, 5.0))
    kc.assert_kernel_ran(rec, *CE_OPS)


@pytest.mark.conformance(kernel="cross_entropy", prop="values")
def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()
    x = kc.make_input((6, 300), torch.float32, DEVICE, "contiguous", seed=2)
    hidden, head = (kc.make_input(s, torch.float32, DEVICE, "contiguous", seed=3) for s in ((6, 8), (300, 8)))
    t = torch.tensor([0, 299, -100, 3, 4, 5], device=DEVICE)

    def f(x, hidden, head):
        a = kp_losses.cross_entropy(x * 2, t, label_smoothing=0.1, softcap=20.0)
        return a + kp_losses.fused_linear_cross_entropy(hidden, head, t, z_loss=1e-3, chunk_size=4)

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        with kp_core.record_launches() as rec:
            results.append(loss_and_grads(fn, [x, hidden, head], [], torch.tensor(1.0, device=DEVICE)))
        kc.assert_kernel_ran(rec, *CE_OPS)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reference_is_independent():
    """The references must not route through kp, and agree with torch (sanity check on the spec itself)."""
    x = 3 * torch.randn(4, 5, dtype=torch.float64)
    t = torch.tensor([0, 4, -100, 2])
    w = torch.rand(5, dtype=torch.float64)
    with kp_core.record_launches() as rec:
        for fn in (reference, reference64):
            for options in (dict(weight=None, label_smoothing=0.0), dict(weight=w, label_smoothing=0.3)):
                got = fn(x, t, options["weight"], -100, "mean", options["label_smoothing"], 0.0, None)
                want = F.cross_entropy(x, t, options["weight"], label_smoothing=options["label_smoothing"])
                torch.testing.assert_close(got, want)
    assert rec.count() == 0
