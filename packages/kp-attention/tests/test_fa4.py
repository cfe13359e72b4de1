"""FlashAttention-4 behind kp's ops (kp_attention.ops.attention_fa4): the adapter's mapping of kp's arguments onto
FlashAttention-4's, its refusals, the unavailable reasons, and backend="fa4" through every entry point. Off a GPU
(and on one, for the mapping) FlashAttention-4's interface is replaced by tests/fa4_stub.py, a float64 stand-in
written from FlashAttention-4's stated conventions; its results are compared with kp's own kernel on the same
call. The real kernels are checked by the conformance specs' fa4 cells on a GPU with the [fa4] extra."""

import importlib.metadata

import fa4_stub
import pytest
import torch

import kp_attention
import kp_attention.flash_attn as fa
import kp_core
from kp_attention.ops import attention, attention_fa4, decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16
FWD = ("kp::flash_attention", "flash_attn_fwd")


@pytest.fixture
def stub(monkeypatch):
    """FlashAttention-4 'available' everywhere, computed by the stand-in; backend arguments not pinned to kp."""
    monkeypatch.setattr(attention_fa4, "interface", lambda: fa4_stub)
    monkeypatch.setattr(attention_fa4, "unavailable", lambda device: None)
    fa4_stub.calls.clear()
    kp_core.unpin("attention_backend")  # the kp_kernels fixture pins "kp"; it restores the pin afterwards
    yield fa4_stub.calls


def randn(*shape, seed, dtype=DTYPE, grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE, dtype).requires_grad_(grad)


def qkv(b=2, sq=37, sk=45, hq=4, hkv=2, d=32, seed=0, grad=False):
    return [randn(b, s, h, d, seed=seed + i, grad=grad) for i, (s, h) in enumerate(((sq, hq), (sk, hkv), (sk, hkv)))]


def close(a, b, what):
    torch.testing.assert_close(a.float(), b.float(), atol=4e-3, rtol=4e-3, msg=lambda m: f"{what}: {m}")


CASES = [
    dict(causal=True),
    dict(window=(8, -1)),
    dict(window=(6, 3)),
    dict(causal=True, window=(10, -1), softcap=4.0, scale=0.3),
    dict(),
]


@pytest.mark.parametrize("options", CASES, ids=str)
def test_forced_fa4_runs_its_kernel_and_agrees_with_kp(stub, options):
    q, k, v = qkv(seed=1)
    with kp_core.record_launches() as rec:
        out, lse = kp_attention.flash_attention(q, k, v, return_lse=True, backend="fa4", **options)
    assert rec.kernels("kp::flash_attention") == {"flash_attn_fwd"} and rec.backends() == {attention_fa4.CUTE}
    ref, ref_lse = kp_attention.flash_attention(q, k, v, return_lse=True, backend="kp", **options)
    close(out, ref, "out")
    fin = torch.isfinite(ref_lse)
    assert torch.equal(fin, torch.isfinite(lse))
    close(lse[fin], ref_lse[fin], "lse")
    # kp's window (left, right), -1 unbounded, causal right = 0, as FlashAttention-4's keywords
    kw = stub[0][1]
    left, right = options.get("window", (-1, -1))
    right = 0 if options.get("causal") else right
    assert kw["causal"] is False and kw["num_splits"] == 1 and kw["return_lse"]
    assert (kw["window_size_left"], kw["window_size_right"]) == tuple(None if w < 0 else w for w in (left, right))
    assert kw["softmax_scale"] == pytest.approx(options.get("scale") or 32**-0.5)


def test_fa4_gradients_through_out_and_lse(stub):
    q, k, v = qkv(seed=2, sq=30, sk=41)
    do = randn(*q.shape, seed=9)

    def grads(backend):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = kp_attention.flash_attention(*leaves, causal=True, return_lse=True, backend=backend)
        ((out.float() * do.float()).sum() + lse.square().sum()).backward()
        return [t.grad for t in leaves]

    with kp_core.record_launches() as rec:
        ours = grads("fa4")
    assert rec.kernels("kp::flash_attention_backward") == {"flash_attn_bwd"}
    assert stub[-1][0] == "bwd" and stub[-1][1]["dlse"] is not None
    for name, a, b in zip(("dq", "dk", "dv"), ours, grads("kp")):
        close(a, b, name)


def test_fa4_deterministic_reaches_its_backward(stub):
    q, k, v = qkv(seed=3, grad=True)
    kp_attention.flash_attention(q, k, v, backend="fa4", deterministic=True).sum().backward()
    assert stub[-1][1]["deterministic"] is True


def test_fa4_varlen_and_paged_varlen(stub):
    lens_q, lens_k = [3, 20, 0, 9], [5, 20, 4, 30]
    cu_q = torch.tensor([0, 3, 23, 23, 32], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 5, 25, 29, 59], dtype=torch.int32, device=DEVICE)
    q, k, v = randn(32, 4, 32, seed=4), randn(59, 2, 32, seed=5), randn(59, 2, 32, seed=6)
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention_varlen(q, k, v, *args, causal=True, backend="fa4")
    assert rec.kernels("kp::flash_attention_varlen") == {"flash_attn_fwd"}
    kw = stub[-1][1]
    assert kw["cu_seqlens_q"] is not None and kw["cu_seqlens_k"] is not None and kw["page_table"] is None
    close(out, kp_attention.flash_attention_varlen(q, k, v, *args, causal=True, backend="kp"), "varlen out")
    # the same keys in shuffled pages of 16: FlashAttention-4 takes page_table with seqused_k, not cu_seqlens_k
    page, per = 16, 2
    table = torch.randperm(per * 4, generator=torch.Generator().manual_seed(0)).view(4, per).to(torch.int32)
    table = table.to(DEVICE)
    pages = [torch.zeros(per * 4, page, 2, 32, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    for i, n in enumerate(lens_k):
        j = torch.arange(n, device=DEVICE)
        for pg, t in zip(pages, (k, v)):
            pg[table[i].long()[j // page], j % page] = t[cu_k[i] : cu_k[i + 1]]
    paged = kp_attention.flash_attention_varlen(q, *pages, *args, causal=True, block_table=table, backend="fa4")
    kw = stub[-1][1]
    assert kw["cu_seqlens_k"] is None and kw["page_table"] is table
    assert kw["seqused_k"].tolist() == lens_k
    close(paged, out, "paged varlen out")


def test_fa4_kvcache_appends_then_attends(stub):
    q, k_new, v_new = randn(2, 1, 4, 32, seed=7), randn(2, 1, 2, 32, seed=8), randn(2, 1, 2, 32, seed=9)
    caches = [randn(2, 64, 2, 32, seed=s) for s in (10, 11)]
    copies = [c.clone() for c in caches]
    lengths = torch.tensor([5, 40], dtype=torch.int32, device=DEVICE)
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention_with_kvcache(q, *caches, lengths, k=k_new, v=v_new, backend="fa4")
    assert "flash_attn_fwd" in rec.kernels(decode.OP)
    assert torch.equal(caches[0][1, 40], k_new[1, 0]) and torch.equal(caches[1][0, 5], v_new[0, 0])
    kw = stub[-1][1]
    assert kw["seqused_k"].tolist() == [6, 41] and kw["window_size_right"] == 0  # causal by default
    ref = kp_attention.flash_attention_with_kvcache(q, *copies, lengths, k=k_new, v=v_new, backend="kp")
    close(out, ref, "kvcache out")


def test_fa4_kvcache_clamps_bad_lengths_and_reports_them(stub):
    q, caches = randn(2, 1, 4, 32, seed=12), [randn(2, 16, 2, 32, seed=s) for s in (13, 14)]
    lengths = torch.tensor([5, 99], dtype=torch.int32, device=DEVICE)  # 99 > the cache's 16 slots
    decode.check_inputs(q.device)  # a clean flag first
    kp_attention.flash_attention_with_kvcache(q, *caches, lengths, backend="fa4")
    assert stub[-1][1]["seqused_k"].tolist() == [5, 16], "FlashAttention-4 must never read past the cache"
    with pytest.raises(ValueError, match="outside the cache"):
        decode.check_inputs(q.device)


@pytest.mark.parametrize(
    "call, why",
    [
        (lambda q, k, v: kp_attention.flash_attention(q.float(), k.float(), v.float(), backend="fa4"), "float32"),
        (lambda q, k, v: kp_attention.flash_attention(q[..., :27], k[..., :27], v[..., :27], backend="fa4"), "27"),
        (
            lambda q, k, v: kp_attention.flash_attention(q, k, v, alibi_slopes=q.new_ones(4).float(), backend="fa4"),
            "ALiBi",
        ),
        (lambda q, k, v: kp_attention.flash_attention(q, k, v, dropout_p=0.1, backend="fa4"), "dropout"),
        (
            lambda q, k, v: kp_attention.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)),
                attn_mask=q.new_ones(37, 45).bool(),
                enable_gqa=True,
                backend="fa4",
            ),
            "mask",
        ),
        (
            lambda q, k, v: kp_attention.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, enable_gqa=True, backend="fa4"
            ),
            "top-left",
        ),
        (
            lambda q, k, v: kp_attention.flash_attention_with_kvcache(
                q[:, :1], k, v, 9, cache_leftpad=torch.zeros(2, dtype=torch.int32, device=q.device), backend="fa4"
            ),
            "cache_leftpad",
        ),
    ],
    ids=["fp32", "head dim", "alibi", "dropout", "mask", "sdpa causal Sq != Sk", "leftpad"],
)
def test_forcing_fa4_where_it_cannot_says_why(stub, call, why):
    with pytest.raises(ValueError, match=f"backend='fa4' cannot take this call: .*{why}"):
        call(*qkv(seed=15))


def test_fa4_unavailable_reasons(monkeypatch):
    assert attention_fa4.unavailable(torch.device("cpu")) == "not on a CUDA device"
    attention_fa4._module.cache_clear()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    try:
        monkeypatch.setattr(importlib.metadata, "version", missing)
        assert "not installed" in attention_fa4._module() and "kp-attention[fa4]" in attention_fa4._module()
        attention_fa4._module.cache_clear()
        monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.0b1")
        assert "4.0.0b1 is not a version kp-attention was tested with" in attention_fa4._module()
        with pytest.raises(RuntimeError, match="FlashAttention-4 unavailable"):
            attention_fa4.interface()
    finally:
        attention_fa4._module.cache_clear()
    if DEVICE == "cpu":  # without the stub, forcing fa4 off a GPU names why
        kp_core.unpin("attention_backend")
        with pytest.raises(ValueError, match="not on a CUDA device"):
            kp_attention.flash_attention(*qkv(seed=16), backend="fa4")


def test_the_ops_check_impl(stub):
    q, k, v = qkv(seed=17)
    with pytest.raises(ValueError, match="impl must be one of"):
        attention.FLASH(q, k, v, None, None, None, 0.25, 0.0, -1, -1, True, 0.0, "cutlass", False)
    caches = [randn(2, 16, 2, 32, seed=s) for s in (18, 19)]
    lens = torch.tensor([3, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="impl must be one of"):
        args = (None, None, None, None, None, True, -1, -1, 0.0, 0.2, 0, "cutlass")
        decode.KVCACHE(q[:, :1], *caches, lens, *args)


def test_learnable_sink_joins_the_softmax(stub):
    """out and lse with a sink logit per head against the float64 formula (softmax over the keys and the sink, the
    sink carrying no value), gradients included (the sink's too), on kp's kernel and through fa4."""
    q, k, v = qkv(seed=20, sq=21, sk=33)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)

    def formula(q, k, v, sink):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(2, 2)) * 32**-0.5
        i, j = torch.arange(21)[:, None], torch.arange(33)[None, :]
        s = s.masked_fill((j > i + 12).to(s.device), float("-inf"))  # bottom-right causal
        s = torch.cat([s, sink.view(1, 4, 1, 1).expand(*s.shape[:3], 1)], -1)
        p = torch.softmax(s, -1)[..., :-1]
        return torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(2, 2)), torch.logsumexp(s, -1)

    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    ref, ref_lse = formula(*leaves64)
    (ref.sum() + ref_lse.sum()).backward()
    for backend in ("kp", "fa4"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sink)]
        out, lse = kp_attention.flash_attention(
            *leaves[:3], causal=True, learnable_sink=leaves[3], return_lse=True, backend=backend
        )
        (out.float().sum() + lse.sum()).backward()
        close(out, ref, f"{backend} out")
        close(lse, ref_lse, f"{backend} lse")
        for name, a, b in zip(("dq", "dk", "dv", "dsink"), leaves, leaves64):
            torch.testing.assert_close(a.grad.double(), b.grad, atol=3e-2, rtol=3e-2, msg=f"{backend} {name}")
    with pytest.raises(ValueError, match=r"learnable_sink must have shape \(4,\)"):
        kp_attention.flash_attention(q, k, v, learnable_sink=sink[:2])


def test_learnable_sink_on_varlen_and_kvcache():
    """The sink composed over the varlen and KV-cache calls equals each sequence's dense call with the sink."""
    sink = torch.tensor([0.3, 1.5], device=DEVICE)
    q, k, v = randn(14, 2, 32, seed=21), randn(20, 2, 32, seed=22), randn(20, 2, 32, seed=23)
    cu_q = torch.tensor([0, 6, 14], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 9, 20], dtype=torch.int32, device=DEVICE)
    out, lse = kp_attention.flash_attention_varlen(q, k, v, cu_q, cu_k, 8, 11, learnable_sink=sink, return_lse=True)
    for b in range(2):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        o, lse_b = kp_attention.flash_attention(
            q[None, sq], k[None, sk], v[None, sk], learnable_sink=sink, return_lse=True
        )
        close(out[sq], o[0], "varlen out")
        close(lse[:, sq], lse_b[0], "varlen lse")
    caches = [randn(1, 16, 2, 32, seed=s) for s in (24, 25)]
    out, lse = kp_attention.flash_attention_with_kvcache(q[None, :1], *caches, 9, learnable_sink=sink, return_lse=True)
    o, lse_d = kp_attention.flash_attention(
        q[None, :1], caches[0][:, :9], caches[1][:, :9], causal=True, learnable_sink=sink, return_lse=True
    )
    close(out, o, "kvcache out")
    close(lse, lse_d, "kvcache lse")


def test_the_flashattention_module_and_patch_take_the_backend(stub):
    q, k, v = qkv(seed=26)
    with kp_core.record_launches() as rec:
        fa.flash_attn_func(q, k, v, causal=True, backend="fa4")
    assert rec.backends("kp::flash_attention") == {attention_fa4.CUTE}
    with pytest.raises(ValueError, match="backend must be one of"):
        fa.flash_attn_func(q, k, v, backend="cudnn")


def test_fa4_under_compile_equals_eager_on_strided_inputs(stub):
    """The op's fake kernels say contiguous outputs and gradients in q's, k's and v's layouts (a (B, H, S, D)
    tensor's view here, as the SDPA drop-in passes): compiled and eager agree on them."""
    torch._dynamo.reset()

    def f(q, k, v):
        return kp_attention.flash_attention(q * 1, k, v, causal=True, backend="fa4")

    results = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        q, k, v = (randn(2, h, 20, 32, seed=30 + h).transpose(1, 2).requires_grad_() for h in (4, 2, 2))
        out = fn(q, k, v)
        out.float().square().sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    # FlashAttention-4 writes the gradients into kp's buffers, laid out as the leaves are: autograd copies none
    given = stub[-1][1]
    assert [given[n].stride() for n in ("dq", "dk", "dv")] == [t.stride() for t in (q, k, v)]
    assert all(t.grad.stride() == t.stride() for t in (q, k, v))
