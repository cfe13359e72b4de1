"""kp_attention.flex: flex_attention and create_block_mask against a float64 reference that materialises the mask
and the score_mod in plain PyTorch (the mods are ordinary functions: called on broadcast index tensors they are
that reference), with the conformance rule against the same computation in the inputs' dtype. Gradients of q, k,
v and of a captured tensor, the block classification, dropout, torch.compile, the trace cache and the errors.
Every tensor is made on the device under test."""

import math

import pytest
import torch

import kp_core
from kp_attention.flex import BlockMask, and_masks, create_block_mask, flex_attention, noop_mask, or_masks
from kp_attention.ops import dropout, flex, flex_codegen
from kp_conformance.launched import skip_if_not_covered
from kp_conformance.tolerance import check_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(device=DEVICE, dtype=dtype)


S_Q, S_K = 45, 70
HEADS = 4
DOC = torch.tensor([0] * 20 + [1] * 30 + [2] * 20, device=DEVICE)  # keys' documents; queries take the first S_Q
BIAS = randn(HEADS, S_Q + S_K - 1, seed=11, scale=0.5)
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 9


def prefix(b, h, q_idx, kv_idx):
    return kv_idx < 12


def document(b, h, q_idx, kv_idx):
    return DOC[q_idx] == DOC[kv_idx]


def by_head(b, h, q_idx, kv_idx):
    return (kv_idx % (h + 2) != 1) | (b == 1)


def alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * (q_idx - kv_idx).abs()


def softcap(score, b, h, q_idx, kv_idx):
    return torch.tanh(score / 2.0) * 2.0


def floors(score, b, h, q_idx, kv_idx):  # // and % of negative numbers round as PyTorch does
    return score + ((q_idx - kv_idx) // 3).float() * 0.1 + torch.where((q_idx - kv_idx) % 3 == 1, 0.5, -0.25)


def make_bias(dtype):
    bias = BIAS.clone().requires_grad_()

    def rel_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, q_idx - kv_idx + S_K - 1]

    return rel_bias, bias


def reference(q, k, v, score_mod, mask_mod, dtype, caps=()):
    """(out, lse) in `dtype` (float64 for the reference) from the materialised scores and mask."""
    b, hq, sq, d = q.shape
    group = hq // k.shape[1]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    ib = torch.arange(b, device=DEVICE).view(-1, 1, 1, 1)
    ih = torch.arange(hq, device=DEVICE).view(1, -1, 1, 1)
    iq = torch.arange(sq, device=DEVICE).view(1, 1, -1, 1)
    ik = torch.arange(k.shape[2], device=DEVICE).view(1, 1, 1, -1)
    if score_mod is not None:
        s = score_mod(s, ib, ih, iq, ik).to(dtype)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(ib, ih, iq, ik), float("-inf"))
    lse = torch.logsumexp(s.float() if dtype != torch.float64 else s, -1)
    out = torch.softmax(s, -1).nan_to_num(0.0) @ v
    return out, lse


def run(fn, tensors, dout):
    tensors = [t.detach().requires_grad_() for t in tensors]
    out, lse = fn(*tensors)
    (out.double() * dout.double()).sum().backward()
    return [out.detach(), lse.detach(), *(t.grad for t in tensors)]


CASES = [  # (batch, q heads, kv heads, head dim, score_mod, mask_mod, BLOCK_SIZE)
    (2, 4, 4, 16, None, None, 32),
    (1, 4, 2, 32, None, causal, 16),  # GQA, Sq < Sk
    (2, 4, 4, 16, alibi, and_masks(causal, window), (16, 32)),
    (1, 4, 1, 16, softcap, or_masks(prefix, causal), 16),  # MQA, prefix-LM
    (1, 4, 4, 24, floors, document, 32),  # packed documents, padded head dim
    (2, 4, 4, 16, None, by_head, 16),  # per batch and head mask
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(case, dtype):
    skip_if_not_covered(dtype, uses_dot=True)
    b, hq, hkv, d, score_mod, mask_mod, block = CASES[case]
    q = randn(b, hq, S_Q, d, dtype=dtype, seed=case)
    k = randn(b, hkv, S_K, d, dtype=dtype, seed=case + 1)
    v = randn(b, hkv, S_K, d, dtype=dtype, seed=case + 2)
    dout = randn(b, hq, S_Q, d, dtype=dtype, seed=case + 3)
    mask = None
    if mask_mod is not None:
        mask = create_block_mask(
            mask_mod,
            b if mask_mod is by_head else None,
            None if mask_mod is not by_head else hq,
            S_Q,
            S_K,
            DEVICE,
            block,
        )

    def ours(q, k, v):
        return flex_attention(q, k, v, score_mod, mask, enable_gqa=hq != hkv, return_lse=True)

    with kp_core.record_launches() as rec:
        got = run(ours, (q, k, v), dout)
    assert rec.backends(flex.OP) == {KERNEL} and rec.backends(flex.OP_BWD) == {KERNEL}
    want = run(lambda *t: reference(*t, score_mod, mask_mod, torch.float64), (q, k, v), dout)
    low = run(lambda *t: reference(*t, score_mod, mask_mod, dtype), (q, k, v), dout)
    for name, a, w, lo in zip(("out", "lse", "dq", "dk", "dv"), got, want, low):
        if name == "lse":
            assert torch.equal(torch.isinf(a), torch.isinf(w)), "rows that see no key must have lse -inf"
            fin = torch.isfinite(w)
            check_close("lse", a[fin], w[fin], lo[fin].float(), torch.float32)
        else:
            check_close(name, a, w, lo.nan_to_num(0.0), dtype)


def diagonal(b, h, q_idx, kv_idx):
    return q_idx == kv_idx


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d, mask_mod", [(16, causal), (64, diagonal)], ids=["d16-causal", "d64-one-key"])
def test_gradient_of_a_captured_tensor(dtype, d, mask_mod):
    """A learnable relative-position bias gets its gradient from the kernels (atomics in the dQ kernel). With one
    key per row, every row's bias gets P (dP - delta) with P = 1: exactly 0 in float64 and in PyTorch's fp16, so
    delta must be the same sum as dP (exact delta), not rowsum(dO * O) summed in another order."""
    skip_if_not_covered(dtype, uses_dot=True)
    q, k, v, dout = (randn(1, HEADS, s, d, dtype=dtype, seed=i) for i, s in enumerate((S_Q, S_K, S_K, S_Q)))
    mask = create_block_mask(mask_mod, None, None, S_Q, S_K, DEVICE, 16)
    grads = {}
    for name, dt in (("ours", None), ("ref", torch.float64), ("low", dtype)):
        rel_bias, bias = make_bias(dtype)
        tensors = [t.detach().requires_grad_() for t in (q, k, v)]
        if dt is None:
            with kp_core.record_launches() as rec:
                out = flex_attention(*tensors, rel_bias, mask)
        else:
            out = reference(*tensors, rel_bias, mask_mod, dt)[0]
        (out.double() * dout.double()).sum().backward()
        grads[name] = bias.grad
    assert rec.backends(flex.OP) == {KERNEL}
    check_close("dbias", grads["ours"], grads["ref"], grads["low"].to(grads["ours"].dtype), torch.float32)


def test_block_mask_classes():
    """Full, partial and skipped blocks as the dense mask says, in both orders; the kernel classified them."""
    for mask_mod, sizes in ((causal, (16, 32)), (document, (32, 16)), (and_masks(causal, window), (16, 16))):
        with kp_core.record_launches() as rec:
            mask = create_block_mask(mask_mod, None, None, S_Q, S_K, DEVICE, sizes)
        assert rec.backends(flex.OP_BLOCKS) == {KERNEL}
        iq = torch.arange(S_Q, device=DEVICE).view(-1, 1)
        ik = torch.arange(S_K, device=DEVICE).view(1, -1)
        dense = mask_mod(0, 0, iq, ik)
        n_q, n_kv = -(-S_Q // sizes[0]), -(-S_K // sizes[1])
        for i in range(n_q):
            for j in range(n_kv):
                block = dense[i * sizes[0] : (i + 1) * sizes[0], j * sizes[1] : (j + 1) * sizes[1]]
                want = 2 if block.all() else 1 if block.any() else 0
                full = j in mask.full_kv_indices[0, 0, i, : mask.full_kv_num_blocks[0, 0, i]].tolist()
                part = j in mask.kv_indices[0, 0, i, : mask.kv_num_blocks[0, 0, i]].tolist()
                assert (2 if full else 1 if part else 0) == want, (mask_mod, i, j)
                full_t = i in mask.full_q_indices[0, 0, j, : mask.full_q_num_blocks[0, 0, j]].tolist()
                part_t = i in mask.q_indices[0, 0, j, : mask.q_num_blocks[0, 0, j]].tolist()
                assert (2 if full_t else 1 if part_t else 0) == want, ("transposed", mask_mod, i, j)
        assert mask.to_dense().sum().item() == sum(
            1
            for i in range(n_q)
            for j in range(n_kv)
            if dense[i * sizes[0] :, j * sizes[1] :][: sizes[0], : sizes[1]].any()
        )
        assert mask.shape == (1, 1, S_Q, S_K) and 0.0 <= mask.sparsity() <= 100.0 and "BlockMask" in repr(mask)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_dropout(dtype):
    """The same Philox draw as kp's flash attention: reproducible under manual_seed, and equal to the reference
    with that keep mask, gradients included."""
    skip_if_not_covered(dtype, uses_dot=True)
    p = 0.3
    q, k, v, dout = (randn(2, 2, s, 16, dtype=dtype, seed=i) for i, s in enumerate((S_Q, S_K, S_K, S_Q)))
    mask = create_block_mask(causal, None, None, S_Q, S_K, DEVICE, 16)
    torch.manual_seed(5)
    got = run(lambda *t: flex_attention(*t, alibi, mask, dropout_p=p, return_lse=True), (q, k, v), dout)
    torch.manual_seed(5)
    seed = dropout.draw_seed(torch.device(DEVICE))
    keep = dropout.keep_mask(seed, torch.arange(4, device=DEVICE), S_Q, S_K, p).view(2, 2, S_Q, S_K)

    def dropped(dt):
        def fn(q, k, v):
            s = (q.to(dt) @ k.to(dt).transpose(-1, -2)) / 4.0
            ih = torch.arange(2, device=DEVICE).view(1, -1, 1, 1)
            iq, ik = torch.arange(S_Q, device=DEVICE).view(-1, 1), torch.arange(S_K, device=DEVICE).view(1, -1)
            s = alibi(s, 0, ih, iq, ik).masked_fill(~causal(0, 0, iq, ik), float("-inf"))
            probs = torch.softmax(s, -1).nan_to_num(0.0) * keep / (1 - p)
            return probs.to(dt) @ v.to(dt), torch.logsumexp(s, -1)

        return run(fn, (q, k, v), dout)

    want, low = dropped(torch.float64), dropped(dtype)
    for name, a, w, lo in zip(("out", "lse", "dq", "dk", "dv"), got, want, low):
        if name != "lse":
            check_close(name, a, w, lo.nan_to_num(0.0), dtype)
    torch.manual_seed(5)
    again = flex_attention(q, k, v, alibi, mask, dropout_p=p)
    assert torch.equal(again, got[0])


# torch 2.6's dynamo cannot read a function's closure cells, where a score_mod keeps its captured tensors: it
# breaks the graph there (the compiled call still runs, in two graphs). torch 2.11 and 2.13 trace them (tested
# there); 2.7-2.10 are not tested.
FULLGRAPH = tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 7)


def test_compile_fullgraph_and_the_trace_cache():
    """torch.compile(fullgraph=True) gives the eager values and the captured tensor's gradient (torch 2.6: with a
    graph break); a new sequence length (and a new tensor of the same dtype and rank) reuses the traced mod."""
    q, k, v = (randn(1, 2, 32, 16, seed=i) for i in range(3))
    mask = create_block_mask(causal, None, None, 32, 32, DEVICE, 16)
    results = []
    for fn in (flex_attention, torch.compile(flex_attention, fullgraph=FULLGRAPH)):
        rel_bias, bias = make_bias(torch.float32)
        out = fn(q, k, v, rel_bias, mask)
        out.square().sum().backward()
        results.append((out.detach(), bias.grad))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6) and torch.allclose(
        results[0][1], results[1][1], atol=1e-6
    )
    first, _ = make_bias(torch.float32)
    second, _ = make_bias(torch.float32)
    assert flex_codegen.trace(first, "score").key == flex_codegen.trace(second, "score").key
    assert flex_codegen.trace(first, "score") is flex_codegen.trace(second, "score")


def test_inputs_are_not_mutated_and_empty_rows():
    q, k, v = (randn(1, 2, 20, 16, seed=i) for i in range(3))
    before = [t.clone() for t in (q, k, v)]
    mask = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx > q_idx + 15, None, None, 20, 20, DEVICE, 16)
    out, lse = flex_attention(q, k, v, block_mask=mask, return_lse=True)
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
    assert torch.equal(out[:, :, 4:], torch.zeros_like(out[:, :, 4:])) and bool((lse[:, :, 4:] == float("-inf")).all())
    assert bool(torch.isfinite(lse[:, :, :4]).all())
    assert isinstance(create_block_mask(noop_mask, 1, 1, 20, 20, DEVICE, 16), BlockMask)


def test_bad_input():
    q = randn(1, 2, 16, 16)
    mask = create_block_mask(causal, None, None, 16, 16, DEVICE, 16)
    with pytest.raises(TypeError, match="score_mod .* must take 5 arguments"):
        flex_attention(q, q, q, lambda s, b, h: s)
    with pytest.raises(ValueError, match="torch.where"):
        flex_attention(q, q, q, lambda s, b, h, i, j: s if s > 0 else -s)
    with pytest.raises(ValueError, match="index every dimension"):
        flex_attention(q, q, q, lambda s, b, h, i, j: s + BIAS[h])
    with pytest.raises(ValueError, match="slicing"):
        flex_attention(q, q, q, lambda s, b, h, i, j: s + BIAS[h, :].sum())
    with pytest.raises(ValueError, match="neither in its closure"):
        flex_attention(q, q, q, lambda s, b, h, i, j: s + torch.ones(3, device=DEVICE)[i])
    with pytest.raises(ValueError, match="not supported in a mod"):
        flex_attention(q, q, q, lambda s, b, h, i, j: torch.erf(s))
    with pytest.raises(ValueError, match="made for"):
        flex_attention(randn(1, 2, 32, 16), randn(1, 2, 32, 16), randn(1, 2, 32, 16), block_mask=mask)
    with pytest.raises(ValueError, match="enable_gqa"):
        flex_attention(randn(1, 4, 16, 16), q, q)
    with pytest.raises(ValueError, match="4-D"):
        flex_attention(q[0], q, q)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        flex_attention(q.long(), q, q)
    with pytest.raises(ValueError, match="dropout_p"):
        flex_attention(q, q, q, dropout_p=1.5)
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        create_block_mask(causal, None, None, 16, 16, DEVICE, 24)
    with pytest.raises(ValueError, match="Q_LEN"):
        create_block_mask(causal, None, None, 0, 16, DEVICE, 16)
    with pytest.raises(TypeError, match="mask_mod .* must take 4 arguments"):
        create_block_mask(lambda b, h, i: i > 0, None, None, 16, 16, DEVICE, 16)
    with pytest.raises(ValueError, match="mask_mod .* returning floats"):
        create_block_mask(lambda b, h, i, j: (i - j).float(), None, None, 16, 16, DEVICE, 16)


def test_from_kv_blocks():
    """FlexAttention's constructor from the forward lists: the derived mask attends as the original, with or
    without the full lists (mask_mod then runs on every visited block); bad lists are refused."""
    q, k, v = (randn(1, 2, s, 16, seed=i) for i, s in enumerate((S_Q, S_K, S_K)))
    mask = create_block_mask(and_masks(causal, window), None, None, S_Q, S_K, DEVICE, 16)
    want = flex_attention(q, k, v, block_mask=mask)
    lists = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    again = BlockMask.from_kv_blocks(*lists, 16, mask.mask_mod, (S_Q, S_K))
    assert torch.equal(again.to_dense(), mask.to_dense())
    assert torch.equal(flex_attention(q, k, v, block_mask=again), want)
    dense = mask.to_dense()
    num, idx = dense.sum(-1, dtype=torch.int32), torch.argsort(1 - dense, dim=-1, stable=True).to(torch.int32)
    partial_only = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=16, mask_mod=mask.mask_mod, seq_lengths=(S_Q, S_K))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=partial_only), want, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="indices in"):
        BlockMask.from_kv_blocks(num, idx - 1, BLOCK_SIZE=16, seq_lengths=(S_Q, S_K))
    with pytest.raises(ValueError, match="together"):
        BlockMask.from_kv_blocks(num, idx, num, BLOCK_SIZE=16, seq_lengths=(S_Q, S_K))


@pytest.mark.parametrize("sq", [1, 7])
def test_split_rows_merge_to_the_unsplit_result(sq):
    """Flash-decoding: a few query rows over many key blocks, the block lists split (pinned three ways, and the
    automatic count) and merged, against the float64 reference and the unsplit kernel."""
    q, k, v = (
        randn(1, 2, sq, 16, dtype=torch.float16),
        randn(1, 2, 90, 16, dtype=torch.float16, seed=1),
        randn(1, 2, 90, 16, dtype=torch.float16, seed=2),
    )

    def tail(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + 90 - sq

    mask = create_block_mask(tail, None, None, sq, 90, DEVICE, 16)
    results = {}
    for splits in (1, 3, 0):
        with kp_core.pinned("_flex_fwd", splits=splits), kp_core.record_launches() as rec:
            results[splits] = flex_attention(q, k, v, alibi, mask, return_lse=True)
        if splits:  # 0: the automatic count, which splits here too (two programs for four slots off-GPU)
            assert (rec.count(flex.OP, kernel="_flex_combine") > 0) == (splits > 1), (splits, rec.launches)
    want, want_lse = reference(q, k, v, alibi, tail, torch.float64)
    low, _ = reference(q, k, v, alibi, tail, torch.float16)
    for out, lse in results.values():
        check_close("out", out, want, low, torch.float16)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-5)


def test_a_hand_made_block_mask_stays_in_bounds():
    """Counts past a list's width and negative indices (a BlockMask built by hand, unchecked) are clamped in the
    kernels: the call reads inside the tensors and gives finite values; wrong ranks are refused."""
    q = randn(1, 2, 32, 16)
    mask = create_block_mask(causal, None, None, 32, 32, DEVICE, 16)
    bad = BlockMask(
        mask.seq_lengths,
        torch.full_like(mask.kv_num_blocks, 99),
        torch.full_like(mask.kv_indices, -5),
        None,
        None,
        torch.full_like(mask.q_num_blocks, 99),
        torch.full_like(mask.q_indices, -5),
        None,
        None,
        mask.BLOCK_SIZE,
        None,
    )
    q.requires_grad_()
    out = flex_attention(q, q, q, block_mask=bad)
    out.sum().backward()
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(q.grad).all())
    with pytest.raises(ValueError, match="wrong ranks or shapes"):
        flex_attention(q, q, q, block_mask=BlockMask(**{**mask.__dict__, "kv_indices": mask.kv_indices[0]}))


TABLE = randn(HEADS, 8, seed=21, scale=0.5)
ZOO = {  # every function the code generator knows, each with its derivative checked through the kernels
    "sigmoid, sqrt, rsqrt": lambda s, b, h, i, j: torch.sigmoid(s) + torch.sqrt(s.abs() + 1.0) - torch.rsqrt(s * s + 1),
    "log, log2, exp2": lambda s, b, h, i, j: torch.log(s.abs() + 1.5) + torch.log2(s * s + 2.0) - torch.exp2(-s.abs()),
    "sin, cos, neg": lambda s, b, h, i, j: -torch.sin(s) + torch.cos(s * 0.5),
    "pow, minimum, clamp": lambda s, b, h, i, j: (
        torch.minimum(s**2 * 0.1, s) + (s * s + 1.0) ** 0.5 + s.clamp(min=-1.0)
    ),
    "xor, invert, to": lambda s, b, h, i, j: torch.where(
        ((i > j) ^ (j % 2 == 0)) & ~(i == 3), s, (s * 2).to(torch.float32)
    ),
    "zeros_like, full_like, divide": lambda s, b, h, i, j: (
        s / (torch.full_like(s, 2.0) + torch.zeros_like(s) + (i - j).abs())
    ),
    "integer ops": lambda s, b, h, i, j: s + ((i * 3 - j) // 4 % 5).to(torch.float32) * 0.1 + (i.float() / (j + 1)),
    "table, negative index": lambda s, b, h, i, j: s * TABLE[h, -1 - (i + j) % 8] + TABLE[h, (i - j) % 8],
}


@pytest.mark.parametrize("name", list(ZOO))
def test_every_function_of_the_code_generator(name):
    """Each op the tracer turns into Triton, forward and backward, against float64 (fp32 inputs)."""
    mod = ZOO[name]
    q, k, v, dout = (randn(1, HEADS, 20, 16, seed=i) for i in range(4))
    table = TABLE.requires_grad_() if "table" in name else None
    grads = {}
    for which, fn in (
        ("ours", lambda *t: flex_attention(*t, mod, return_lse=True)),
        ("ref", lambda *t: reference(*t, mod, None, torch.float64)),
        ("low", lambda *t: reference(*t, mod, None, torch.float32)),
    ):
        if table is not None:
            table.grad = None
        grads[which] = run(fn, (q, k, v), dout) + ([table.grad.clone()] if table is not None else [])
    if table is not None:
        TABLE.requires_grad_(False)
    for what, a, w, lo in zip(("out", "lse", "dq", "dk", "dv", "dtable"), *grads.values()):
        check_close(f"{name} {what}", a, w, lo, torch.float32)
