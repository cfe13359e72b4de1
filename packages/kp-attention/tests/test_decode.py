"""kp::flash_attention_with_kvcache (kp_attention.flash_attention_with_kvcache) by the conformance rule against the
shared float64 reference (kp_conformance.references.decode: each sequence's valid cache rows, gathered through
block_table when paged, with the bottom-right causal diagonal and window). Rows that see no key are defined as 0
with lse -inf (FlashAttention's convention). Every tensor is made on the device under test."""

import math

import pytest
import torch

import kp_attention
import kp_core
from kp_attention.ops import decode
from kp_conformance.strategies import kv_cache, randn
from kp_conformance.tolerance import check_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    torch.float16,
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            DEVICE == "cpu", reason="bf16 tl.dot is computed wrongly by the interpreter; GPU only"
        ),
    ),
]
OP = decode.OP
KERNEL = "interpret" if kp_core.interpreter_enabled() else kp_core.TRITON
fa = kp_attention.flash_attention_with_kvcache


@pytest.fixture
def small_blocks():
    """BLOCK_N = 16 whatever the head dim: several key blocks (and splits) at the small lengths used here."""
    with kp_core.pinned("_decode_split", block_n=16, num_warps=4, num_stages=2):
        yield


def check(name, out, lse, q, k_cache, v_cache, lens, **kw):
    check_decode(name, out, lse, q, k_cache, v_cache, lens, q.dtype, **kw)


def rand(*shape, dtype, seed):
    return randn(*shape, dtype=dtype, device=DEVICE, seed=seed)


def make_cache(batch, capacity, hkv, d, dtype, paged, seed, page=16):
    return kv_cache(batch, capacity, hkv, d, dtype, DEVICE, paged=paged, seed=seed, page=page)


# ---- values ----

# (paged, Sq, Hq, Hkv, D, window, softcap, causal); capacity 64, lengths 0, part, full (L < Sq: see below)
CASES = [
    (False, 1, 8, 2, 64, (-1, -1), 0.0, True),
    (True, 1, 8, 2, 64, (-1, -1), 0.0, True),
    (False, 3, 8, 1, 59, (-1, -1), 0.0, True),
    (True, 3, 4, 4, 80, (5, -1), 0.0, True),
    (False, 1, 4, 4, 32, (20, -1), 7.0, True),
    (True, 3, 8, 1, 17, (-1, -1), 3.0, True),
    (False, 3, 8, 2, 48, (6, 1), 0.0, False),
    (True, 1, 2, 2, 1, (-1, -1), 0.0, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_matches_reference(case, dtype, small_blocks):
    paged, sq, hq, hkv, d, window, softcap, causal = case
    lens = [0, 37, 64]
    k_cache, v_cache, bt = make_cache(len(lens), 64, hkv, d, dtype, paged, seed=d, page=32)  # 2 blocks a page
    q = rand(len(lens), sq, hq, d, dtype=dtype, seed=d + 7)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = dict(block_table=bt, causal=causal, window=window, softcap=softcap)
    for splits in (1, 3):
        with kp_core.record_launches() as rec:
            out, lse = fa(q, k_cache, v_cache, seqlens, num_splits=splits, return_lse=True, **kw)
        assert rec.backends(OP) == {KERNEL}
        assert rec.count(OP, kernel="_decode_combine") == (splits > 1)
        assert out.dtype == dtype and out.shape == q.shape and lse.shape == (len(lens), hq, sq)
        assert lse.dtype == torch.float32
        check(f"{case} splits {splits}", out, lse, q, k_cache, v_cache, lens, **kw)


@pytest.mark.parametrize("paged", [False, True])
def test_splits_agree(paged):
    """The default BLOCK_N over a longer cache (pages of 48: BLOCK_N 16): 1, 2, 5 splits and auto agree."""
    lens = [300, 480]
    k_cache, v_cache, bt = make_cache(2, 480, 1, 128, torch.float32, paged, seed=3, page=48)
    q = rand(2, 1, 4, 128, dtype=torch.float32, seed=4)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    outs = []
    for splits in (1, 2, 5, 0):
        with kp_core.record_launches() as rec:
            outs.append(fa(q, k_cache, v_cache, seqlens, block_table=bt, num_splits=splits, return_lse=True))
        assert rec.backends(OP) == {KERNEL}
        assert rec.count(OP, kernel="_decode_combine") == (splits != 1)  # auto: 2 programs, 2 splits on CPU
    for splits, (out, lse) in zip((1, 2, 5, 0), outs):
        check(f"{splits} splits", out, lse, q, k_cache, v_cache, lens, block_table=bt)


def test_row_blocks(small_blocks, monkeypatch):
    """group * Sq rows over several programs (MAX_BLOCK_M 16: 24 rows -> 2 row blocks), with a window."""
    monkeypatch.setattr(decode, "MAX_BLOCK_M", 16)
    k_cache, v_cache, bt = make_cache(2, 64, 1, 16, torch.float32, True, seed=30, page=32)
    q = rand(2, 3, 8, 16, dtype=torch.float32, seed=31)
    seqlens = torch.tensor([50, 9], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out, lse = fa(q, k_cache, v_cache, seqlens, block_table=bt, window=(12, -1), num_splits=splits, return_lse=True)
        check(f"row blocks, splits {splits}", out, lse, q, k_cache, v_cache, [50, 9], block_table=bt, window=(12, -1))


def test_int_seqlens_and_strided_q(small_blocks):
    k_cache, v_cache, _ = make_cache(2, 48, 2, 40, torch.float16, False, seed=11)
    q = rand(2, 4, 3, 40, dtype=torch.float16, seed=12).transpose(1, 2)  # (B, Sq=3, Hq=4, D), strided
    out, lse = fa(q, k_cache, v_cache, 30, num_splits=2, return_lse=True)
    check("int seqlens", out, lse, q, k_cache, v_cache, [30, 30])


def test_no_visible_key_gives_zero_and_minus_inf(small_blocks):
    """Empty caches, and causal queries above the first key (L < Sq), see nothing."""
    k_cache, v_cache, _ = make_cache(2, 32, 1, 16, torch.float32, False, seed=13)
    q = rand(2, 3, 2, 16, dtype=torch.float32, seed=14)
    seqlens = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    for splits in (1, 2):
        out, lse = fa(q, k_cache, v_cache, seqlens, num_splits=splits, return_lse=True)
        assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
        assert (out[1, :2] == 0).all() and (lse[1, :, :2] == float("-inf")).all()
        assert lse[1, :, 2].isfinite().all()
        check("empty", out, lse, q, k_cache, v_cache, [0, 1])


# ---- the in-place cache update ----


def _strided(t):
    """The same values with a head-dim stride of 2 (a view into a wider buffer)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    return view


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_new_kv_written_into_cache(paged, dtype, strided, small_blocks):
    lens, new = [0, 20, 45], 3
    k_cache, v_cache, bt = make_cache(3, 48, 2, 24, dtype, paged, seed=15)
    if strided:
        k_cache, v_cache = _strided(k_cache), _strided(v_cache)
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = rand(3, new, 4, 24, dtype=dtype, seed=16)
    k_new, v_new = rand(3, new, 2, 24, dtype=dtype, seed=17), rand(3, new, 2, 24, dtype=dtype, seed=18)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with kp_core.record_launches() as rec:
        out, lse = fa(q, k_cache, v_cache, seqlens, k=k_new, v=v_new, block_table=bt, num_splits=2, return_lse=True)
    assert rec.backends(OP) == {KERNEL}
    assert seqlens.tolist() == lens, "cache_seqlens must not change"
    k_exp, v_exp = k0.clone(), v0.clone()
    for b, n in enumerate(lens):
        for t in range(new):
            p = n + t
            where = (b, p) if bt is None else (int(bt[b, p // 16]), p % 16)
            k_exp[where], v_exp[where] = k_new[b, t], v_new[b, t]
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), "cache not updated exactly in place"
    check("appended", out, lse, q, k_cache, v_cache, [n + new for n in lens], block_table=bt)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_unchecked_bad_values_stay_in_bounds(paged, splits, small_blocks, monkeypatch):
    """With the value check off (a serving loop's choice; graph capture skips it too), lengths outside
    [0, capacity] and block ids outside the cache read and write nothing out of bounds: that sequence's rows
    come out NaN and its new k / v are not written; the other sequences are unaffected."""
    monkeypatch.setattr(decode, "VALIDATE_VALUES", False)
    new, d = 2, 16
    k_cache, v_cache, bt = make_cache(4, 64, 2, d, torch.float32, paged, seed=40)
    lens = [10, 63, -1, 30]  # 63 + 2 new overflows the 64 slots; -1 is negative
    if paged:
        bt[3, 1] = k_cache.shape[0]  # sequence 3's second page (keys 16..31, in use) does not exist
    k0, v0 = k_cache.clone(), v_cache.clone()
    q = rand(4, new, 4, d, dtype=torch.float32, seed=41)
    k_new, v_new = rand(4, new, 2, d, dtype=torch.float32, seed=42), rand(4, new, 2, d, dtype=torch.float32, seed=43)
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    with kp_core.record_launches() as rec:
        out, lse = fa(
            q, k_cache, v_cache, seqlens, k=k_new, v=v_new, block_table=bt, num_splits=splits, return_lse=True
        )
    assert rec.backends(OP) == {KERNEL}
    bad = [1, 2, 3] if paged else [1, 2]
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    check(
        "good sequence",
        out[:1],
        lse[:1],
        q[:1],
        k_cache[:1] if bt is None else k_cache,
        v_cache[:1] if bt is None else v_cache,
        [12],
        block_table=None if bt is None else bt[:1],
    )
    k_exp, v_exp = k0.clone(), v0.clone()
    for t in range(new):
        where = (0, 10 + t) if bt is None else (int(bt[0, 0]), 10 + t)
        k_exp[where], v_exp[where] = k_new[0, t], v_new[0, t]
        if not paged:  # sequence 3 is good when not paged
            k_exp[3, 30 + t], v_exp[3, 30 + t] = k_new[3, t], v_new[3, t]
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), "a bad sequence wrote into the cache"
    if not paged:
        check("good sequence 3", out[3:], lse[3:], q[3:], k_cache[3:], v_cache[3:], [32])


# ---- registration: opcheck, compile, backends ----


def op_args(q, k_cache, v_cache, cache_seqlens, *, k=None, v=None, block_table=None, softcap=0.0, num_splits=0):
    """kp::flash_attention_with_kvcache's positional arguments (causal, no window, scale 1/sqrt(D))."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    args = (q, k_cache, v_cache, cache_seqlens, k, v, block_table, None, None, True, -1, -1, softcap, scale)
    return (*args, num_splits, "triton")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_opcheck(dtype):
    k_cache, v_cache, _ = make_cache(2, 32, 2, 16, dtype, False, seed=19)
    q = rand(2, 1, 4, 16, dtype=dtype, seed=20)
    seqlens = torch.tensor([5, 31], dtype=torch.int32, device=DEVICE)
    k_new, v_new = rand(2, 1, 2, 16, dtype=dtype, seed=21), rand(2, 1, 2, 16, dtype=dtype, seed=22)
    pk, pv, bt = make_cache(2, 32, 2, 16, dtype, True, seed=23)
    with kp_core.record_launches() as rec:
        torch.library.opcheck(decode.KVCACHE.op, op_args(q, k_cache, v_cache, seqlens, k=k_new, v=v_new))
        if dtype == torch.float32:  # the other layouts once (each opcheck runs the op several times)
            torch.library.opcheck(decode.KVCACHE.op, op_args(q, k_cache, v_cache, seqlens, num_splits=2))
            torch.library.opcheck(decode.KVCACHE.op, op_args(q, pk, pv, seqlens, block_table=bt, softcap=2.0))
    assert rec.backends(OP) == {KERNEL}


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, seqlens, k, v):
        return fa(q * 1, k_cache, v_cache, seqlens, k=k, v=v, window=(10, -1), return_lse=True)

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (step, compiled):
        k_cache, v_cache, _ = make_cache(2, 32, 1, 32, torch.float32, False, seed=24)
        q = rand(2, 2, 4, 32, dtype=torch.float32, seed=25)
        k_new, v_new = rand(2, 2, 1, 32, dtype=torch.float32, seed=26), rand(2, 2, 1, 32, dtype=torch.float32, seed=27)
        seqlens = torch.tensor([3, 20], dtype=torch.int32, device=DEVICE)
        with kp_core.record_launches() as rec:
            out, lse = fn(q, k_cache, v_cache, seqlens, k_new, v_new)
        assert rec.backends(OP) == {KERNEL}
        results.append((out, lse, k_cache, v_cache))
    for a, b in zip(*results):  # the same kernels either way (x * 1 is exact)
        assert torch.equal(a, b)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs: GPU only")
def test_compile_reduce_overhead_with_split_workspaces():
    """torch.compile(mode="reduce-overhead") over a split decode (partial outputs in kp_core workspaces) as the
    batch changes: the workspaces made during cudagraph trees' warmup must not stay alive in their pool (they
    refused to run with 'tensors in the cudagraph pool not tracked as outputs'), and replays equal eager."""
    torch._dynamo.reset()

    def step(q, k_cache, v_cache, seqlens):
        return fa(q * 1, k_cache, v_cache, seqlens, num_splits=4)

    compiled = torch.compile(step, mode="reduce-overhead")
    k_cache, v_cache, _ = make_cache(4, 512, 2, 64, torch.float16, False, seed=40)
    for i, n in enumerate((2, 3, 2, 4, 3)):
        q = rand(n, 1, 4, 64, dtype=torch.float16, seed=41 + i)
        seqlens = torch.tensor([500, 311, 64, 129][:n], dtype=torch.int32, device=DEVICE)
        torch.compiler.cudagraph_mark_step_begin()
        got = compiled(q, k_cache[:n], v_cache[:n], seqlens).clone()
        assert torch.equal(got, step(q, k_cache[:n], v_cache[:n], seqlens)), n


def test_reference_backend_is_selectable(monkeypatch):
    k_cache, v_cache, bt = make_cache(2, 32, 2, 24, torch.float32, True, seed=28)
    q = rand(2, 3, 4, 24, dtype=torch.float32, seed=29)
    seqlens = torch.tensor([7, 32], dtype=torch.int32, device=DEVICE)
    kw = dict(block_table=bt, window=(4, -1), softcap=5.0, return_lse=True)
    monkeypatch.setenv("KP_BACKEND", "reference")
    with kp_core.record_launches() as rec:
        out, lse = fa(q, k_cache, v_cache, seqlens, **kw)
    assert rec.backends(OP) == {kp_core.REFERENCE}
    check("reference path", out, lse, q, k_cache, v_cache, [7, 32], block_table=bt, window=(4, -1), softcap=5.0)


def test_auto_num_splits(monkeypatch):
    monkeypatch.setattr(decode.kp_core, "sm_count", lambda index: 132)
    cuda = torch.device("cuda", 0)
    assert decode.auto_num_splits(cuda, 8, 10_000) == math.ceil(decode.WAVES * 132 / 8)  # B1 Hkv8: many splits
    assert decode.auto_num_splits(cuda, 8, 4) == 4  # never more than the key blocks
    assert decode.auto_num_splits(cuda, 512, 10_000) == 1  # B64 Hkv8 already fills the GPU
    full = decode.FULL_WAVES * 132
    assert decode.auto_num_splits(cuda, full, 10_000) == 1 < decode.auto_num_splits(cuda, full - 1, 10_000)
    assert decode.auto_num_splits(torch.device("cpu"), 2, 100) == 2


# ---- bad input ----


def _t(*shape, dtype=torch.float16, device=None):
    return torch.zeros(shape, dtype=dtype, device=DEVICE if device is None else device)


def _i(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


Q, KC, SL = _t(2, 1, 4, 8), _t(2, 16, 2, 8), _i(3, 4)
PK, BT = _t(5, 16, 2, 8), _i([0, 1], [2, 3])
BAD_INPUTS = [
    ("q not a tensor", lambda: fa([[1.0]], KC, KC, SL), TypeError, "q"),
    ("integer q", lambda: fa(_t(2, 1, 4, 8, dtype=torch.int32), KC, KC, SL), TypeError, "q"),
    ("fp64 q", lambda: fa(_t(2, 1, 4, 8, dtype=torch.float64), KC, KC, SL), TypeError, "q"),
    ("dtype mix", lambda: fa(Q, _t(2, 16, 2, 8, dtype=torch.float32), KC, SL), TypeError, "k_cache"),
    ("v_cache dtype", lambda: fa(Q, KC, _t(2, 16, 2, 8, dtype=torch.float32), SL), TypeError, "v_cache"),
    ("device mix", lambda: fa(Q, _t(2, 16, 2, 8, device="meta"), KC, SL), ValueError, "device"),
    ("q ndim", lambda: fa(_t(2, 4, 8), KC, KC, SL), ValueError, "q"),
    ("k_cache ndim", lambda: fa(Q, _t(16, 2, 8), KC, SL), ValueError, "k_cache"),
    ("batch mismatch", lambda: fa(Q, _t(3, 16, 2, 8), _t(3, 16, 2, 8), SL), ValueError, "batch"),
    ("head dims differ", lambda: fa(Q, _t(2, 16, 2, 16), _t(2, 16, 2, 16), SL), ValueError, "head dim"),
    ("v_cache shape", lambda: fa(Q, KC, _t(2, 16, 1, 8), SL), ValueError, "v_cache"),
    ("kv heads do not divide", lambda: fa(Q, _t(2, 16, 3, 8), _t(2, 16, 3, 8), SL), ValueError, "heads"),
    ("head dim too large", lambda: fa(_t(1, 1, 1, 512), _t(1, 4, 1, 512), _t(1, 4, 1, 512), 1), ValueError, "head dim"),
    ("seqlens int64", lambda: fa(Q, KC, KC, _i(3, 4, dtype=torch.int64)), TypeError, "cache_seqlens"),
    ("seqlens shape", lambda: fa(Q, KC, KC, _i(3)), ValueError, "cache_seqlens"),
    ("seqlens float", lambda: fa(Q, KC, KC, 2.0), TypeError, "cache_seqlens"),
    ("int seqlens past capacity", lambda: fa(Q, KC, KC, 17), ValueError, "cache_seqlens"),
    ("k without v", lambda: fa(Q, KC, KC, SL, k=_t(2, 1, 2, 8)), ValueError, "k and v"),
    ("new k shape", lambda: fa(Q, KC, KC, SL, k=_t(2, 1, 1, 8), v=_t(2, 1, 1, 8)), ValueError, "k must"),
    ("new v shape", lambda: fa(Q, KC, KC, SL, k=_t(2, 1, 2, 8), v=_t(2, 2, 2, 8)), ValueError, "v must"),
    ("new k dtype", lambda: fa(Q, KC, KC, SL, k=_t(2, 1, 2, 8, dtype=torch.float32), v=_t(2, 1, 2, 8)), TypeError, "k"),
    ("block_table int64", lambda: fa(Q, PK, PK, SL, block_table=BT.long()), TypeError, "block_table"),
    ("block_table ndim", lambda: fa(Q, PK, PK, SL, block_table=_i(0, 1)), ValueError, "block_table"),
    ("block_table batch", lambda: fa(Q, PK, PK, SL, block_table=_i([0, 1])), ValueError, "block_table"),
    ("block_size not x16", lambda: fa(Q, _t(5, 8, 2, 8), _t(5, 8, 2, 8), SL, block_table=BT), ValueError, "block_size"),
    ("bad window", lambda: fa(Q, KC, KC, SL, window=(-2, 0)), ValueError, "window"),
    ("window not a pair", lambda: fa(Q, KC, KC, SL, window=3), TypeError, "window"),
    ("negative softcap", lambda: fa(Q, KC, KC, SL, softcap=-1.0), ValueError, "softcap"),
    ("negative num_splits", lambda: fa(Q, KC, KC, SL, num_splits=-1), ValueError, "num_splits"),
]


@pytest.mark.parametrize("what,call,error,words", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(what, call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_a_checked_signature_still_checks_what_changes_per_call():
    """A repeated call skips the checks of its signature (backend.CALLS), never those of what a signature leaves
    out: an int length's value, num_splits=True where 1 passed, new caches given the new tokens."""
    kc = _t(2, 16, 2, 8)
    calls = kp_attention.backend.CALLS
    calls.clear()
    fa(Q, kc, kc.clone(), 3, num_splits=1)  # checked, kept
    fa(Q, kc, kc.clone(), 3, num_splits=1)
    assert len(calls) == 1, "the second call is the first's signature"
    with pytest.raises(ValueError, match="cache_seqlens"):
        fa(Q, kc, kc.clone(), 17, num_splits=1)
    with pytest.raises(ValueError, match="num_splits"):
        fa(Q, kc, kc.clone(), 3, num_splits=True)
    new = dict(k=_t(2, 1, 2, 8), v=_t(2, 1, 2, 8))
    fa(Q, kc, kc.clone(), 3, **new)
    with pytest.raises(ValueError, match="must not share memory"):
        fa(Q, kc, kc, 3, **new)  # one cache for k and v: the new tokens' writes would overlap


BAD_VALUES = [  # values only the device sees: (what, call, the words of the "sync" mode's error)
    ("seqlens negative", lambda: fa(Q, KC, KC, _i(-1, 4)), "cache_seqlens"),
    ("seqlens past capacity", lambda: fa(Q, KC, KC, _i(3, 17)), "cache_seqlens"),
    ("new k overflows", lambda: fa(Q, KC, KC.clone(), _i(3, 15), k=_t(2, 2, 2, 8), v=_t(2, 2, 2, 8)), "exceed"),
    ("block id out of range", lambda: fa(Q, PK, PK, SL, block_table=_i([0, 1], [5, 3])), "block_table"),
    ("paged past capacity", lambda: fa(Q, PK, PK, _i(3, 33), block_table=BT), "cache_seqlens"),
]


@pytest.mark.parametrize("what,call,words", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_raise_at_once_in_sync_mode(what, call, words, monkeypatch):
    monkeypatch.setattr(decode, "VALIDATE_VALUES", "sync")
    with pytest.raises(ValueError, match=words):
        call()


@pytest.mark.parametrize("what,call,words", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_values_are_reported_later_without_a_sync(what, call, words, monkeypatch):
    """By default the call does not read the values back: the kernel flags them, check_inputs() (or a later call,
    once the flag's copy has landed) raises, and the flag is cleared."""
    monkeypatch.setattr(decode, "REPORT_EVERY", 1)  # every call's turn (the period: the test below)
    decode.check_inputs(torch.device(DEVICE))  # nothing pending from earlier tests
    with kp_core.record_launches() as rec:
        call()  # no error here: the host never waited for the values
    assert rec.backends(OP) == {KERNEL}
    with pytest.raises(ValueError, match="earlier call had cache_seqlens"):
        decode.check_inputs(torch.device(DEVICE))
    decode.check_inputs(torch.device(DEVICE))  # reported once, then cleared
    call()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(ValueError, match="earlier call"):  # the next call reports it, its copy having landed
        fa(Q, KC, KC, SL)


def test_the_flag_is_copied_back_once_every_report_every_calls(monkeypatch):
    """Between two turns a call adds no host work (no copy, no event); a bad value is still reported, at a turn."""
    device = torch.device(DEVICE)
    decode.check_inputs(device)
    decode._flag(device).calls = 0
    copies, copy_back = [], decode._copy_back
    monkeypatch.setattr(decode, "_copy_back", lambda flag: copies.append(1) or copy_back(flag))
    for _ in range(2 * decode.REPORT_EVERY):
        fa(Q, KC, KC, SL)
    # the first call and call REPORT_EVERY + 1 copy (the second only once the first copy has landed)
    assert 1 <= len(copies) <= 2 and (DEVICE == "cuda" or len(copies) == 2)
    BAD_VALUES[0][1]()  # no error here
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    with pytest.raises(ValueError, match="earlier call"):
        for _ in range(2 * decode.REPORT_EVERY + 1):  # its flag copied at the next turn, reported at the one after
            fa(Q, KC, KC, SL)
    decode.check_inputs(device)


def test_registered():
    info = kp_core.registered_kernels()[OP]
    assert info.package == "kp-attention" and info.spec == "decode"
    assert set(info.dtypes) == {torch.float16, torch.bfloat16, torch.float32}
