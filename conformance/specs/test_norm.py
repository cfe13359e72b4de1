"""Conformance spec for kp-norms' row norms: RMSNorm (torch, Gemma and Llama conventions), LayerNorm, the fused
residual add + norm, and norm + activation, forward and backward, against independent float64 references.

Each variant is a row of the matrix. Its reference is written here from the model family's definition in
plain float64 PyTorch; its "PyTorch in low precision" comparison is the same computation as the family's
own code runs it (HF's module forward order and casts), so the 2x rule measures us against that.
"""

import contextlib
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kp_conformance as kc
import kp_core
import kp_norms
from kp_conformance import fuzz
from kp_conformance.references import gelu64, gelu_tanh64, layer64, quantize_fp8, rms64, silu64
from kp_norms.ops import norm as norm_mod

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TIER = kc.current()
DEVICE = kc.device()
FWD, BWD, INPLACE = norm_mod.OP, norm_mod.OP_BWD, norm_mod.OP_INPLACE

kc.declare(
    kc.Spec(
        name="norm",
        package="kp-norms",
        ops=("kp::norm", "kp::norm_backward", "kp::add_norm_", "kp::norm_float8", "kp::norm_float8_backward"),
        reference=(
            "float64 formulas: RMSNorm (Zhang & Sennrich 2019, eq. 4; torch.nn.RMSNorm), Gemma's (1 + w) and "
            "Llama's cast-then-weight RMSNorm (HF modeling_gemma / modeling_llama), LayerNorm (Ba et al. 2016; "
            "torch.nn.LayerNorm), s = x + residual, SiLU / GELU (erf and tanh forms); the float8 copy: the float8 "
            "recipe's cast of the output in float32 PyTorch (kp_conformance.references.quantize_fp8)"
        ),
        dtypes=DTYPES,
        properties=(
            "values",
            "gradients",
            "float8_output",
            "mixed_dtypes",
            "in_place",
            "no_mutation",
            "determinism",
            "nan_inf",
            "zero_size",
            "bad_input",
            "opcheck",
            "compile",
        ),
    )
)


# ---- how each model family's own code computes it in low precision ----


def llama_lowp(x, w, eps):  # transformers' LlamaRMSNorm.forward (Mistral, Qwen2 and Qwen3 are the same)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def gemma_lowp(x, w, eps):  # transformers' GemmaRMSNorm.forward (Gemma 2 and 3 are the same)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


@dataclass(frozen=True)
class Variant:
    ours: Callable  # (x, r, w, b, eps) -> tuple of outputs
    ref: Callable  # same, float64 inputs
    lowp: Callable  # same, PyTorch in the input's precision
    residual: bool = False
    bias: bool = False
    eps_none_ok: bool = True  # RMSNorm's eps=None; LayerNorm takes a number
    needs_weight: bool = False  # Gemma's offset scales a weight


def _add(fn):
    """The fused add + norm: outputs (norm(x + r), x + r); x + r in the input dtype, as torch adds."""
    return lambda x, r, w, b, e: (fn(x + r, w, b, e), x + r)


VARIANTS = {
    "rms_norm": Variant(
        lambda x, r, w, b, e: (kp_norms.rms_norm(x, x.shape[-1:], w, e),),
        lambda x, r, w, b, e: (rms64(x, w, e),),
        lambda x, r, w, b, e: (F.rms_norm(x, x.shape[-1:], w, e),),
    ),
    "rms_norm[gemma]": Variant(
        lambda x, r, w, b, e: (kp_norms.rms_norm(x, x.shape[-1:], w, e, offset=1.0, casting="gemma"),),
        lambda x, r, w, b, e: (rms64(x, w, e, offset=1.0),),
        lambda x, r, w, b, e: (gemma_lowp(x, w, e),),
        eps_none_ok=False,
        needs_weight=True,
    ),
    "rms_norm[llama]": Variant(
        lambda x, r, w, b, e: (kp_norms.rms_norm(x, x.shape[-1:], w, e, casting="llama"),),
        lambda x, r, w, b, e: (rms64(x, w, e),),
        lambda x, r, w, b, e: (llama_lowp(x, w, e),),
        eps_none_ok=False,
        needs_weight=True,
    ),
    "layer_norm": Variant(
        lambda x, r, w, b, e: (kp_norms.layer_norm(x, x.shape[-1:], w, b, e),),
        lambda x, r, w, b, e: (layer64(x, w, b, e),),
        lambda x, r, w, b, e: (F.layer_norm(x, x.shape[-1:], w, b, e),),
        bias=True,
        eps_none_ok=False,
    ),
    "add_rms_norm": Variant(
        lambda x, r, w, b, e: kp_norms.add_rms_norm(x, r, w, e),
        _add(lambda s, w, b, e: rms64(s, w, e)),
        _add(lambda s, w, b, e: F.rms_norm(s, s.shape[-1:], w, e)),
        residual=True,
    ),
    "add_layer_norm": Variant(
        lambda x, r, w, b, e: kp_norms.add_layer_norm(x, r, w, b, e),
        _add(layer64),
        _add(lambda s, w, b, e: F.layer_norm(s, s.shape[-1:], w, b, e)),
        residual=True,
        bias=True,
        eps_none_ok=False,
    ),
    "rms_norm+silu": Variant(
        lambda x, r, w, b, e: (kp_norms.rms_norm(x, x.shape[-1:], w, e, activation="silu"),),
        lambda x, r, w, b, e: (silu64(rms64(x, w, e)),),
        lambda x, r, w, b, e: (F.silu(F.rms_norm(x, x.shape[-1:], w, e)),),
    ),
    "layer_norm+gelu": Variant(
        lambda x, r, w, b, e: (kp_norms.layer_norm(x, x.shape[-1:], w, b, e, activation="gelu"),),
        lambda x, r, w, b, e: (gelu64(layer64(x, w, b, e)),),
        lambda x, r, w, b, e: (F.gelu(F.layer_norm(x, x.shape[-1:], w, b, e)),),
        bias=True,
        eps_none_ok=False,
    ),
    "add_rms_norm[gemma]+gelu_tanh": Variant(
        lambda x, r, w, b, e: kp_norms.add_rms_norm(x, r, w, e, offset=1.0, activation="gelu_tanh"),
        _add(lambda s, w, b, e: gelu_tanh64(rms64(s, w, e, offset=1.0))),
        _add(lambda s, w, b, e: F.gelu(gemma_lowp(s, w, e), approximate="tanh")),
        residual=True,
        eps_none_ok=False,
        needs_weight=True,
    ),
}
NAMES = list(VARIANTS)


def effective_eps(eps, dtype):
    # PyTorch (and kp) take the compute dtype's epsilon when RMSNorm's eps is None.
    return eps if eps is not None else torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps


@dataclass
class Case:
    x: torch.Tensor
    r: torch.Tensor | None
    w: torch.Tensor | None
    b: torch.Tensor | None
    eps: float | None

    def inputs(self):
        return self.x, self.r, self.w, self.b

    def double(self):
        return [None if t is None else t.double() for t in self.inputs()]


def make_case(v: Variant, shape, dtype, layout, affine, eps, scale, seed, w_dtype=None, family="normal") -> Case:
    """affine: False, True (weight, and bias where the variant has one) or "bias" (a bias without weight)."""
    n = shape[-1:]
    x = kc.make_input(shape, dtype, DEVICE, layout, scale=scale, seed=seed, family=family)
    # A residual stream is larger than the block's output: it gets its own scale and layout.
    r = kc.make_input(shape, dtype, DEVICE, "contiguous", scale=3.0, seed=seed + 3) if v.residual else None
    affine = affine or v.needs_weight
    wd = w_dtype or dtype
    w = kc.make_input(n, wd, DEVICE, "contiguous", seed=seed + 1) if affine and affine != "bias" else None
    b = kc.make_input(n, wd, DEVICE, "contiguous", scale=0.5, seed=seed + 2) if affine and v.bias else None
    if eps is None and not v.eps_none_ok:
        eps = 1e-5
    return Case(x, r, w, b, eps)


def last_dim_shapes(tier, max_rows=None):
    """(shape, _) pairs from the shared strategy, kept to one normalised dim (the fused ops' contract)."""
    return kc.row_shapes(tier, max_rows).map(lambda sn: (sn[0][: len(sn[0]) - len(sn[1])] + (math.prod(sn[1]),), None))


case = dict(
    shape=last_dim_shapes(TIER),
    family=st.sampled_from(kc.FAMILIES),
    layout=st.sampled_from(kc.LAYOUTS),
    affine=st.booleans(),
    eps=st.sampled_from([None, 1e-6, 1e-5]),
    scale=st.sampled_from([1.0, 0.01, 30.0]),
    seed=st.integers(0, 2**16),
)
# Every variant gets the tier's draws on a GPU. Under the CPU interpreter (~100x slower) plain RMSNorm keeps
# them and the variants, which share its code paths, get a third, so the CI run stays within minutes.
EXAMPLES = {
    name: TIER.max_examples if name == "rms_norm" or not kc.interpreting() else max(4, TIER.max_examples // 3)
    for name in NAMES
}
# The looped cells push every width through the looped kernels, whose programs walk their rows one at a time in
# chunks. Under the interpreter that is a Python-level pass per row and chunk: one draw of 2046 rows x 7 columns
# took 45 s of its cell's 52. There the looped cells draw at most 64 rows, still many per program (4 programs
# off-GPU: the persistent row loop, an uneven last program, the partial sums across programs); GPU runs keep the
# tier's row counts. At ~1 s a draw there, they take as many draws as the fused cells (half of them on a GPU).
LOOPED_ROWS = 64 if kc.interpreting() else None
LOOPED_EXAMPLES = {name: EXAMPLES[name] if kc.interpreting() else max(3, EXAMPLES[name] // 2) for name in NAMES}


def _grads(fn, case: Case, cotangents):
    leaves = [None if t is None else t.detach().requires_grad_() for t in case.inputs()]
    outs = fn(*leaves, case.eps)
    torch.autograd.backward(outs, cotangents[: len(outs)])
    return outs, [None if t is None else t.grad for t in leaves]


def _assert_path(rec, looped: bool, backward: bool) -> None:
    """The fused or the looped kernels ran, as the case asked."""
    suffix = "_looped" if looped else ""
    assert rec.kernels(FWD) == {f"_norm_fwd{suffix}"}, f"expected the {suffix or 'fused'} forward, ran {rec.launches}"
    if backward:
        assert f"_norm_bwd{suffix}" in rec.kernels(BWD), (
            f"expected the {suffix or 'fused'} backward, ran {rec.launches}"
        )


def check_variant(v: Variant, name, dtype, c: Case, with_grads: bool, looped: bool | None = None):
    """One case by the rule; `looped`: which kernels must have run (default: the ones the row width selects)."""
    looped = c.x.shape[-1] > kp_core.MAX_FUSED_COLS if looped is None else looped
    e = effective_eps(c.eps, dtype)
    if not with_grads:
        with kp_core.record_launches() as rec:
            ours = v.ours(*c.inputs(), c.eps)
        if c.x.numel():
            kc.assert_kernel_ran(rec, FWD)
            _assert_path(rec, looped, backward=False)
        ref = v.ref(*c.double(), e)
        low = v.lowp(*c.inputs(), c.eps if c.eps is not None else None)
        for i, (a, r64, lo) in enumerate(zip(ours, ref, low)):
            kc.check_close(f"{name} output {i}", a, r64, lo, lo.dtype if i == 0 else dtype)
        return
    shape = c.x.shape
    out_dtype = v.lowp(*c.inputs(), c.eps)[0].dtype
    seed = int(c.x.numel()) % 1000
    cot = [kc.make_input(shape, out_dtype, DEVICE, "contiguous", seed=seed + 11)]
    if v.residual:
        cot.append(kc.make_input(shape, dtype, DEVICE, "contiguous", seed=seed + 12))
    with kp_core.record_launches() as rec:
        _, ours = _grads(lambda *a: v.ours(*a), c, cot)
    if c.x.numel():
        kc.assert_kernel_ran(rec, FWD, BWD)
        _assert_path(rec, looped, backward=True)
    c64 = Case(*c.double(), e)
    _, ref = _grads(lambda *a: v.ref(*a), c64, [t.double() for t in cot])
    _, low = _grads(lambda *a: v.lowp(*a), c, cot)
    for label, a, r64, lo in zip(("dx", "dresidual", "dw", "db"), ours, ref, low):
        if a is not None or r64 is not None:
            kc.check_close(f"{name} {label}", a, r64, lo, lo.dtype)


def looped_path(n: int):
    """Pins the row kernels to their looped (wide-row) form for rows of n columns: every width, every tier, reaches
    the looped kernels with whatever switches the case has, in chunks of at most a third of the row (so chunks
    merge), at least 16 columns."""
    return kp_core.pinned(
        "row_config", max_fused_cols=0, loop_block_cols=max(16, kp_core.next_power_of_2(kp_core.cdiv(n, 3)))
    )


def check_drawn_cases(name, dtype, with_grads: bool, looped: bool):
    """check_variant on the tier's Hypothesis draws (as many as EXAMPLES gives this variant), through the fused
    kernels as the row width picks them, or every row through the looped kernels."""
    kc.skip_if_not_covered(dtype)

    @settings(max_examples=LOOPED_EXAMPLES[name] if looped else EXAMPLES[name])
    @given(**{**case, "shape": last_dim_shapes(TIER, LOOPED_ROWS)} if looped else case)
    def run(shape, family, layout, affine, eps, scale, seed):
        c = make_case(VARIANTS[name], shape[0], dtype, layout, affine, eps, scale, seed, family=family)
        if looped:
            with looped_path(c.x.shape[-1]):
                check_variant(VARIANTS[name], name, dtype, c, with_grads=with_grads, looped=True)
        else:
            check_variant(VARIANTS[name], name, dtype, c, with_grads=with_grads)

    run()


def cells(prop, names=NAMES):
    """One parameter per variant, each marked as its own matrix row."""
    return [pytest.param(n, marks=pytest.mark.conformance(kernel=n, prop=prop), id=n) for n in names]


@pytest.mark.parametrize("name", cells("values"))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_values(name, dtype):
    check_drawn_cases(name, dtype, with_grads=False, looped=False)


@pytest.mark.parametrize("name", cells("gradients"))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_gradients(name, dtype):
    check_drawn_cases(name, dtype, with_grads=True, looped=False)


@pytest.mark.parametrize("name", cells("values, looped kernels"))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_values_looped(name, dtype):
    check_drawn_cases(name, dtype, with_grads=False, looped=True)


@pytest.mark.parametrize("name", cells("gradients, looped kernels"))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_gradients_looped(name, dtype):
    check_drawn_cases(name, dtype, with_grads=True, looped=True)


@pytest.mark.parametrize(
    "name",
    cells("gradients, bias without weight", [n for n in NAMES if VARIANTS[n].bias and not VARIANTS[n].needs_weight]),
)
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_gradients_bias_without_weight(name, dtype):
    """weight=None with a bias (F.layer_norm allows it): the backward's bias-only sums, fused and looped, in every
    tier (the drawn cases give weight and bias together)."""
    kc.skip_if_not_covered(dtype)
    c = make_case(VARIANTS[name], (5, 40), dtype, "contiguous", "bias", None, 1.0, seed=7)
    check_variant(VARIANTS[name], name, dtype, c, with_grads=True, looped=False)
    with looped_path(40):
        check_variant(VARIANTS[name], name, dtype, c, with_grads=True, looped=True)


@pytest.mark.parametrize(
    "name", cells("gradients, zero-variance rows", ["layer_norm", "add_layer_norm", "layer_norm+gelu"])
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=kc.dtype_id)
@pytest.mark.parametrize("looped", [False, True], ids=["fused", "looped"])
def test_gradients_zero_variance_row(name, dtype, looped):
    """One-column rows: the variance is 0, rstd = 1/sqrt(eps) (316) multiplies dx's cancellation dn - mean(dn),
    and PyTorch gets exactly 0 there. With dn = dz * w contracted into its uses (FMA) the kernel's float64 dx was
    1.5e-14 (bound 7.3e-15) on the H100; the interpreter rounds every product, so only a GPU run can fail here."""
    kc.skip_if_not_covered(dtype)
    c = make_case(VARIANTS[name], (2, 1), dtype, "contiguous", True, None, 1.0, seed=0)
    with looped_path(1) if looped else contextlib.nullcontext():
        check_variant(VARIANTS[name], name, dtype, c, with_grads=True, looped=looped)


FIXED_SHAPES = [(7, 33), (3, 5, 257), (2, 16385)]
LOW = (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("name", cells("mixed_dtypes", ["rms_norm", "rms_norm[llama]", "layer_norm", "add_rms_norm"]))
@pytest.mark.parametrize("dtype", LOW, ids=kc.dtype_id)
def test_mixed_dtypes(name, dtype):
    """fp32 weight (and bias) with a half-precision input, as torch allows; Llama's output is then fp32."""
    kc.skip_if_not_covered(dtype)
    v = VARIANTS[name]
    if name == "layer_norm":
        # torch's CUDA layer_norm refuses mixed dtypes (its CPU one accepts them): PyTorch's baseline is then
        # the fp32 computation rounded once, which is at least as accurate as any low-precision one.
        lowp = lambda x, r, w, b, e: (F.layer_norm(x.float(), x.shape[-1:], w, b, e).to(x.dtype),)  # noqa: E731
        v = dataclasses.replace(v, lowp=lowp)
    for i, shape in enumerate(FIXED_SHAPES):
        c = make_case(v, shape, dtype, "contiguous", True, 1e-6, 1.0, i, w_dtype=torch.float32)
        check_variant(v, name, dtype, c, with_grads=False)
        check_variant(v, name, dtype, c, with_grads=True)


ADD = {"add_rms_norm": kp_norms.add_rms_norm, "add_layer_norm": kp_norms.add_layer_norm}


@pytest.mark.parametrize("name", cells("in_place", list(ADD)))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_in_place(name, dtype):
    """in_place=True leaves the sum in `residual` and matches the out-of-place call to the bit, with and
    without autograd, eager and compiled, for layouts the kernel writes directly and ones it cannot."""
    kc.skip_if_not_covered(dtype)
    torch._dynamo.reset()
    fn = ADD[name]
    compiled = torch.compile(lambda x, r, w: fn(x, r, w, None, in_place=True), fullgraph=True)
    for i, (shape, layout) in enumerate(zip(FIXED_SHAPES, ("contiguous", "transposed", "row_strided"))):
        c = make_case(VARIANTS[name], shape, dtype, "contiguous", True, 1e-5, 1.0, i)
        r_in = kc.make_input(shape, dtype, DEVICE, layout, scale=3.0, seed=i + 3)
        y_ref, s_ref = fn(c.x, r_in, c.w)
        for call in (lambda x, r, w: fn(x, r, w, in_place=True), compiled):
            r = kc.make_input(shape, dtype, DEVICE, layout, scale=3.0, seed=i + 3)  # a fresh buffer, same layout
            x0 = c.x.clone()
            with torch.no_grad(), kp_core.record_launches() as rec:
                y, s = call(c.x, r, c.w)
            # The in-place op writes into residual where a (rows, N) view of it exists; else kp::norm and a copy.
            kc.assert_kernel_ran(rec, FWD if layout == "transposed" else INPLACE)
            assert s is r or call is compiled, "in_place must return the residual tensor itself"
            assert torch.equal(r, s_ref) and torch.equal(y, y_ref), "in-place result differs from out-of-place"
            assert torch.equal(c.x, x0), "input was modified"
        # With autograd: the same values and gradients as out of place.
        dy = kc.make_input(shape, dtype, DEVICE, "contiguous", seed=i + 9)
        grads = []
        for in_place in (False, True):
            x, w = c.x.clone().requires_grad_(), c.w.clone().requires_grad_()
            r0 = r_in.clone().requires_grad_()
            r = r0 * 1  # a non-leaf, as a residual stream is
            with kp_core.record_launches() as rec:
                y, s = fn(x, r, w, in_place=in_place)
                (y.float().sum() + (s.float() * dy.float()).sum()).backward()
            kc.assert_kernel_ran(rec, FWD, BWD)
            assert (s is r) == in_place
            grads.append((y.detach(), s.detach(), x.grad, r0.grad, w.grad))
        for a, b in zip(*grads):
            assert torch.equal(a, b), "in_place=True changed a value or gradient"


@pytest.mark.conformance(kernel="norm", prop="no_mutation")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("layout", kc.LAYOUTS)
def test_no_mutation(dtype, layout):
    kc.skip_if_not_covered(dtype)
    for name, v in VARIANTS.items():
        for i, shape in enumerate(FIXED_SHAPES[:2]):
            c = make_case(v, shape, dtype, layout, True, 1e-5, 1.0, i)
            before = [None if t is None else t.clone() for t in c.inputs()]
            leaves = [None if t is None else t.clone().requires_grad_() for t in c.inputs()]
            with kp_core.record_launches() as rec:
                v.ours(*c.inputs(), c.eps)  # forward alone on the originals
                out = v.ours(*leaves, c.eps)
                sum(o.float().sum() for o in out).backward()
            kc.assert_kernel_ran(rec, FWD, BWD)
            for t, b in zip(c.inputs(), before):
                assert t is None or torch.equal(t, b), f"{name}: an input was modified"


@pytest.mark.parametrize("name", cells("determinism", ["rms_norm", "layer_norm", "add_layer_norm"]))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_determinism(name, dtype):
    """Bitwise-equal results on repeated calls, weight and bias gradients included (no atomics). Off-GPU 9 rows:
    the interpreter runs programs in order, so more rows prove nothing more there (4 programs of 2-3 rows each
    still write and sum their partials)."""
    kc.skip_if_not_covered(dtype)
    rows = 4096 if DEVICE.type == "cuda" else 9
    v = VARIANTS[name]
    for i, n in enumerate((4097, 20000)):
        c = make_case(v, (rows, n), dtype, "contiguous", True, 1e-5, 1.0, i)
        dy = kc.make_input((rows, n), dtype, DEVICE, "contiguous", seed=i + 3)
        outs = []
        for _ in range(2):
            leaves = [None if t is None else t.clone().requires_grad_() for t in c.inputs()]
            with kp_core.record_launches() as rec:
                out = v.ours(*leaves, c.eps)
                out[0].backward(dy)
            kc.assert_kernel_ran(rec, FWD, BWD)
            outs.append([out[0].detach()] + [t.grad for t in leaves if t is not None])
        for a, b in zip(*outs):
            assert torch.equal(a, b), "repeated calls differ"


@pytest.mark.parametrize("name", cells("nan_inf", ["rms_norm", "layer_norm", "add_rms_norm"]))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_nan_inf_propagate_per_row(name, dtype):
    kc.skip_if_not_covered(dtype)
    v = VARIANTS[name]
    for n in (33, 4096, 20000):
        c = make_case(v, (5, n), dtype, "contiguous", True, 1e-5, 1.0, n)
        c.x[1, 3] = float("nan")
        c.x[3, 0] = float("inf")
        c.x[4, n - 1] = float("-inf")
        with kp_core.record_launches() as rec:
            y = v.ours(*c.inputs(), c.eps)[0]
        kc.assert_kernel_ran(rec, FWD)
        ref = v.ref(*c.double(), effective_eps(c.eps, dtype))[0]
        assert torch.equal(torch.isnan(y).cpu(), torch.isnan(ref).cpu()), "NaN pattern differs from the reference"
        assert torch.equal(torch.isinf(y).cpu(), torch.isinf(ref).cpu()), "Inf pattern differs from the reference"
        clean = [0, 2]  # rows with only finite values stay correct
        low = v.lowp(*c.inputs(), c.eps)[0]
        kc.check_close("finite rows", y[clean], ref[clean], low[clean], dtype)


@pytest.mark.parametrize("name", cells("zero_size"))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_zero_size(name, dtype):
    v = VARIANTS[name]
    for shape in [(0, 8), (3, 0, 5), (4, 0)]:
        c = make_case(v, shape, dtype, "contiguous", True, 1e-5, 1.0, 0)
        leaves = [None if t is None else t.clone().requires_grad_() for t in c.inputs()]
        with kp_core.record_launches() as rec:
            out = v.ours(*leaves, c.eps)
            sum(o.sum() for o in out).backward()
        # Documented behaviour: an empty input launches no kernel (nothing to compute, no empty grid).
        assert rec.backends() <= {kp_core.REFERENCE}, f"an empty input launched {rec.launches}"
        expected = v.lowp(*c.inputs(), c.eps)
        for a, b in zip(out, expected):
            assert a.shape == b.shape and a.dtype == b.dtype
        assert leaves[0].grad.shape == c.x.shape
        if c.w is not None and shape[-1]:
            assert torch.equal(leaves[2].grad, torch.zeros_like(c.w)), "an empty batch must give a zero dw"


def _rand(d, *shape):
    return torch.randn(shape, device=d)


FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what the norms take
FLOAT8_IN = (torch.float16, torch.bfloat16, torch.float32)
INPUT = fuzz.Tensor(FLOAT, sized=(1,), ranked=False, words=("normalized_shape",), first=True)
ROW = fuzz.Tensor(FLOAT, sized=(0,))  # weight, bias
NAMES = fuzz.Scalar(bad=((17,), (0,), [16, 1], "16", None, 16.0))
EPS = fuzz.Scalar(bad=("1e-6", 1j, [1e-6]))  # any real number is taken, as torch takes it
ACTIVATION = fuzz.Scalar(bad=("relu", 1))


def _add(norm):
    """torch's add + norm: (norm(input + residual), input + residual)."""

    def run(input, residual, **kw):
        s = input + residual
        return norm(s, (s.shape[-1],), **kw), s

    return run


def _module(cls, *args, **kw):
    return lambda d: {"module": cls(*args, device=d, **kw), "input": _rand(d, 3, 16)}


NORM_TARGETS = [
    fuzz.Target(
        "kp_norms.rms_norm",
        "kp-norms",
        kp_norms.rms_norm,
        lambda d: dict(input=_rand(d, 3, 16), normalized_shape=(16,), weight=_rand(d, 16), eps=1e-6),
        dict(input=INPUT, normalized_shape=NAMES, weight=ROW, eps=EPS),
        torch_fn=F.rms_norm,
        zero=lambda d: dict(input=_rand(d, 0, 16), normalized_shape=(16,), weight=_rand(d, 16), eps=1e-6),
    ),
    fuzz.Target(
        "kp_norms.rms_norm(offset, casting, activation)",
        "kp-norms",
        kp_norms.rms_norm,
        lambda d: dict(
            input=_rand(d, 3, 16),
            normalized_shape=16,
            weight=_rand(d, 16),
            offset=1.0,
            casting="llama",
            activation="silu",
        ),
        dict(
            weight=ROW,
            offset=fuzz.Scalar(bad=(math.inf, "1")),
            casting=fuzz.Scalar(bad=("bf16", None)),
            activation=ACTIVATION,
        ),
    ),
    fuzz.Target(
        "kp_norms.layer_norm",
        "kp-norms",
        kp_norms.layer_norm,
        lambda d: dict(input=_rand(d, 3, 16), normalized_shape=(16,), weight=_rand(d, 16), bias=_rand(d, 16)),
        dict(input=INPUT, normalized_shape=NAMES, weight=ROW, bias=ROW, eps=EPS, activation=ACTIVATION),
        torch_fn=F.layer_norm,
        zero=lambda d: dict(input=_rand(d, 2, 0, 16), normalized_shape=(16,)),
    ),
    fuzz.Target(
        "kp_norms.add_rms_norm",
        "kp-norms",
        kp_norms.add_rms_norm,
        lambda d: dict(input=_rand(d, 3, 16), residual=_rand(d, 3, 16), weight=_rand(d, 16), eps=1e-6),
        dict(
            input=fuzz.Tensor(FLOAT, ranked=False, first=True),
            residual=fuzz.Tensor(FLOAT, sized=(0, 1)),
            weight=ROW,
            eps=EPS,
            activation=ACTIVATION,
            in_place=fuzz.Scalar(bad=(1, "yes")),
        ),
        torch_fn=_add(F.rms_norm),
        zero=lambda d: dict(input=_rand(d, 0, 16), residual=_rand(d, 0, 16)),
        aliases=(("input", "residual"),),
    ),
    fuzz.Target(
        "kp_norms.add_layer_norm",
        "kp-norms",
        kp_norms.add_layer_norm,
        lambda d: dict(input=_rand(d, 3, 16), residual=_rand(d, 3, 16), weight=_rand(d, 16), bias=_rand(d, 16)),
        dict(
            input=fuzz.Tensor(FLOAT, ranked=False, first=True),
            residual=fuzz.Tensor(FLOAT, sized=(0, 1)),
            weight=ROW,
            bias=ROW,
            eps=EPS,
        ),
        torch_fn=_add(F.layer_norm),
        aliases=(("input", "residual"),),
    ),
    fuzz.Target(
        "kp_norms.norm_float8",
        "kp-norms",
        kp_norms.norm_float8,
        lambda d: dict(input=_rand(d, 3, 16), weight=_rand(d, 16), residual=_rand(d, 3, 16)),
        dict(
            input=fuzz.Tensor(FLOAT8_IN, ranked=False, first=True),
            weight=ROW,
            residual=fuzz.Tensor(FLOAT8_IN, sized=(0, 1)),
            kind=fuzz.Scalar(bad=("batch", None)),
            granularity=fuzz.Scalar(bad=("blockwise",)),
            float8_dtype=fuzz.Scalar(bad=(torch.int8, torch.float16, "e4m3")),
            power_of_2=fuzz.Scalar(bad=(1, "yes")),
            activation=ACTIVATION,
        ),
        zero=lambda d: dict(input=_rand(d, 0, 16)),
        aliases=(("input", "residual"),),
    ),
    fuzz.Target(
        "kp_norms.RMSNorm",
        "kp-norms",
        lambda module, input: module(input),
        _module(kp_norms.RMSNorm, 16, eps=1e-6),
        dict(input=INPUT),
        torch_fn=lambda module, input: F.rms_norm(input, (16,), module.weight.to(input.dtype), 1e-6),
    ),
    fuzz.Target(
        "kp_norms.LayerNorm",
        "kp-norms",
        lambda module, input: module(input),
        _module(kp_norms.LayerNorm, 16),
        dict(input=INPUT),
        torch_fn=lambda module, input: F.layer_norm(input, (16,), module.weight.to(input), module.bias.to(input)),
    ),
    fuzz.Target(
        "kp_norms.RMSNorm(...)",
        "kp-norms",
        kp_norms.RMSNorm,
        lambda d: dict(normalized_shape=16, eps=1e-6, device=d),
        dict(normalized_shape=fuzz.Scalar(bad=(-1, (), "16", None, 16.0)), eps=EPS, casting=fuzz.Scalar(bad=("bf16",))),
        launches=False,
    ),
]


test_bad_input_fuzz = kc.fuzz_test("norm", NORM_TARGETS)


OPCHECK_FLAGS = [  # (residual, bias, rms, offset, round_n, act, weight dtype)
    (False, False, True, 0.0, False, 0, None),
    (False, True, False, 0.0, False, 2, None),
    (True, False, True, 1.0, False, 3, None),
    (True, True, False, 0.0, False, 1, None),
    (False, False, True, 0.0, True, 0, torch.float32),
]


@pytest.mark.conformance(kernel="norm", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    kc.skip_if_not_covered(dtype)
    for i, (has_r, has_b, rms, offset, round_n, act, wd) in enumerate(OPCHECK_FLAGS):
        layout = kc.LAYOUTS[i % 3]
        x = kc.make_input((37, 130), dtype, DEVICE, layout, seed=i).requires_grad_()
        r = kc.make_input((37, 130), dtype, DEVICE, "contiguous", seed=i + 1).requires_grad_() if has_r else None
        w = kc.make_input((130,), wd or dtype, DEVICE, "contiguous", seed=i + 2).requires_grad_()
        b = kc.make_input((130,), wd or dtype, DEVICE, "contiguous", seed=i + 3) if has_b else None
        flags = (1e-5, rms, offset, round_n, act)
        with kp_core.record_launches() as rec:
            bg = None if b is None else b.clone().requires_grad_()
            torch.library.opcheck(norm_mod.NORM.op, (x, r, w, bg, *flags, True))
            r = None if r is None else r.detach()
            y, s, mean, rstd = norm_mod.NORM.op(x.detach(), r, w.detach(), b, *flags, True)
            dy = kc.make_input((37, 130), y.dtype, DEVICE, layout, seed=i + 4)
            ds = kc.make_input((37, 130), dtype, DEVICE, layout, seed=i + 5) if has_r else None
            src = s if has_r else x.detach()
            backward_args = (dy, ds, src, w.detach(), b, mean, rstd, *flags, True)
            torch.library.opcheck(norm_mod.NORM.backward_op, backward_args)
            if has_r:
                res = r.detach().clone()
                torch.library.opcheck(norm_mod.ADD_NORM_.op, (x.detach(), res, w.detach(), b, *flags))
                kc.assert_kernel_ran(rec, INPLACE)
        kc.assert_kernel_ran(rec, FWD, BWD)


@pytest.mark.parametrize("name", cells("compile", ["rms_norm", "rms_norm[llama]", "layer_norm+gelu", "add_layer_norm"]))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_compile_fullgraph_equals_eager(name, dtype):
    kc.skip_if_not_covered(dtype)
    torch._dynamo.reset()
    v = VARIANTS[name]

    def f(x, r, w, b):
        return v.ours(x * 2, r, w, b, 1e-6)

    compiled = torch.compile(f, fullgraph=True)
    for layout, shape in zip(("contiguous", "transposed"), FIXED_SHAPES[:2]):
        c = make_case(v, shape, dtype, layout, True, 1e-6, 1.0, 5)
        results = []
        for fn in (f, compiled):
            leaves = [None if t is None else t.clone().requires_grad_() for t in c.inputs()]
            with kp_core.record_launches() as rec:
                out = fn(*leaves)
                sum((o.float() * (k + 1)).sum() for k, o in enumerate(out)).backward()
            kc.assert_kernel_ran(rec, FWD, BWD)
            results.append([o.detach() for o in out] + [t.grad for t in leaves if t is not None])
        for a, b in zip(*results):
            # The op is opaque to the compiler, so the same kernel computes both: results match to the bit
            # except for what Inductor fuses around it (x * 2), which is exact in every dtype here.
            assert torch.equal(a, b), f"compiled differs from eager by {(a.double() - b.double()).abs().max():.3e}"


# ---- the float8 copy of the output (kp::norm_float8) ----

FP8_FWD, FP8_BWD = norm_mod.OP_FP8, norm_mod.OP_FP8_BWD
FP8_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT8_ARGS = {  # norm_float8's arguments for each variant: the same norm as the variant's own function
    "rms_norm": dict(kind="rms"),
    "rms_norm[gemma]": dict(kind="rms", offset=1.0, casting="gemma"),
    "rms_norm[llama]": dict(kind="rms", casting="llama"),
    "layer_norm": dict(kind="layer"),
    "add_rms_norm": dict(kind="rms"),
    "add_layer_norm": dict(kind="layer"),
    "rms_norm+silu": dict(kind="rms", activation="silu"),
    "layer_norm+gelu": dict(kind="layer", activation="gelu"),
    "add_rms_norm[gemma]+gelu_tanh": dict(kind="rms", offset=1.0, activation="gelu_tanh"),
}


def bits_equal(what, ours, ref):
    """Bit for bit (float8 as bytes; NaN equal to NaN)."""
    if ours.dtype in FP8:
        ours, ref = ours.view(torch.uint8), ref.view(torch.uint8)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


def check_float8(name, c: Case, granularity, fp8, power_of_2, looped, soft=None, with_grads=False):
    """norm_float8 on one case: the kernels asked for ran; output (and sum) bit for bit the variant's own kp
    function's (held to the rule against float64 by test_values) and by the rule here too; the float8 copy bit for
    bit the recipe's cast of that output; with_grads: the gradients bit for bit the variant's function's."""
    v = VARIANTS[name]

    def path():
        return looped_path(c.x.shape[-1]) if looped else contextlib.nullcontext()

    convert = contextlib.nullcontext() if soft is None else kp_core.pinned("fp8_convert", soft=soft)
    cast = dict(float8_dtype=fp8, granularity=granularity, power_of_2=power_of_2)
    leaves = [None if t is None else t.detach().requires_grad_(with_grads) for t in c.inputs()]
    x, r, w, b = leaves
    with path(), convert, kp_core.record_launches() as rec:
        out = kp_norms.norm_float8(x, w, b, c.eps, residual=r, **FLOAT8_ARGS[name], **cast)
    if c.x.numel():
        kc.assert_kernel_ran(rec, FP8_FWD)
        expected = {"_norm_fwd_looped" if looped else "_norm_fwd"}
        if looped or granularity == "tensorwise":
            expected.add("_cast_float8")
        assert rec.kernels(FP8_FWD) == expected, f"expected {expected}, ran {rec.launches}"
    plain_leaves = [None if t is None else t.detach().requires_grad_(with_grads) for t in c.inputs()]
    with path():
        plain = v.ours(*plain_leaves, c.eps)
    outs = (out.output,) if not v.residual else (out.output, out.sum)
    for i, (a, p) in enumerate(zip(outs, plain)):
        bits_equal(f"{name} output {i} against the plain function", a, p)
    ref = v.ref(*c.double(), effective_eps(c.eps, c.x.dtype))
    low = v.lowp(*c.inputs(), c.eps)
    for i, (a, r64, lo) in enumerate(zip(outs, ref, low)):
        kc.check_close(f"{name} output {i}", a, r64, lo, lo.dtype if i == 0 else c.x.dtype)
    data, scale, amax = quantize_fp8(out.output.detach(), fp8, granularity, None, None, power_of_2)
    assert out.data.dtype == fp8 and out.scale.shape == scale.shape and out.amax.shape == amax.shape
    bits_equal(f"{name} float8 data", out.data, data)
    bits_equal(f"{name} float8 scale", out.scale, scale)
    bits_equal(f"{name} float8 amax", out.amax, amax)
    if with_grads and c.x.numel():
        seed = int(c.x.numel()) % 1000
        cot = [kc.make_input(o.shape, o.dtype, DEVICE, "contiguous", seed=seed + 21 + k) for k, o in enumerate(outs)]
        with path(), kp_core.record_launches() as rec:
            torch.autograd.backward(outs, cot)
        kc.assert_kernel_ran(rec, FP8_BWD)
        with path():
            torch.autograd.backward(plain, cot)
        for label, a, p in zip(("dx", "dresidual", "dw", "db"), leaves, plain_leaves):
            if a is not None:
                bits_equal(f"{name} {label} against the plain function", a.grad, p.grad)


@pytest.mark.parametrize("name", cells("float8_output"))
@pytest.mark.parametrize("dtype", FP8_INPUTS, ids=kc.dtype_id)
def test_float8_output(name, dtype):
    """The tier's draws of each variant, with a drawn float8 format, granularity, power-of-two scales, row path
    (fused or looped) and, on a GPU, float8 conversion (the hardware's or kp's integer one)."""
    kc.skip_if_not_covered(dtype)

    @settings(max_examples=max(3, EXAMPLES[name] // 2))
    @given(
        **case,
        granularity=st.sampled_from(["tensorwise", "rowwise"]),
        fp8=st.sampled_from(FP8),
        power_of_2=st.booleans(),
        looped=st.booleans(),
        soft=st.sampled_from([None] if kc.interpreting() else [None, True]),
        with_grads=st.booleans(),
    )
    def run(shape, family, layout, affine, eps, scale, seed, granularity, fp8, power_of_2, looped, soft, with_grads):
        c = make_case(VARIANTS[name], shape[0], dtype, layout, affine, eps, scale, seed, family=family)
        check_float8(name, c, granularity, fp8, power_of_2, looped, soft, with_grads)

    run()


def exact_rows(n_rows: int, n: int, fp8) -> Case:
    """Rows of +-2**j (mean 0, rms 2**j) and a weight of values the float8 format holds, eps 0: every output,
    scaled by a power of two, is a float8 value, so any correct rounding of it is exact."""
    j = torch.arange(n_rows, dtype=torch.float64)[:, None] - n_rows // 2
    signs = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(n // 2)
    x = (torch.exp2(j) * signs).float().to(DEVICE)
    w = torch.tensor([0.5, 1.0, 1.5, -2.0, 3.0, -0.75, 1.75, 0.25], dtype=torch.float32).repeat(n // 8).to(DEVICE)
    return Case(x, None, w, None, 0.0)


@pytest.mark.conformance(kernel="rms_norm", prop="float8_output")
@pytest.mark.parametrize("fp8", FP8, ids=kc.dtype_id)
def test_float8_conversions_agree(fp8):
    """Both float8 conversions (the hardware's, kp's integer one) in the fused and looped paths, tensorwise and
    rowwise, on outputs every correct rounding gets exact (under the interpreter too, whose own float8 rounding
    is not torch's); power-of-two scales off with the default conversion, on any input: rows of 48 columns (masked
    lanes in every tile), one of them all zero (amax 0), and a single row (one program writes the one scale)."""
    for name in ("rms_norm", "layer_norm"):
        c = exact_rows(6, 64, fp8)
        drawn = make_case(VARIANTS[name], (6, 48), torch.float32, "contiguous", True, 1e-5, 1.0, 9)
        drawn.x[2] = 0.0
        for granularity in ("tensorwise", "rowwise"):
            for looped in (False, True):
                for soft in (False, True):
                    check_float8(name, c, granularity, fp8, True, looped, soft)
                check_float8(name, drawn, granularity, fp8, False, looped)
                check_float8(name, dataclasses.replace(drawn, x=drawn.x[3:4]), granularity, fp8, False, looped)


@pytest.mark.conformance(kernel="rms_norm", prop="float8_output")
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=kc.dtype_id)
def test_float8_wide_rows(dtype):
    """Rows of 4096 half-precision values, rowwise, in the fused kernel: there the float8 store can pick the
    tile's layout and with it the order of the row sums (on an H200 it did: 19 of 4M outputs 1 ulp off kp's
    rms_norm at 1024 rows); the output must stay the plain function's bit for bit. 1024 rows on a GPU."""
    kc.skip_if_not_covered(dtype)
    rows = 8 if kc.interpreting() else 1024
    for name in ("rms_norm", "add_rms_norm"):
        c = make_case(VARIANTS[name], (rows, 4096), dtype, "contiguous", True, 1e-6, 1.0, 5)
        check_float8(name, c, "rowwise", torch.float8_e4m3fn, False, False)


@pytest.mark.conformance(kernel="rms_norm", prop="opcheck")
@pytest.mark.parametrize("granularity", ["tensorwise", "rowwise"])
def test_opcheck_float8(granularity):
    x = kc.make_input((37, 128), torch.float32, DEVICE, "contiguous", seed=3).requires_grad_()
    w = kc.make_input((128,), torch.float32, DEVICE, "contiguous", seed=4).requires_grad_()
    args = (x, None, w, None, 1e-5, True, 0.0, False, 0, True, torch.float8_e4m3fn, granularity == "rowwise", False)
    with kp_core.record_launches() as rec:
        torch.library.opcheck(norm_mod.NORM_FLOAT8.op, args)
    kc.assert_kernel_ran(rec, FP8_FWD, FP8_BWD)


@pytest.mark.conformance(kernel="rms_norm", prop="compile")
def test_compile_float8_equals_eager():
    torch._dynamo.reset()

    def f(x, w):
        out = kp_norms.norm_float8(x * 2, w, None, 1e-6, granularity="rowwise")
        return out.output, out.data.float() * out.scale

    compiled = torch.compile(f, fullgraph=True)
    x = kc.make_input((4, 9, 64), torch.float32, DEVICE, "contiguous", seed=1)
    w = kc.make_input((64,), torch.float32, DEVICE, "contiguous", seed=2)
    results = []
    for fn in (f, compiled):
        with kp_core.record_launches() as rec:
            results.append(fn(x, w))
        kc.assert_kernel_ran(rec, FP8_FWD)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_reference_is_independent():
    """The references must not route through kp (sanity check on the spec itself)."""
    x = torch.randn(3, 8, dtype=torch.float64)
    with kp_core.record_launches() as rec:
        for v in VARIANTS.values():
            v.ref(x, x, x[0], x[1], 1e-6)
    assert rec.count() == 0
    assert math.isclose(rms64(torch.ones(1, 4, dtype=torch.float64), None, 0.0)[0, 0].item(), 1.0)
    assert math.isclose(layer64(torch.tensor([[1.0, 3.0]], dtype=torch.float64), None, None, 0.0)[0, 1].item(), 1.0)
