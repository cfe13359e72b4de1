"""Conformance spec for kp-attention's flex attention (kp::flex_attention, kp::flex_block_mask): mods drawn from
a small grammar of score and mask expressions (the documented built-ins and their combinations, captured tensors
included), against a float64 reference that materialises the scores, the mod and the mask in plain PyTorch
(softmax(score_mod(scale * q K^T)) masked, @ V; Vaswani et al. 2017, eq. 1). PyTorch's baseline is the same
computation in the inputs' dtype. Gradients of q, k, v and of the captured tensors that require them; the block
classification against the dense mask; every compile-time switch of the kernels; opcheck and torch.compile."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kp_conformance as kc
import kp_core
from kp_attention.flex import BlockMask, and_masks, create_block_mask, flex_attention, or_masks
from kp_attention.ops import flex, flex_codegen
from kp_conformance import fuzz

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TIER = kc.current()
DEVICE = kc.device()
EXAMPLES = 4 if kc.interpreting() else TIER.max_examples

kc.declare(
    kc.Spec(
        name="flex_attention",
        package="kp-attention",
        ops=(flex.OP, flex.OP_BWD, flex.OP_BLOCKS),
        reference=(
            "softmax(score_mod(scale * q K^T), masked by mask_mod) V in float64 with the mods evaluated on "
            "broadcast index tensors (FlexAttention's definition), GQA by repeating kv heads; block classes from "
            "the dense mask"
        ),
        dtypes=DTYPES,
        properties=("values", "blocks", "switches", "opcheck", "compile", "bad_input"),
    )
)


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    return kc.randn(*shape, dtype=dtype, device=DEVICE, seed=seed) * scale


# ---- the grammar: each builder takes the case and returns a mod (captured tensors made on DEVICE) ----


def score_mods(c):
    """score_mod builders by name; each returns (mod, learnable capture or None)."""
    h, sq, sk, seed = c["hq"], c["sq"], c["sk"], c["seed"]

    def bias_table():
        bias = rand(h, sq + sk - 1, seed=seed + 40, scale=0.5).requires_grad_()
        return (lambda s, b, hh, i, j: s + bias[hh, i - j + sk - 1]), bias

    def alibi():
        slopes = torch.rand(h, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(DEVICE)
        return (lambda s, b, hh, i, j: s - slopes[hh] * (i - j).abs()), None

    def temperature():
        t = torch.tensor(0.7, device=DEVICE).requires_grad_()
        return (lambda s, b, hh, i, j: s * t), t

    return {
        "none": lambda: (None, None),
        "bias table": bias_table,
        "alibi": alibi,
        "softcap": lambda: ((lambda s, b, hh, i, j: torch.tanh(s / 3.0) * 3.0), None),
        "integer terms": lambda: (
            (lambda s, b, hh, i, j: torch.where((i - j) % 3 == 0, s, s * 0.5) + (j // 5) * 0.1),
            None,
        ),
        "temperature": temperature,
        "exp and clamp": lambda: (
            (lambda s, b, hh, i, j: torch.clamp(s, -2.0, 2.0) + torch.exp(-(i - j).abs() * 0.1)),
            None,
        ),
    }


def mask_mods(c):
    sq, sk, w, n = c["sq"], c["sk"], c["window"], c["prefix"]
    docs = torch.sort(torch.randint(0, 3, (max(sq, sk),), generator=torch.Generator().manual_seed(c["seed"])))[0]
    docs = docs.to(DEVICE)
    diag = sk - sq  # causal aligned bottom-right, as FlashAttention's

    def causal(b, h, i, j):
        return i + diag >= j

    def window(b, h, i, j):
        return (i + diag - j).abs() <= w

    def prefix(b, h, i, j):
        return j < n

    def document(b, h, i, j):
        return docs[i] == docs[j]

    def by_head(b, h, i, j):
        return (j % (h + 2) != 1) | (b == 0)

    return {
        "none": None,
        "causal": causal,
        "sliding window": and_masks(causal, window),
        "prefix-LM": or_masks(prefix, causal),
        "document": document,
        "document causal": and_masks(document, causal),
        "per batch and head": by_head,
    }


# ---- a grammar of mods: expression trees composed of closures, drawn by Hypothesis ----
# Score terms stay bounded (tanh, sigmoid, exp of minus an absolute value, constants in [-2, 2]) so that a drawn
# tree never overflows the scores; each node is a function of (score, b, h, q_idx, kv_idx) closing over its
# children, which is what the tracer follows (and what the capture paths walk through).


def _leaf_score(kind, c, seed):
    """(term, its learnable tables)."""
    h, sq, sk = c["hq"], c["sq"], c["sk"]
    if kind == "score":
        return (lambda s, b, hh, i, j: s), []
    if kind == "distance":
        return (lambda s, b, hh, i, j: (i - j).abs().float() * -0.05), []
    if kind == "table":  # a learnable (H, Sq + Sk - 1) relative bias: its gradient is checked
        table = rand(h, sq + sk - 1, seed=seed, scale=0.5).requires_grad_()
        return (lambda s, b, hh, i, j: table[hh, i - j + sk - 1]), [table]
    slopes = torch.linspace(0.05, 0.3, h, device=DEVICE)
    return (lambda s, b, hh, i, j: slopes[hh] * (j % 7).float()), []


def _unary_score(kind, f, k):
    if kind == "tanh":
        return lambda s, b, h, i, j: torch.tanh(f(s, b, h, i, j) / 2.0) * 2.0
    if kind == "sigmoid":
        return lambda s, b, h, i, j: torch.sigmoid(f(s, b, h, i, j)) * k
    if kind == "decay":
        return lambda s, b, h, i, j: torch.exp(-f(s, b, h, i, j).abs()) * k
    return lambda s, b, h, i, j: f(s, b, h, i, j) * k


def _binary_score(kind, f, g):
    if kind == "add":
        return lambda s, b, h, i, j: f(s, b, h, i, j) + g(s, b, h, i, j)
    if kind == "sub":
        return lambda s, b, h, i, j: f(s, b, h, i, j) - g(s, b, h, i, j)
    if kind == "where":
        return lambda s, b, h, i, j: torch.where((i + j) % 3 == 0, f(s, b, h, i, j), g(s, b, h, i, j))
    return lambda s, b, h, i, j: torch.maximum(f(s, b, h, i, j), g(s, b, h, i, j))


def score_tree(draw, c, depth=0):
    """(mod, description, learnable tables) drawn from the grammar."""
    choice = draw(st.sampled_from(("leaf", "leaf", "unary", "binary")) if depth < 2 else st.just("leaf"))
    if choice == "leaf":
        kind = draw(st.sampled_from(("score", "score", "distance", "table", "slopes")))
        f, tables = _leaf_score(kind, c, draw(st.integers(0, 999)))
        return f, kind, tables
    if choice == "unary":
        kind, k = draw(st.sampled_from(("tanh", "sigmoid", "decay", "scale"))), draw(st.sampled_from((-1.5, 0.5, 2.0)))
        f, text, tables = score_tree(draw, c, depth + 1)
        return _unary_score(kind, f, k), f"{kind}({text}, {k})", tables
    kind = draw(st.sampled_from(("add", "sub", "where", "max")))
    f, tf, ta = score_tree(draw, c, depth + 1)
    g, tg, tb = score_tree(draw, c, depth + 1)
    return _binary_score(kind, f, g), f"{kind}({tf}, {tg})", ta + tb


def mask_tree(draw, c, depth=0):
    """(mask_mod, description) drawn from the grammar: the built-in masks, &, | and ~."""
    builtins = mask_mods(c)
    choice = draw(st.sampled_from(("leaf", "leaf", "and", "or", "not")) if depth < 2 else st.just("leaf"))
    if choice == "leaf":
        name = draw(st.sampled_from(sorted(n for n in builtins if n != "none")))
        return builtins[name], name
    if choice == "not":
        f, text = mask_tree(draw, c, depth + 1)
        return (lambda b, h, i, j: ~f(b, h, i, j)), f"~{text}"
    (f, tf), (g, tg) = mask_tree(draw, c, depth + 1), mask_tree(draw, c, depth + 1)
    combine = and_masks if choice == "and" else or_masks
    return combine(f, g), f"{choice}({tf}, {tg})"


@st.composite
def grammar_cases(draw, hkv=None):
    """A case of flex_cases with a drawn score tree and mask tree in place of the named builders."""
    c = draw(flex_cases(hkv))
    score, text, tables = score_tree(draw, c)
    mask, mask_text = mask_tree(draw, c) if draw(st.booleans()) else (None, "none")
    return dict(c, score=text, mask=mask_text, score_fn=score, tables=tables, mask_fn=mask)


@st.composite
def flex_cases(draw, hkv=None):
    """hkv: the key/value heads (1 or 2), drawn unless given."""
    hkv = draw(st.sampled_from((1, 2))) if hkv is None else hkv
    return dict(
        batch=draw(st.integers(1, 2)),
        hq=hkv * draw(st.sampled_from((1, 2))),
        hkv=hkv,
        sq=draw(st.sampled_from((1, 17, 40, 64))),
        sk=draw(st.sampled_from((23, 40, 64))),
        d=draw(st.sampled_from((16, 24, 64))),
        score=draw(st.sampled_from(sorted(score_mods(dict(hq=1, sq=1, sk=1, seed=0))))),
        mask=draw(st.sampled_from(sorted(mask_mods(dict(sq=1, sk=1, window=1, prefix=1, seed=0)), key=str))),
        window=draw(st.integers(0, 12)),
        prefix=draw(st.integers(0, 20)),
        block=draw(st.sampled_from((16, 32, (16, 32)))),
        seed=draw(st.integers(0, 2**16)),
    )


def reference(q, k, v, score_mod, mask_mod, dtype, keep=None, p=0.0):
    b, hq, sq, d = q.shape
    group = hq // k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    ib, ih, iq, ik = (
        torch.arange(n, device=DEVICE).view(*[-1 if a == x else 1 for a in range(4)])
        for x, n in enumerate((b, hq, sq, k.shape[2]))
    )
    if score_mod is not None:  # a mod that ignores the score still gives every (batch, head) a row
        s = score_mod(s, ib, ih, iq, ik).to(dtype).expand_as(s)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(ib, ih, iq, ik), float("-inf"))
    probs = torch.softmax(s, -1).nan_to_num(0.0)
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs.to(dtype) @ v, torch.logsumexp(s.double() if dtype == torch.float64 else s.float(), -1)


def run(fn, tensors, dout, capture):
    tensors = [t.detach().requires_grad_() for t in tensors]
    if capture is not None:
        capture.grad = None
    out, lse = fn(*tensors)
    (out.double() * dout.double()).sum().backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in tensors]  # None: the mod ignores q.k
    if capture is not None:
        grads.append(torch.zeros_like(capture) if capture.grad is None else capture.grad.clone())
    return [out.detach(), lse.detach(), *grads]


def check_case(c, dtype, block_mask_of=None, **kw):
    """kp's flex_attention on case c (fwd, lse, gradients of q, k, v and a learnable capture) by the rule."""
    q = rand(c["batch"], c["hq"], c["sq"], c["d"], dtype=dtype, seed=c["seed"])
    k = rand(c["batch"], c["hkv"], c["sk"], c["d"], dtype=dtype, seed=c["seed"] + 1)
    v = rand(c["batch"], c["hkv"], c["sk"], c["d"], dtype=dtype, seed=c["seed"] + 2)
    dout = rand(c["batch"], c["hq"], c["sq"], c["d"], dtype=dtype, seed=c["seed"] + 3)
    if "score_fn" in c:  # a drawn tree (grammar_cases); its first learnable table is the checked capture
        score_mod, capture, mask_mod = c["score_fn"], (c["tables"] or [None])[0], c["mask_fn"]
    else:
        score_mod, capture = score_mods(c)[c["score"]]()
        mask_mod = mask_mods(c)[c["mask"]]
    mask = None
    if mask_mod is not None:
        per = "per batch and head" in c["mask"]
        args = (c["batch"] if per else None, c["hq"] if per else None, c["sq"], c["sk"], DEVICE, c["block"])
        mask = create_block_mask(mask_mod, *args)
        if block_mask_of is not None:
            mask = block_mask_of(mask)

    def ours(q, k, v):
        return flex_attention(q, k, v, score_mod, mask, enable_gqa=True, return_lse=True, **kw)

    with kp_core.record_launches() as rec:
        got = run(ours, (q, k, v), dout, capture)
    kc.assert_kernel_ran(rec, flex.OP, flex.OP_BWD)
    want = run(lambda *t: reference(*t, score_mod, mask_mod, torch.float64), (q, k, v), dout, capture)
    low = run(lambda *t: reference(*t, score_mod, mask_mod, dtype), (q, k, v), dout, capture)
    names = ("out", "lse", "dq", "dk", "dv", "d capture")
    for name, a, w, lo in zip(names, got, want, low):
        if name == "lse":
            assert torch.equal(torch.isinf(a), torch.isinf(w)), f"{c}: rows that see no key must have lse -inf"
            fin = torch.isfinite(w)
            kc.check_close(f"{c} lse", a[fin], w[fin], lo[fin].float(), torch.float32)
        elif name == "d capture":
            kc.check_close(f"{c} {name}", a, w, lo.to(a.dtype), torch.float32)
        else:
            kc.check_close(f"{c} {name}", a, w, lo.nan_to_num(0.0), dtype)
    return rec


# One and two key/value heads as two cells of half the examples each: every example compiles its own kernels,
# which made these the GPU tier's longest tests (up to 3 minutes for one dtype on an H200); two cells run on two
# workers.
@pytest.mark.conformance(kernel="flex_attention", prop="values")
@pytest.mark.parametrize("hkv", (1, 2), ids=("hkv1", "hkv2"))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@settings(max_examples=max(EXAMPLES // 2, 2))
@given(data=st.data())
def test_values(dtype, hkv, data):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    check_case(data.draw(flex_cases(hkv)), dtype)


@pytest.mark.conformance(kernel="flex_attention", prop="values")
@pytest.mark.parametrize("hkv", (1, 2), ids=("hkv1", "hkv2"))
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@settings(max_examples=max(EXAMPLES // 2, 2))
@given(data=st.data())
def test_values_of_drawn_expressions(dtype, hkv, data):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    check_case(data.draw(grammar_cases(hkv)), dtype)


@pytest.mark.conformance(kernel="flex_attention", prop="blocks")
@settings(max_examples=EXAMPLES)
@given(c=flex_cases())
def test_block_classes_match_the_dense_mask(c):
    mask_mod = mask_mods(c)[c["mask"]]
    if mask_mod is None:
        return
    with kp_core.record_launches() as rec:
        mask = create_block_mask(mask_mod, c["batch"], c["hq"], c["sq"], c["sk"], DEVICE, c["block"])
    kc.assert_kernel_ran(rec, flex.OP_BLOCKS)
    qb, kb = mask.BLOCK_SIZE
    n_q, n_kv = -(-c["sq"] // qb), -(-c["sk"] // kb)
    ib, ih = torch.arange(c["batch"], device=DEVICE), torch.arange(c["hq"], device=DEVICE)
    iq, ik = torch.arange(c["sq"], device=DEVICE), torch.arange(c["sk"], device=DEVICE)
    dense = mask_mod(ib.view(-1, 1, 1, 1), ih.view(1, -1, 1, 1), iq.view(1, 1, -1, 1), ik.view(1, 1, 1, -1))
    dense = dense.expand(c["batch"], c["hq"], c["sq"], c["sk"])
    pad = torch.zeros(c["batch"], c["hq"], n_q * qb, n_kv * kb, dtype=torch.int32, device=DEVICE)
    seen = pad.clone()
    pad[..., : c["sq"], : c["sk"]] = dense.int()
    seen[..., : c["sq"], : c["sk"]] = 1
    held = pad.view(c["batch"], c["hq"], n_q, qb, n_kv, kb).sum((3, 5))
    total = seen.view(c["batch"], c["hq"], n_q, qb, n_kv, kb).sum((3, 5))
    want = torch.where(held == 0, 0, torch.where(held == total, 2, 1))
    got = torch.zeros_like(want)
    for num, idx, value in (
        (mask.kv_num_blocks, mask.kv_indices, 1),
        (mask.full_kv_num_blocks, mask.full_kv_indices, 2),
    ):
        for b in range(c["batch"]):
            for h in range(c["hq"]):
                for i in range(n_q):
                    got[b, h, i, idx[b, h, i, : num[b, h, i]].long()] = value
    assert torch.equal(got, want), f"{c}: block classes differ from the dense mask's"
    got_t = torch.zeros_like(want.transpose(-1, -2))
    for num, idx, value in ((mask.q_num_blocks, mask.q_indices, 1), (mask.full_q_num_blocks, mask.full_q_indices, 2)):
        for b in range(c["batch"]):
            for h in range(c["hq"]):
                for j in range(n_kv):
                    got_t[b, h, j, idx[b, h, j, : num[b, h, j]].long()] = value
    assert torch.equal(got_t, want.transpose(-1, -2)), f"{c}: the transposed lists differ"


def without_full_blocks(mask: BlockMask) -> BlockMask:
    """Every visited block listed as partial (FlexAttention's form without full_* lists): HAS_FULL off."""
    dense = mask.to_dense()

    def lists(d):
        return d.sum(-1, dtype=torch.int32), torch.argsort(1 - d, dim=-1, stable=True).to(torch.int32)

    kv_num, kv_idx = lists(dense)
    q_num, q_idx = lists(dense.transpose(-1, -2).contiguous())
    return BlockMask(
        mask.seq_lengths, kv_num, kv_idx, None, None, q_num, q_idx, None, None, mask.BLOCK_SIZE, mask.mask_mod
    )


BASE = dict(batch=2, hq=4, hkv=2, sq=40, sk=64, d=24, score="none", mask="none", window=9, prefix=5, block=16, seed=3)
# Each compile-time switch of _flex_fwd, _flex_bwd_dq, _flex_bwd_dkdv and the generated mods, in every tier.
SWITCHES = [
    ("no mods, every block full (SCORE_MOD, MASK_MOD None)", {}, None, {}),
    ("mask_mod on partial blocks, full blocks skip it (HAS_FULL)", {"mask": "sliding window"}, None, {}),
    ("no full lists: mask_mod everywhere (HAS_FULL off)", {"mask": "document causal"}, without_full_blocks, {}),
    ("score_mod with a learnable table (SCORE_BWD atomics)", {"score": "bias table", "mask": "causal"}, None, {}),
    ("0-D learnable capture", {"score": "temperature", "mask": "prefix-LM"}, None, {}),
    (
        "head dim 64 (no EXACT_DELTA), per-head mask",
        {"d": 64, "mask": "per batch and head", "score": "softcap"},
        None,
        {},
    ),
    ("one query row (decode)", {"sq": 1, "mask": "causal", "score": "alibi"}, None, {}),
]


@pytest.mark.conformance(kernel="flex_attention", prop="switches")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("what,change,transform,kw", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_every_switch(dtype, what, change, transform, kw):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    check_case(dict(BASE, **change), dtype, transform, **kw)


@pytest.mark.conformance(kernel="flex_attention", prop="switches")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("sq", [1, 5])
def test_split_decode(dtype, sq):
    """SPLIT (flash-decoding): each row's block list split three ways, merged by _flex_combine (fp32 never
    splits: its two passes are per row)."""
    kc.skip_if_not_covered(dtype, uses_dot=True)
    c = dict(BASE, sq=sq, sk=100, mask="document causal", score="bias table")
    with kp_core.pinned("_flex_fwd", splits=3):
        rec = check_case(c, dtype)
    assert (rec.count(flex.OP, kernel="_flex_combine") > 0) == (dtype != torch.float32), rec.launches


@pytest.mark.conformance(kernel="flex_attention", prop="switches")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_dropout(dtype):
    """DROPOUT: kp's Philox draw (kp_attention.ops.dropout.keep_mask), forward and backward, by the rule."""
    kc.skip_if_not_covered(dtype, uses_dot=True)
    from kp_attention.ops import dropout

    p, c = 0.25, dict(BASE, mask="causal")
    q, k, v, dout = (
        rand(2, 4 if i in (0, 3) else 2, 40 if i in (0, 3) else 64, 24, dtype=dtype, seed=i) for i in range(4)
    )
    mask = create_block_mask(mask_mods(c)["causal"], None, None, 40, 64, DEVICE, 16)
    torch.manual_seed(9)
    with kp_core.record_launches() as rec:
        got = run(
            lambda *t: flex_attention(*t, block_mask=mask, enable_gqa=True, return_lse=True, dropout_p=p),
            (q, k, v),
            dout,
            None,
        )
    kc.assert_kernel_ran(rec, flex.OP, flex.OP_BWD)
    torch.manual_seed(9)
    seed = dropout.draw_seed(q.device)
    keep = dropout.keep_mask(seed, torch.arange(8, device=DEVICE), 40, 64, p).view(2, 4, 40, 64)
    causal = mask_mods(c)["causal"]
    want = run(lambda *t: reference(*t, None, causal, torch.float64, keep, p), (q, k, v), dout, None)
    low = run(lambda *t: reference(*t, None, causal, dtype, keep, p), (q, k, v), dout, None)
    for name, a, w, lo in zip(("out", "lse", "dq", "dk", "dv"), got, want, low):
        if name != "lse":
            kc.check_close(f"dropout {name}", a, w, lo.nan_to_num(0.0), dtype)


@pytest.mark.conformance(kernel="flex_attention", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    c = dict(BASE, score="bias table", mask="causal", sq=16, sk=32)
    score_mod, bias = score_mods(c)["bias table"]()
    mask = create_block_mask(mask_mods(c)["causal"], None, None, 16, 32, DEVICE, 16)
    q = rand(1, 4, 16, 16, dtype=dtype, seed=1).requires_grad_()
    k, v = (rand(1, 2, 32, 16, dtype=dtype, seed=s).requires_grad_() for s in (2, 3))
    lists = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    lists_t = (mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
    args = (q, k, v, *lists, *lists_t, None, bias, None, None, None, None, None, None, None)
    keys = (flex_codegen.trace(score_mod, "score").key, flex_codegen.trace(mask.mask_mod, "mask").key)
    args += (*keys, 16, 16, 0.25, 0.0)
    with kp_core.record_launches() as rec:
        torch.library.opcheck(flex.FLEX.op, args)
    kc.assert_kernel_ran(rec, flex.OP)


@pytest.mark.conformance(kernel="flex_attention", prop="compile")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_compile_fullgraph_equals_eager(dtype):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    torch._dynamo.reset()
    c = dict(BASE, score="bias table", mask="document causal")
    mask = create_block_mask(mask_mods(c)["document causal"], None, None, 40, 64, DEVICE, 16)
    q = rand(2, 4, 40, 24, dtype=dtype, seed=1)
    k, v = (rand(2, 2, 64, 24, dtype=dtype, seed=s) for s in (2, 3))
    results = []
    for compiled in (False, True):
        score_mod, bias = score_mods(c)["bias table"]()
        fn = torch.compile(flex_attention, fullgraph=True) if compiled else flex_attention
        with kp_core.record_launches() as rec:
            out = fn(q * 1, k, v, score_mod, mask, enable_gqa=True)
            out.float().square().sum().backward()
        kc.assert_kernel_ran(rec, flex.OP, flex.OP_BWD)
        results.append((out.detach(), bias.grad))
    assert torch.equal(results[0][0], results[1][0]), "compiled output differs from eager"
    # The bias gradient is summed by fp32 atomics in the order programs finish, which differs between any two runs:
    # a reorder moves a sum by a few ulps of its largest partial (|grad| reaches ~50 here, where an ulp is 3.8e-6,
    # so the fixed 1e-5 this had failed on a GPU run under load). A wrong compiled path differs by far more.
    eager = results[0][1]
    atol = 16 * torch.finfo(torch.float32).eps * eager.abs().max().item()
    torch.testing.assert_close(results[1][1], eager, rtol=0, atol=atol)


def _bad_mods(q):
    bias = rand(4, 8)
    return [
        ("wrong arity", lambda: flex_attention(q, q, q, lambda s, b, h: s), TypeError, "must take 5 arguments"),
        (
            "python branch",
            lambda: flex_attention(q, q, q, lambda s, b, h, i, j: s if s > 0 else -s),
            ValueError,
            "torch.where",
        ),
        (
            "unsupported op",
            lambda: flex_attention(q, q, q, lambda s, b, h, i, j: torch.erf(s)),
            ValueError,
            "not supported",
        ),
        (
            "partial index",
            lambda: flex_attention(q, q, q, lambda s, b, h, i, j: s + bias[h]),
            ValueError,
            "every dimension",
        ),
        (
            "mask arity",
            lambda: create_block_mask(lambda b, h, i: i > 0, None, None, 16, 16, DEVICE, 16),
            TypeError,
            "4 arguments",
        ),
        (
            "float mask",
            lambda: create_block_mask(lambda b, h, i, j: (i - j).float(), None, None, 16, 16, DEVICE, 16),
            ValueError,
            "floats",
        ),
        (
            "mask lengths",
            lambda: flex_attention(
                rand(1, 2, 32, 16),
                rand(1, 2, 32, 16),
                rand(1, 2, 32, 16),
                block_mask=create_block_mask(lambda b, h, i, j: i >= j, None, None, 16, 16, DEVICE, 16),
            ),
            ValueError,
            "made for",
        ),
        (
            "block size",
            lambda: create_block_mask(mask_mods(BASE)["causal"], None, None, 16, 16, DEVICE, 48),
            ValueError,
            "BLOCK_SIZE",
        ),
        ("gqa off", lambda: flex_attention(rand(1, 4, 16, 16), q, q), ValueError, "enable_gqa"),
        ("integer q", lambda: flex_attention(q.long(), q, q), TypeError, "float16, bfloat16 or float32"),
        ("dropout", lambda: flex_attention(q, q, q, dropout_p=-0.1), ValueError, "dropout_p"),
    ]


test_bad_input = kc.bad_input_test("flex_attention", _bad_mods(rand(1, 2, 16, 16)))


def _flex_args(d):
    q, k, v = (torch.randn(1, 2, 16, 16, device=d) for _ in range(3))
    return dict(query=q, key=k, value=v, score_mod=lambda s, b, h, qi, ki: s + (qi - ki) * 0.1)


def _causal(b, h, q, k):
    return q >= k


FLOAT = (torch.float16, torch.bfloat16, torch.float32)
FUZZ_TARGETS = [
    fuzz.Target(
        "kp_attention.flex_attention",
        "kp-attention",
        flex_attention,
        _flex_args,
        dict(
            query=fuzz.Tensor(FLOAT, sized=(3,), words=("head dim", "key"), first=True),
            key=fuzz.Tensor(FLOAT, sized=(0, 1, 3), words=("batch", "head", "query")),
            value=fuzz.Tensor(FLOAT, sized=(0, 1, 2), words=("batch", "head", "key")),
            scale=fuzz.Scalar(bad=("1", math.nan)),
            enable_gqa=fuzz.Scalar(bad=(1, "yes")),
            dropout_p=fuzz.Scalar(bad=(-0.1, 1.5, "0.1")),
        ),
        aliases=(("key", "value"), ("query", "key")),
    ),
    fuzz.Target(
        "kp_attention.create_block_mask",
        "kp-attention",
        create_block_mask,
        lambda d: dict(mask_mod=_causal, B=1, H=2, Q_LEN=16, KV_LEN=16, device=d, BLOCK_SIZE=16),
        dict(
            mask_mod=fuzz.Scalar(bad=(None, 3, lambda b, h, q: q)),
            Q_LEN=fuzz.Scalar(bad=(-1, 1.5, "16")),
            KV_LEN=fuzz.Scalar(bad=(-1, None)),
            B=fuzz.Scalar(bad=(-1, 1.5)),
            BLOCK_SIZE=fuzz.Scalar(bad=(0, 24, 2048, "16")),
        ),
    ),
]
test_bad_input_fuzz = kc.fuzz_test("flex_attention", FUZZ_TARGETS)
