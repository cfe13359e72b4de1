"""Conformance spec for kp-attention's KV-cache decoding (kp::flash_attention_with_kvcache), against the float64
reference of kp_conformance.references.decode: each sequence's valid cache rows (gathered through block_table
when paged), kv heads repeated for GQA, scale, softcap c * tanh(s / c), the causal diagonal bottom-right and the
window about it, softmax, @ V. PyTorch's baseline is the same per-sequence computation by attention_lowp (SDPA,
or Hugging Face's eager attention with softcap). Rows that see no key are 0 with lse -inf.

The values, append and host-length cells run once per backend kp_attention routes to (the attention_backend
fixture, specs/conftest.py), each on the cases it can take (`fit`); the launch record shows its kernel ran."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kp_attention
import kp_conformance as kc
import kp_core
from kp_attention import backend as backends
from kp_attention.ops import attention_fa4
from kp_attention.ops import decode as decode_mod
from kp_conformance import fuzz, kv_cache, randn
from kp_conformance.references import allowed, attention64, attention_lowp, decode, kvcache_rows

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TIER = kc.current()
DEVICE = kc.device()
OP = "kp::flash_attention_with_kvcache"
EXAMPLES = 6 if kc.interpreting() else TIER.max_examples

kc.declare(
    kc.Spec(
        name="decode",
        package="kp-attention",
        ops=(OP,),
        reference=(
            "softmax(scale * q K^T) V over each sequence's cached keys in float64 (Vaswani et al. 2017, eq. 1), "
            "paged rows gathered through block_table, causal diagonal bottom-right (FlashAttention's "
            "flash_attn_with_kvcache), window, GQA by repeating kv heads, softcap c * tanh(s / c), ALiBi "
            "-slope * |i + L - Sq - j|, keys from cache_leftpad"
        ),
        dtypes=DTYPES,
        properties=("values", "switches", "append", "opcheck", "compile", "bad_input"),
    )
)


PER_BACKEND = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def backend_dtype(backend: str, dtype: torch.dtype) -> None:
    if backend != "kp" and dtype == torch.float32:
        pytest.skip(f"not covered: {backend} takes float16 and bfloat16 (kp routes float32 to its own kernel)")


def fit(c, backend):
    """Case c as FlashAttention-4 takes it: no ALiBi or cache_leftpad, head dims rounded up to a multiple of 8."""
    if backend != "fa4":
        return c
    return dict(c, alibi=None, leftpad=False, d=-(-c["d"] // 8) * 8)


def ran(rec, backend: str) -> None:
    """The backend's kernel ran: kp's split kernel, FlashAttention-4's under kp's op, or torch's with no kp op."""
    if backend == "kp":
        kc.assert_kernel_ran(rec, OP)
    elif backend == "fa4":
        assert attention_fa4.CUTE in rec.backends(OP), f"expected FlashAttention-4's kernel, got {rec.launches}"
    else:
        assert rec.count(backends.TORCH_OP, kernel=backend) == 1 and not rec.backends(OP), rec.launches


def rand(*shape, dtype, seed):
    return randn(*shape, dtype=dtype, device=DEVICE, seed=seed)


def make_cache(batch, capacity, hkv, d, dtype, paged, seed, page=32):
    return kv_cache(batch, capacity, hkv, d, dtype, DEVICE, paged=paged, seed=seed, page=page)


@st.composite
def decode_cases(draw):
    hkv = draw(st.sampled_from((1, 2)))
    causal = draw(st.booleans())
    return dict(
        batch=draw(st.integers(1, 3)),
        sq=draw(st.sampled_from((1, 1, 2, 5))),
        hq=hkv * draw(st.sampled_from((1, 4))),
        hkv=hkv,
        d=draw(st.sampled_from((16, 59, 64, 128) if DEVICE.type == "cuda" else (16, 59, 64))),
        capacity=draw(st.sampled_from((64, 97, 256))),
        paged=draw(st.booleans()),
        causal=causal,
        window=draw(st.sampled_from(((-1, -1), (24, -1)) if causal else ((-1, -1), (24, 3)))),
        softcap=draw(st.sampled_from((0.0, 0.0, 15.0))),
        alibi=draw(st.sampled_from((None, None, "head", "batch"))),  # ALiBi slopes per head or (batch, head)
        leftpad=draw(st.booleans()),  # sequences start a third of the way into their cache rows
        splits=draw(st.sampled_from((0, 1, 3))),
        seed=draw(st.integers(0, 2**16)),
        family=draw(st.sampled_from(kc.ATTENTION_FAMILIES)),  # per example: no more tests
    )


def apply_family(c, q, k_cache, bt, lens):
    """q and the cached keys reshaped into c's value family (kc.attention_family), judged per sequence on the keys
    each query sees; the cache is rewritten in place (its spare pages keep their values)."""
    n, d = c["capacity"], c["d"]
    keys = torch.cat([kvcache_rows(k_cache, b, n, bt) for b in range(c["batch"])]).double().cpu()
    visible = torch.zeros(c["batch"], c["sq"], n, dtype=torch.bool)
    for b, m in enumerate(lens):
        visible[b, :, :m] = allowed(c["sq"], m, c["causal"], c["window"], "cpu")
    g = torch.Generator().manual_seed(c["seed"] + 6)
    q64, keys = kc.attention_family(q.double().cpu(), keys, c["family"], g, scale=1 / math.sqrt(d), visible=visible)
    keys, j, page = keys.to(k_cache.dtype).to(DEVICE), torch.arange(n, device=DEVICE), k_cache.shape[1]
    for b in range(c["batch"]):
        if bt is None:
            k_cache[b] = keys[b]
        else:
            k_cache[bt[b].long()[j // page], j % page] = keys[b]
    return q64.to(dtype=q.dtype, device=DEVICE)


def run_case(c, dtype, backend="kp", **extra):
    """The call on drawn cache lengths (empty, short, full), checked by the rule; returns the launch record."""
    k_cache, v_cache, bt = make_cache(c["batch"], c["capacity"], c["hkv"], c["d"], dtype, c["paged"], c["seed"])
    q = rand(c["batch"], c["sq"], c["hq"], c["d"], dtype=dtype, seed=c["seed"] + 5)
    lens = [(0, 7, c["capacity"])[b % 3] for b in range(c["batch"])]
    if c.get("family", "normal") != "normal":
        q = apply_family(c, q, k_cache, bt, lens)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = dict(block_table=bt, causal=c["causal"], window=c["window"], softcap=c["softcap"])
    if c.get("alibi"):
        kw["alibi_slopes"] = kc.alibi_slopes(c["alibi"], c["batch"], c["hq"], c["seed"] + 7, DEVICE)
    if c.get("leftpad"):
        kw["cache_leftpad"] = torch.tensor([n // 3 for n in lens], dtype=torch.int32, device=DEVICE)
    with kp_core.record_launches() as rec:
        out, lse = kp_attention.flash_attention_with_kvcache(
            q, k_cache, v_cache, seqlens, num_splits=c["splits"], return_lse=True, **kw, **extra
        )
    ran(rec, backend)
    kc.check_decode(str(c), out, lse, q, k_cache, v_cache, lens, dtype, **kw)
    return rec


@pytest.mark.conformance(kernel="flash_attention_with_kvcache", prop="values")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@settings(PER_BACKEND, max_examples=EXAMPLES)
@given(c=decode_cases())
def test_values(dtype, attention_backend, c):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    backend_dtype(attention_backend, dtype)
    if attention_backend.startswith("torch"):
        pytest.skip("not covered: per-sequence lengths in a tensor (torch's kernels: test_one_length_on_the_host)")
    run_case(fit(c, attention_backend), dtype, attention_backend)


BASE = dict(
    batch=3,
    sq=2,
    hq=4,
    hkv=2,
    d=59,
    capacity=97,
    paged=False,
    causal=True,
    window=(-1, -1),
    softcap=0.0,
    splits=1,
    seed=11,
)
# Each compile-time switch of the split kernel, and the combine kernel, reached in every tier.
SWITCHES = [
    ("contiguous cache, one split (ONE_SPLIT)", {}),
    ("paged cache (PAGED), splits combined", {"paged": True, "splits": 3}),
    ("window left (HAS_LEFT)", {"window": (24, -1)}),
    ("non-causal, window right (HAS_RIGHT)", {"causal": False, "window": (-1, 3)}),
    ("non-causal, no window", {"causal": False}),
    ("softcap (SOFTCAP)", {"softcap": 15.0, "splits": 2}),
    ("ALiBi per (batch, head) (HAS_ALIBI)", {"alibi": "batch", "splits": 2}),
    ("cache_leftpad (HAS_LEFTPAD), paged", {"leftpad": True, "paged": True, "splits": 2}),
    ("full head dim", {"d": 64, "splits": 0}),
]


@pytest.mark.conformance(kernel="flash_attention_with_kvcache", prop="switches")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("what,change", SWITCHES, ids=[s[0] for s in SWITCHES])
def test_every_switch(dtype, what, change):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    c = dict(BASE, **change)
    with kp_core.pinned("_decode_split", block_n=16, num_warps=4, num_stages=2):  # several key blocks per split
        rec = run_case(c, dtype)
    if c["splits"]:  # explicit: one split writes the output itself, several are merged by the combine kernel
        assert (rec.count(OP, kernel="_decode_combine") > 0) == (c["splits"] > 1), rec.launches


@pytest.mark.conformance(kernel="flash_attention_with_kvcache", prop="append")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_new_tokens_are_written_into_the_cache(dtype, paged, attention_backend):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    backend_dtype(attention_backend, dtype)
    if attention_backend.startswith("torch"):
        pytest.skip("not covered: per-sequence lengths in a tensor (torch's kernels: test_one_length_on_the_host)")
    lens, new = [0, 20, 45], 3
    k_cache, v_cache, bt = make_cache(3, 64, 2, 32, dtype, paged, seed=15)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = rand(3, new, 4, 32, dtype=dtype, seed=16)
    k_new, v_new = rand(3, new, 2, 32, dtype=dtype, seed=17), rand(3, new, 2, 32, dtype=dtype, seed=18)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with kp_core.record_launches() as rec:
        out, lse = kp_attention.flash_attention_with_kvcache(
            q, k_cache, v_cache, seqlens, k=k_new, v=v_new, block_table=bt, return_lse=True
        )
    ran(rec, attention_backend)
    assert seqlens.tolist() == lens, "cache_seqlens must not change"
    k_exp, v_exp = k0.clone(), v0.clone()
    page = k_cache.shape[1]
    for b, n in enumerate(lens):
        for t in range(new):
            where = (b, n + t) if bt is None else (int(bt[b, (n + t) // page]), (n + t) % page)
            k_exp[where], v_exp[where] = k_new[b, t], v_new[b, t]
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), "cache not updated exactly in place"
    kc.check_decode("appended", out, lse, q, k_cache, v_cache, [n + new for n in lens], dtype, block_table=bt)


@pytest.mark.conformance(kernel="flash_attention_with_kvcache", prop="one length on the host")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
@pytest.mark.parametrize("batch,new", [(1, 0), (1, 1), (3, 1)], ids=["B1", "B1 new token", "B3 new token"])
def test_one_length_on_the_host(dtype, batch, new, attention_backend):
    """One query per sequence after `new` appended tokens, every sequence the same length given as an int: the
    call torch's kernels can take (kp_attention.functional._torch_refuses_kvcache), for every backend."""
    kc.skip_if_not_covered(dtype, uses_dot=True)
    backend_dtype(attention_backend, dtype)
    length, seed = 77, batch + new
    k_cache, v_cache, _ = make_cache(batch, 128, 2, 64, dtype, False, seed=seed)
    q = rand(batch, 1, 8, 64, dtype=dtype, seed=seed + 1)
    kv = [rand(batch, new, 2, 64, dtype=dtype, seed=seed + i) for i in (2, 3)] if new else [None, None]
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention_with_kvcache(q, k_cache, v_cache, length, k=kv[0], v=kv[1])
    ran(rec, attention_backend)
    if new:
        assert torch.equal(k_cache[:, length : length + new], kv[0]), "new tokens not written"
    lens = [length + new] * batch
    ref = decode(attention64, q, k_cache, v_cache, lens)[0]
    kc.check_close("out", out, ref, decode(attention_lowp, q, k_cache, v_cache, lens), dtype)


@pytest.mark.conformance(kernel="flash_attention_with_kvcache", prop="opcheck")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_opcheck(dtype):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    k_cache, v_cache, _ = make_cache(2, 32, 2, 16, dtype, False, seed=19)
    pk, pv, bt = make_cache(2, 32, 2, 16, dtype, True, seed=23, page=16)
    q = rand(2, 1, 4, 16, dtype=dtype, seed=20)
    k_new, v_new = rand(2, 1, 2, 16, dtype=dtype, seed=21), rand(2, 1, 2, 16, dtype=dtype, seed=22)
    seqlens = torch.tensor([5, 31], dtype=torch.int32, device=DEVICE)
    scale = 1 / math.sqrt(16)
    with kp_core.record_launches() as rec:
        torch.library.opcheck(
            decode_mod.KVCACHE.op,
            (q, k_cache, v_cache, seqlens, k_new, v_new, None, None, None, True, -1, -1, 0.0, scale, 2, "triton"),
        )
        slopes = torch.tensor([0.5, 0.25, 0.125, 1.0], device=DEVICE)
        leftpad = torch.tensor([2, 9], dtype=torch.int32, device=DEVICE)
        torch.library.opcheck(
            decode_mod.KVCACHE.op,
            (q, pk, pv, seqlens, None, None, bt, slopes, leftpad, True, 4, -1, 2.0, scale, 0, "triton"),
        )
    kc.assert_kernel_ran(rec, OP)


@pytest.mark.conformance(kernel="flash_attention_with_kvcache", prop="compile")
@pytest.mark.parametrize("dtype", DTYPES, ids=kc.dtype_id)
def test_compile_fullgraph_equals_eager(dtype):
    kc.skip_if_not_covered(dtype, uses_dot=True)
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, seqlens, k, v):
        return kp_attention.flash_attention_with_kvcache(
            q * 1, k_cache, v_cache, seqlens, k=k, v=v, window=(10, -1), return_lse=True
        )

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        k_cache, v_cache, _ = make_cache(2, 32, 1, 32, dtype, False, seed=24)
        q = rand(2, 2, 4, 32, dtype=dtype, seed=25)
        k_new, v_new = rand(2, 2, 1, 32, dtype=dtype, seed=26), rand(2, 2, 1, 32, dtype=dtype, seed=27)
        seqlens = torch.tensor([3, 20], dtype=torch.int32, device=DEVICE)
        with kp_core.record_launches() as rec:
            out, lse = fn(q, k_cache, v_cache, seqlens, k_new, v_new)
        kc.assert_kernel_ran(rec, OP)
        results.append((out, lse, k_cache, v_cache))
    for a, b in zip(*results):  # the same kernels either way (q * 1 is exact)
        assert torch.equal(a, b)


def _cache(d, paged=False):
    def r(*shape):
        return torch.randn(shape, dtype=torch.float16, device=d)

    args = dict(q=r(2, 1, 4, 16), cache_seqlens=torch.tensor([3, 20], dtype=torch.int32, device=d))
    if paged:  # 4 pages of 16 slots, two per sequence
        table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=d)
        return dict(args, k_cache=r(4, 16, 2, 16), v_cache=r(4, 16, 2, 16), block_table=table)
    return dict(args, k_cache=r(2, 32, 2, 16), v_cache=r(2, 32, 2, 16))


def _new_tokens(d):
    return dict(_cache(d), k=torch.randn(2, 1, 2, 16, device=d).half(), v=torch.randn(2, 1, 2, 16, device=d).half())


def _over(t: torch.Tensor) -> torch.Tensor:
    return t + 32  # past the cache's capacity / page count


HALF = (torch.float16, torch.bfloat16, torch.float32)
SEQLENS = fuzz.Tensor((torch.int32,), sized=(0,), values=False, index=_over)
CACHE = fuzz.Tensor(HALF, sized=(0, 2, 3), words=("batch", "head", "k_cache", "v_cache"))
DECODE_TARGETS = [
    fuzz.Target(
        "kp_attention.flash_attention_with_kvcache",
        "kp-attention",
        kp_attention.flash_attention_with_kvcache,
        _cache,
        dict(
            q=fuzz.Tensor(HALF, sized=(3,), words=("head dim",), first=True),
            k_cache=CACHE,
            v_cache=CACHE,
            cache_seqlens=SEQLENS,
            window=fuzz.Scalar(bad=((-2, 0), "0")),
            softcap=fuzz.Scalar(bad=(-1.0, "1")),
            num_splits=fuzz.Scalar(bad=(-1, 1.5, "2")),
        ),
        aliases=(("k_cache", "v_cache"),),
        report=decode_mod.check_inputs,
    ),
    fuzz.Target(
        "kp_attention.flash_attention_with_kvcache(paged)",
        "kp-attention",
        kp_attention.flash_attention_with_kvcache,
        lambda d: _cache(d, paged=True),
        dict(block_table=fuzz.Tensor((torch.int32,), sized=(0,), values=False, index=_over), cache_seqlens=SEQLENS),
        report=decode_mod.check_inputs,
    ),
    fuzz.Target(
        "kp_attention.flash_attention_with_kvcache(k, v)",
        "kp-attention",
        kp_attention.flash_attention_with_kvcache,
        _new_tokens,
        dict(
            k=fuzz.Tensor(HALF, sized=(0, 2, 3), words=("k_cache", "batch", "head")),
            v=fuzz.Tensor(HALF, sized=(0, 1, 2, 3), words=("k", "v_cache", "batch", "head")),
            cache_seqlens=fuzz.Tensor((torch.int32,), values=False, index=lambda t: t + 31),
        ),
        mutates=("k_cache", "v_cache"),
        report=decode_mod.check_inputs,
        aliases=(("k_cache", "v_cache"), ("k", "v")),
    ),
]


test_bad_input_fuzz = kc.fuzz_test("decode", DECODE_TARGETS)
