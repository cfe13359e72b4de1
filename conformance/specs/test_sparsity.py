"""Conformance spec for kp-sparsity's 2:4 pruning and packing (kp::prune_2_4).

Masks are checked exactly against a plain-PyTorch selection (a stable descending sort of the float32 scores
per group of 4: ties to the lower index, NaN kept; kp_conformance.references.mask_2_4), pruned weights exactly
against the weight masked by it, and the packed form exactly: it unpacks (PyTorch's own CUTLASS conversion) to
the pruned weight, and where every kept value is nonzero its values and metadata are PyTorch's own packing of
the pruned weight bit for bit.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.sparse._semi_structured_conversions import (
    sparse_semi_structured_from_dense_cutlass,
    sparse_semi_structured_to_dense_cutlass,
)

import kp_conformance as kc
import kp_core
import kp_sparsity
from kp_conformance import fuzz
from kp_conformance.references import (
    block_scores_2_4,
    blocks_of,
    cusparselt_compressed,
    sparse_activation_step,
    sparse_training_step,
    transposable_patterns,
)
from kp_conformance.references import mask_2_4 as ref_mask
from kp_sparsity.ops import cusparselt
from kp_sparsity.ops import prune as prune_mod

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
PACK = (torch.float16, torch.bfloat16)
DEVICE = kc.device()
OP = "kp::prune_2_4"
OP_T = "kp::mask_2_4_transposable"
OP_C = "kp::pack_2_4_cusparselt"

kc.declare(
    kc.Spec(
        name="sparsity",
        package="kp-sparsity",
        ops=(OP, OP_T, OP_C),
        reference=(
            "plain PyTorch: per group of 4 along the reduction dim, a stable descending sort of the float32 scores "
            "(|w|, times column_scale for Wanda; NaN as +inf) keeps the first 2; PyTorch's own CUTLASS "
            "semi-structured conversion for the packed form"
        ),
        dtypes=DTYPES,
        properties=(
            "mask",
            "prune",
            "pack",
            "transposable",
            "training",
            "activations",
            "pack_cusparselt",
            "no_mutation",
            "zero_size",
            "bad_input",
            "opcheck",
            "compile",
        ),
    )
)


@st.composite
def weights(draw, packed=False):
    rows = draw(st.sampled_from([32, 64, 96])) if packed else draw(st.integers(1, 70))
    cols = 64 * draw(st.integers(1, 3)) if packed else 4 * draw(st.integers(1, 66))
    family = draw(st.sampled_from(kc.FAMILIES + ("ties",)))
    return dict(
        shape=(rows, cols),
        family=family,
        layout=draw(st.sampled_from(("contiguous", "row_strided"))),
        wanda=draw(st.booleans()),
        nan=draw(st.integers(0, 5)) == 0,
        seed=draw(st.integers(0, 2**16)),
    )


def make(c, dtype):
    if c["family"] == "ties":  # few distinct magnitudes: most groups hold equal scores
        g = torch.Generator().manual_seed(c["seed"])
        w = (torch.randint(-2, 3, c["shape"], generator=g) * 0.5).to(dtype).to(DEVICE)
    else:
        w = kc.make_input(c["shape"], dtype, DEVICE, c["layout"], seed=c["seed"], family=c["family"])
    if c["nan"]:
        w[c["seed"] % w.shape[0], c["seed"] % w.shape[1]] = float("nan")
    scale = None
    if c["wanda"]:
        g = torch.Generator().manual_seed(c["seed"] + 1)
        scale = torch.rand(c["shape"][1], generator=g).to(DEVICE)
        scale[:: max(1, c["shape"][1] // 5)] = 0.0  # a feature never active: its weights score 0
    return w, scale


def run(fn, *args, op=OP, **kw):
    """fn's result, with the proof that kp's kernel (not the reference path) ran."""
    with kp_core.record_launches() as rec:
        out = fn(*args, **kw)
    kc.assert_kernel_ran(rec, op)
    return out


def assert_same(what, ours, ref):
    torch.testing.assert_close(ours, ref, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}: {m}")


@pytest.mark.conformance(kernel="prune_2_4", prop="mask")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=weights())
def test_mask(dtype, c):
    w, scale = make(c, dtype)
    mask = run(kp_sparsity.mask_2_4, w, column_scale=scale)
    assert mask.dtype == torch.bool and mask.shape == w.shape
    assert torch.equal(mask, ref_mask(w, scale))
    assert bool((mask.view(-1, 4).sum(-1) == 2).all())


@pytest.mark.conformance(kernel="prune_2_4", prop="prune")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=weights())
def test_prune(dtype, c):
    w, scale = make(c, dtype)
    before = w.clone()
    pruned = run(kp_sparsity.prune_2_4, w, column_scale=scale)
    assert_same("pruned", pruned, torch.where(ref_mask(w, scale), w, torch.zeros_like(w)))
    assert_same("the input (not changed)", w, before)


@pytest.mark.conformance(kernel="prune_2_4", prop="pack")
@pytest.mark.parametrize("dtype", PACK, ids=kc.dtype_id)
@given(c=weights(packed=True))
def test_pack(dtype, c):
    w, scale = make(c, dtype)
    values, meta = run(kp_sparsity.pack_2_4, w, column_scale=scale)
    pruned = torch.where(ref_mask(w, scale), w, torch.zeros_like(w))
    assert values.shape == (w.shape[0], w.shape[1] // 2) and meta.shape == (w.shape[0], w.shape[1] // 16)
    assert_same("unpacked", sparse_semi_structured_to_dense_cutlass(values, meta), pruned)
    if bool(((pruned != 0).view(-1, 4).sum(-1) == 2).all()):  # no kept zero: the packing is unique
        ref_values, ref_meta = sparse_semi_structured_from_dense_cutlass(pruned)
        assert_same("values", values, ref_values)
        assert torch.equal(meta, ref_meta), "metadata differs from PyTorch's CUTLASS packing"


@pytest.mark.conformance(kernel="prune_2_4", prop="pack")
@pytest.mark.parametrize("dtype", PACK, ids=kc.dtype_id)
def test_pack_layout_matches_pytorch(dtype):
    """Every group's two kept values nonzero: values and metadata equal PyTorch's CUTLASS packing bit for bit, for
    several tiles in both directions (the metadata's reordering spans 32 rows and pairs of 16-column groups)."""
    g = torch.Generator().manual_seed(3)
    sign = torch.randint(0, 2, (160, 320), generator=g) * 2 - 1
    w = ((torch.rand(160, 320, generator=g) + 0.5) * sign).to(dtype).to(DEVICE)
    values, meta = run(kp_sparsity.pack_2_4, w)
    ref_values, ref_meta = sparse_semi_structured_from_dense_cutlass(torch.where(ref_mask(w), w, torch.zeros_like(w)))
    assert_same("values", values, ref_values)
    assert torch.equal(meta, ref_meta)


@st.composite
def square_blocks(draw):
    c = draw(weights())
    rows = 4 * draw(st.integers(1, 20))
    return {**c, "shape": (rows, c["shape"][1])}


@pytest.mark.conformance(kernel="mask_2_4_transposable", prop="transposable")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(c=square_blocks())
def test_transposable(dtype, c):
    """Every 4 x 4 block keeps 2 per row and per column; its pattern's float64 score is the best one's up to
    float32 rounding of the kernel's sums; where the best beats the runner-up by more than that, and on exact
    ties (the "ties" family without Wanda scales or a NaN sums exactly in float32), the block is the reference's:
    the first best pattern in the documented order."""
    w, scale = make(c, dtype)
    mask = run(kp_sparsity.mask_2_4, w, column_scale=scale, transposable=True, op=OP_T)
    blocks = blocks_of(mask).view(-1, 4, 4)
    assert bool((blocks.sum(1) == 2).all()) and bool((blocks.sum(2) == 2).all()), "not 2:4 in both directions"
    pats = transposable_patterns().to(mask.device)
    scores = block_scores_2_4(w, scale)  # (blocks, 90) float64
    ours = (blocks_of(mask).double() @ pats.T.double()).argmax(-1)  # the pattern kp chose (rows are one-hot)
    assert torch.equal(pats[ours].bool(), blocks_of(mask)), "a block is not one of the 90 patterns"
    top2 = scores.topk(2, dim=-1).values
    slack = 1e-6 * scores.abs().max(-1).values  # float32 rounding of 8-term sums, with room
    chosen = scores.gather(-1, ours[:, None])[:, 0]
    assert bool((chosen >= top2[:, 0] - slack).all()), "a block's pattern is not the best one"
    exact = c["family"] == "ties" and not c["wanda"] and not c["nan"]  # sums of multiples of 0.5: exact in fp32
    clear = (top2[:, 0] - top2[:, 1] > slack) | exact
    best = scores.argmax(-1)  # the first of equal maxima
    assert torch.equal(ours[clear], best[clear])
    pruned = run(kp_sparsity.prune_2_4, w, column_scale=scale, transposable=True, op=OP_T)
    assert_same("pruned", pruned, torch.where(mask, w, torch.zeros_like(w)))


@st.composite
def training_cases(draw, sparse):
    unit = (64, 64) if sparse else (4, 4)  # (out, in): what the runtime 2:4 packer takes, or the mask's blocks
    return dict(
        shape=(
            unit[0] * draw(st.integers(1, 3 if sparse else 24)),
            unit[1] * draw(st.integers(1, 3 if sparse else 24)),
        ),
        tokens=draw(st.integers(1, 70)),
        fixed=draw(st.booleans()),
        bias=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.conformance(kernel="pack_2_4_cusparselt", prop="pack_cusparselt")
@pytest.mark.parametrize("dtype", PACK, ids=kc.dtype_id)
@given(shape=st.tuples(st.integers(1, 3), st.integers(1, 3)), seed=st.integers(0, 2**16))
def test_pack_cusparselt(dtype, shape, seed):
    """W * mask (a transposable mask) and its transpose in cuSPARSELt's compressed layout, bit for bit: against
    an entry-by-entry construction of the layout, and on a GPU against torch._cslt_compress itself. Weights have
    no exact zeros (cuSPARSELt may encode a kept 0 at another index of its group)."""
    m, k = 64 * shape[0], 64 * shape[1]
    w = kc.make_input((m, k), dtype, DEVICE, "contiguous", seed=seed)
    w = torch.where(w == 0, torch.ones_like(w), w)
    mask = kp_sparsity.mask_2_4(w, transposable=True)
    packed, packed_t = run(cusparselt.PACK, w, mask, True, op=OP_C)
    alone, _ = run(cusparselt.PACK, w, mask, False, op=OP_C)
    bits = lambda t: t.view(torch.int16).cpu()  # noqa: E731
    assert torch.equal(bits(alone), bits(packed))
    assert torch.equal(bits(packed), bits(cusparselt_compressed(w, mask)))
    assert torch.equal(bits(packed_t), bits(cusparselt_compressed(w.t(), mask.t())))
    if DEVICE.type == "cuda":
        w_s = torch.where(mask, w, torch.zeros_like(w))
        assert torch.equal(bits(packed), bits(torch._cslt_compress(w_s)))
        assert torch.equal(bits(packed_t), bits(torch._cslt_compress(w_s.t().contiguous())))


def check_step(layer, x, y, ref, lowp, dtype):
    """y and the gradients of x, the weight and the bias against float64 (ref) by the 2x rule, PyTorch's masked
    dense computation in `dtype` (lowp) the yardstick."""
    ours = (y, x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad)
    for what, o, r, lp in zip(("y", "dx", "dW", "db"), ours, ref, lowp):
        if r is not None:
            kc.check_close(what, o, r, lp, dtype)


@pytest.mark.conformance(kernel="mask_2_4_transposable", prop="training")
@pytest.mark.parametrize("route", ["dense", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(data=st.data())
def test_training(dtype, route, data):
    """SparseTrainingLinear: the mask is kp's transposable 2:4 of the weight (made by the kernel); the output and
    the gradients of x, W (straight-through with SR-STE decay, or masked for a fixed mask) and b against float64
    by the 2x rule, PyTorch's masked dense layer in the same dtype the yardstick. route "sparse" packs W_s for
    sparse tensor cores (fp16 / bf16 on a GPU)."""
    if route == "sparse" and (DEVICE.type != "cuda" or dtype not in PACK):
        pytest.skip("not covered: 2:4 sparse tensor cores take fp16 / bf16 on a GPU")
    c = data.draw(training_cases(route == "sparse"))
    out_f, in_f = c["shape"]
    torch.manual_seed(c["seed"])
    with kp_core.record_launches() as rec:
        layer = kp_sparsity.SparseTrainingLinear(
            in_f, out_f, bias=c["bias"], device=DEVICE, dtype=dtype, mask_every=None if c["fixed"] else 1, decay=0.1
        )
    kc.assert_kernel_ran(rec, OP_T)
    assert_same("mask", layer.mask, kp_sparsity.mask_2_4(layer.weight.detach(), transposable=True))
    layer.route = route
    x = kc.make_input((c["tokens"], in_f), dtype, DEVICE, "contiguous", seed=c["seed"] + 1).requires_grad_()
    dy = kc.make_input((c["tokens"], out_f), dtype, DEVICE, "contiguous", seed=c["seed"] + 2)
    w_before = layer.weight.detach().clone()
    with kp_core.record_launches() as rec:
        y = layer(x)
        y.backward(dy)
    if route == "sparse":  # W_s and W_s^T packed by kp for cuSPARSELt
        kc.assert_kernel_ran(rec, OP_C)
    assert torch.equal(layer.weight.detach(), w_before), "the forward changed the weight"
    args = (x, w_before, layer.bias, layer.mask, dy, 0.1, c["fixed"])
    check_step(layer, x, y, sparse_training_step(*args), sparse_training_step(*args, dtype=dtype), dtype)


@pytest.mark.conformance(kernel="prune_2_4", prop="activations")
@pytest.mark.parametrize("route", ["dense", "sparse"])
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@given(data=st.data())
def test_training_activations(dtype, route, data):
    """SparseActivationLinear: each token's features made 2:4 by kp's mask (equal to the sort-based reference's
    mask, so the reference computes with the same x_s); output and gradients against float64 by the 2x rule.
    route "sparse" packs x_s for cuSPARSELt where the token count is a multiple of 64."""
    if route == "sparse" and (DEVICE.type != "cuda" or dtype not in PACK):
        pytest.skip("not covered: 2:4 sparse tensor cores take fp16 / bf16 on a GPU")
    c = data.draw(training_cases(route == "sparse"))
    out_f, in_f = c["shape"]
    tokens = 64 * (c["tokens"] % 3 + 1) if route == "sparse" and c["fixed"] else c["tokens"]
    torch.manual_seed(c["seed"])
    layer = kp_sparsity.SparseActivationLinear(in_f, out_f, bias=c["bias"], device=DEVICE, dtype=dtype, route=route)
    x = kc.make_input((tokens, in_f), dtype, DEVICE, "contiguous", seed=c["seed"] + 1).requires_grad_()
    dy = kc.make_input((tokens, out_f), dtype, DEVICE, "contiguous", seed=c["seed"] + 2)
    with kp_core.record_launches() as rec:
        y = layer(x)
        y.backward(dy)
    kc.assert_kernel_ran(rec, OP, *((OP_C,) if route == "sparse" and tokens % 64 == 0 else ()))
    args = (x, layer.weight, layer.bias, dy)
    check_step(layer, x, y, sparse_activation_step(*args), sparse_activation_step(*args, dtype=dtype), dtype)


@pytest.mark.conformance(kernel="prune_2_4", prop="zero_size")
def test_zero_size():
    w = torch.empty(0, 8, device=DEVICE)
    assert kp_sparsity.mask_2_4(w).shape == (0, 8) and kp_sparsity.prune_2_4(w).shape == (0, 8)


def _w(shape, dtype=torch.float16):
    return torch.ones(shape, dtype=dtype, device=DEVICE)


BAD_INPUTS = [
    ("not a tensor", lambda: kp_sparsity.mask_2_4([[1.0] * 4]), TypeError, "weight must be a torch.Tensor"),
    ("1-D", lambda: kp_sparsity.mask_2_4(_w((8,))), ValueError, "weight must have 2 dimensions"),
    ("3-D", lambda: kp_sparsity.mask_2_4(_w((2, 8, 8))), ValueError, "weight must have 2 dimensions"),
    ("K not a multiple of 4", lambda: kp_sparsity.mask_2_4(_w((8, 6))), ValueError, "multiple of 4"),
    (
        "transposable rows",
        lambda: kp_sparsity.mask_2_4(_w((6, 8)), transposable=True),
        ValueError,
        "rows a multiple of 4",
    ),
    ("integer weight", lambda: kp_sparsity.mask_2_4(_w((8, 8), torch.int32)), TypeError, "weight must have dtype"),
    ("fp32 packing", lambda: kp_sparsity.pack_2_4(_w((32, 64), torch.float32)), TypeError, "weight must have dtype"),
    ("rows for packing", lambda: kp_sparsity.pack_2_4(_w((16, 64))), ValueError, "multiple of 32"),
    ("columns for packing", lambda: kp_sparsity.pack_2_4(_w((32, 48))), ValueError, "multiple of 64"),
    (
        "column_scale shape",
        lambda: kp_sparsity.mask_2_4(_w((8, 8)), column_scale=torch.ones(4, device=DEVICE)),
        ValueError,
        "column_scale must have shape",
    ),
    (
        "column_scale dtype",
        lambda: kp_sparsity.mask_2_4(_w((8, 8)), column_scale=torch.ones(8, device=DEVICE, dtype=torch.float16)),
        TypeError,
        "column_scale must have dtype",
    ),
    (
        "meta shape",
        lambda: kp_sparsity.unpack_2_4(_w((32, 32)), torch.zeros(32, 3, dtype=torch.int16, device=DEVICE)),
        ValueError,
        "meta must have shape",
    ),
]
test_bad_input = kc.bad_input_test("prune_2_4", BAD_INPUTS)


@pytest.mark.conformance(kernel="prune_2_4", prop="opcheck")
@pytest.mark.parametrize("dtype", PACK, ids=kc.dtype_id)
def test_opcheck(dtype):
    w = kc.make_input((64, 128), dtype, DEVICE, "row_strided", seed=2)
    scale = torch.rand(128, device=DEVICE)
    with kp_core.record_launches() as rec:
        torch.library.opcheck(prune_mod.PRUNE.op, (w, None, True, True, True))
        torch.library.opcheck(prune_mod.PRUNE.op, (w, scale, True, False, False))
        torch.library.opcheck(prune_mod.MASK_T.op, (w, scale))
    kc.assert_kernel_ran(rec, OP, OP_T)


@pytest.mark.conformance(kernel="prune_2_4", prop="compile")
def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()

    def f(w, scale):
        return kp_sparsity.pack_2_4(w * 1, column_scale=scale), kp_sparsity.mask_2_4(w, column_scale=scale)

    compiled = torch.compile(f, fullgraph=True)
    w = kc.make_input((64, 128), torch.bfloat16, DEVICE, "contiguous", seed=4)
    scale = torch.rand(128, device=DEVICE)
    results = [run(fn, w, scale) for fn in (f, compiled)]
    ((va, ma), ka), ((vb, mb), kb) = results
    assert torch.equal(va, vb) and torch.equal(ma, mb) and torch.equal(ka, kb)


def test_reference_is_independent():
    """The reference selects by sorting, not through kp; on a group it must keep what a reader expects."""
    w = torch.tensor([[1.0, -3.0, 3.0, 0.5, 2.0, 2.0, 2.0, 2.0, float("nan"), 0.0, 9.0, 1.0]])
    assert ref_mask(w).tolist() == [[False, True, True, False, True, True, False, False, True, False, True, False]]
    pats = transposable_patterns()
    assert pats.shape == (90, 16) and pats[0].view(4, 4).tolist()[0] == [1, 1, 0, 0]


HALF = (torch.float16, torch.bfloat16)  # what packing takes
COLUMN_SCALE = fuzz.Tensor((torch.float32, torch.float16, torch.bfloat16), sized=(0,), values=False)
FUZZ_TARGETS = [
    fuzz.Target(
        name,
        "kp-sparsity",
        fn,
        lambda d: dict(weight=torch.randn(32, 64, device=d).half(), column_scale=torch.rand(64, device=d)),
        dict(
            weight=fuzz.Tensor(dtypes, sized=(1,), first=True, words=("multiple of 4", "4")), column_scale=COLUMN_SCALE
        ),
        results=lambda r: [r] if isinstance(r, torch.Tensor) else list(r),
    )
    for name, fn, dtypes in (
        ("kp_sparsity.mask_2_4", kp_sparsity.mask_2_4, DTYPES),
        ("kp_sparsity.prune_2_4", kp_sparsity.prune_2_4, DTYPES),
        ("kp_sparsity.pack_2_4", kp_sparsity.pack_2_4, HALF),
    )
] + [
    fuzz.Target(
        "kp_sparsity.unpack_2_4",
        "kp-sparsity",
        kp_sparsity.unpack_2_4,
        lambda d: dict(zip(("values", "meta"), kp_sparsity.pack_2_4(torch.randn(32, 64, device=d).half()))),
        dict(
            values=fuzz.Tensor(HALF, sized=(0, 1), first=True, words=("meta",)),
            meta=fuzz.Tensor((torch.int16,), sized=(0, 1), values=False, words=("values",)),
        ),
        launches=False,  # torch's own CUTLASS conversion
    ),
]


test_bad_input_fuzz = kc.fuzz_test("prune_2_4", FUZZ_TARGETS)
