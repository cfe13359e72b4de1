"""backend="auto" / "torch" / "kp" / "fa4" (kp_attention.backend): which calls PyTorch's fused SDPA may take, the
measured choice per signature (timings injected through kp_attention.backend.timer), the decisions on disk, and
what runs then. The GPU's own measurement is exercised by the benchmarks; off a GPU torch's fused kernels cannot
take a call, so these tests let backend.torch_refuses accept it (torch's math kernel then runs), and
FlashAttention-4 is the stand-in of tests/fa4_stub.py (test_fa4.py checks its mapping)."""

import inspect
import json

import fa4_stub
import pytest
import torch

import kp_attention
import kp_attention.flash_attn as fa
import kp_core
from kp_attention import backend
from kp_attention.ops import attention_fa4

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_NAMES = ["torch"]  # what "auto" times of torch's under the accepted fixture (its own pick of kernel)


def _qkv(grad=False, sq=24, sk=24):
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(2, s, h, 32, generator=g).to(DEVICE, torch.float16).requires_grad_(grad)
        for s, h in ((sq, 4), (sk, 2), (sk, 2))
    ]


def _run(**kw):
    q, k, v = _qkv()
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention(q, k, v, causal=True, **kw)
    return out, rec


def test_auto_takes_the_faster_once_per_signature(accepted):
    times, timed = accepted
    times["torch"] = 0.5
    _run(backend="auto")  # measures (each runs once then)
    assert timed == [f"kp_attention.flash_attention {n}" for n in ["kp", *TORCH_NAMES]]
    out, rec = _run(backend="auto")
    assert len(timed) == 1 + len(TORCH_NAMES), "a decided signature is not measured again"
    assert not rec.backends("kp::flash_attention"), "torch was measured faster: kp's kernel must not run"
    assert rec.count(backend.TORCH_OP) == 1, "the torch kernel that ran is in the launch record"
    q, k, v = _qkv()
    choice = TORCH_NAMES[0]
    assert torch.equal(out, backend.torch_attention(q, k, v, causal=True, scale=32**-0.5, kernel=choice))
    assert list(backend.decided().values()) == [choice]


def test_auto_keeps_kp_when_it_is_faster_and_a_backward_is_its_own_signature(accepted):
    times, timed = accepted
    out, rec = _run(backend="auto")
    assert rec.backends("kp::flash_attention")
    q, k, v = _qkv(grad=True)
    kp_attention.flash_attention(q, k, v, causal=True, backend="auto").sum().backward()
    assert len(timed) == 2 * (1 + len(TORCH_NAMES)) and sorted(k[-1] for k in backend.decided()) == [False, True]


def test_pinned_setting_overrides_the_argument(accepted):
    times, timed = accepted
    times["torch"] = 0.5
    with kp_core.pinned("attention_backend", backend="kp"):
        out, rec = _run(backend="auto")
    assert rec.backends("kp::flash_attention") and not timed


def test_auto_is_the_default_of_every_entry_point(accepted):
    """flash_attention, the SDPA drop-in, the FlashAttention-compatible module and the HF patch's calls."""
    times, timed = accepted
    times["torch"] = 0.5
    q, k, v = _qkv()
    t = [x.transpose(1, 2) for x in (q, k, v)]
    calls = {
        "kp_attention.flash_attention": lambda: kp_attention.flash_attention(q, k, v, causal=True),
        "kp_attention.scaled_dot_product_attention": lambda: kp_attention.scaled_dot_product_attention(
            *t, is_causal=True, enable_gqa=True
        ),
        "flash_attn_func": lambda: fa.flash_attn_func(q, k, v, causal=True),
    }
    for name, call in calls.items():
        call()  # measures: both run once
        with kp_core.record_launches() as rec:
            call()
        assert not rec.backends("kp::flash_attention"), f"{name}: torch was measured faster, kp's kernel ran"
    assert {key[0] for key in backend.decided()} == {
        "kp_attention.flash_attention",
        "kp_attention.scaled_dot_product_attention",
    }, "flash_attn_func goes through flash_attention"
    assert inspect.signature(kp_attention.patch).parameters["backend"].default == "auto"


def test_what_torch_cannot_take_is_refused_when_forced_and_left_out_by_auto(monkeypatch):
    kp_core.unpin("attention_backend")  # kp_kernels' pin would override the argument (it comes back afterwards)
    monkeypatch.setattr(attention_fa4, "refuses", lambda *a, **kw: "left out by the test")
    backend.forget()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend='torch' cannot take this call"):
        kp_attention.flash_attention(q, k, v, causal=True, softcap=5.0, backend="torch")
    with kp_core.record_launches() as rec:
        kp_attention.flash_attention(q, k, v, causal=True, softcap=5.0, backend="auto")
    assert rec.backends("kp::flash_attention") and not backend.decided(), "one candidate: nothing to measure"
    why = backend.torch_refuses(q, k, causal=True, window=(-1, 0), softcap=0.0, alibi=None, mask=None, lse=False)
    assert why is not None if DEVICE == "cpu" else why is None
    gpu_q = q.cuda() if torch.cuda.is_available() else None
    if gpu_q is not None:
        for kw, what in (
            (dict(softcap=1.0), "softcap"),
            (dict(window=(8, 0)), "window"),
            (dict(lse=True), "lse"),
            (dict(dropout=True), "dropout"),
            (dict(deterministic=True), "deterministic"),
        ):
            args = dict(causal=True, window=(-1, 0), softcap=0.0, alibi=None, mask=None, lse=False) | kw
            assert what in backend.torch_refuses(gpu_q, gpu_q, **args)
        # causal with Sq != Sk: FlashAttention's diagonal is bottom-right, torch's (and the SDPA drop-in's) top-left
        args = dict(causal=True, window=(-1, 0), softcap=0.0, alibi=None, mask=None, lse=False)
        assert "top-left" in backend.torch_refuses(gpu_q, gpu_q[:, :5], **args)
        assert backend.torch_refuses(gpu_q, gpu_q[:, :5], top_left=True, **args) is None


@pytest.fixture
def with_fa4(accepted, monkeypatch):
    """accepted, and FlashAttention-4 (the stand-in) a candidate too."""
    monkeypatch.setattr(attention_fa4, "refuses", lambda *a, **kw: None)
    monkeypatch.setattr(attention_fa4, "interface", lambda: fa4_stub)
    return accepted


def test_auto_takes_fa4_where_it_is_fastest(with_fa4):
    times, timed = with_fa4
    times["fa4"] = 0.25
    out, rec = _run(backend="auto")  # measures
    assert timed[-1] == "kp_attention.flash_attention fa4"
    out, rec = _run(backend="auto")
    assert rec.backends("kp::flash_attention") == {attention_fa4.CUTE}
    assert list(backend.decided().values()) == ["fa4"]


def test_auto_never_picks_a_known_failure(with_fa4, monkeypatch):
    times, timed = with_fa4
    times["fa4"] = 0.25
    rule = [("fp16 causal (a test's entry)", lambda call: call["dtype"] == torch.float16 and call["window"] == (-1, 0))]
    monkeypatch.setitem(backend.KNOWN_FAILURES, "fa4", rule)
    _run(backend="auto")
    assert not any(name.endswith("fa4") for name in timed), "a backend that misses the rule is not even timed"
    assert "fa4" not in backend.decided().values()
    _run(backend="fa4")  # forced: it runs (the user asked for it), as the conformance suite's cell does


def test_decisions_are_kept_on_disk_per_machine_and_versions(with_fa4, tmp_path):
    times, timed = with_fa4
    times["fa4"] = 0.25
    _run(backend="auto")
    path = backend.cache_path()
    assert path.parent == tmp_path
    entries = json.loads(path.read_text())
    (entry,) = entries.values()
    assert entry["choice"] == "fa4" and set(entry["ms"]) == {"kp", *TORCH_NAMES, "fa4"}
    backend.forget()  # a new process, as far as the decisions go
    n = len(timed)
    out, rec = _run(backend="auto")
    assert len(timed) == n, "the choice comes from disk, untimed"
    assert rec.backends("kp::flash_attention") == {attention_fa4.CUTE}
    # another kp-attention version is another key: measured again
    backend.forget()
    env = backend.environment(torch.device(DEVICE))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(backend, "environment", lambda device: {**env, "kp_attention": "0.0.0"})
        _run(backend="auto")
    assert len(timed) > n


def test_the_disk_cache_can_be_turned_off(accepted, monkeypatch):
    monkeypatch.setenv("KP_ATTENTION_CACHE", "0")
    _run(backend="auto")
    assert not backend.cache_path().exists() and backend.decided()


def test_decisions_are_logged(accepted, caplog):
    accepted[0]["torch"] = 0.5
    with caplog.at_level("INFO", logger="kp.attention"):
        _run(backend="auto")
    (line,) = [r.getMessage() for r in caplog.records if "->" in r.getMessage()]
    assert line.startswith("kp_attention.flash_attention") and line.endswith(f"-> {TORCH_NAMES[0]}")


def test_kvcache_auto_and_torch(accepted):
    """A KV-cache call torch can take (one query, an int length, a contiguous cache) runs torch's kernel after
    the new token is written; a tensor of lengths leaves torch out."""
    accepted[0]["torch"] = 0.5
    g = torch.Generator().manual_seed(1)
    q, kn, vn = (torch.randn(1, 1, h, 32, generator=g).to(DEVICE, torch.float16) for h in (4, 2, 2))
    caches = [torch.randn(1, 64, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(2)]
    ref = kp_attention.flash_attention_with_kvcache(q, *[c.clone() for c in caches], 9, k=kn, v=vn, backend="kp")
    kp_attention.flash_attention_with_kvcache(q, *caches, 9, k=kn, v=vn)  # measures
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention_with_kvcache(q, *caches, 9, k=kn, v=vn)
    assert rec.count(backend.TORCH_OP) == 1 and not rec.backends("kp::flash_attention_with_kvcache")
    assert torch.equal(caches[0][0, 9], kn[0, 0])
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    lengths = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="lengths in a tensor"):
        kp_attention.flash_attention_with_kvcache(q, *caches, lengths, backend="torch")


def test_bad_backend_names_itself():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend"):
        kp_attention.flash_attention(q, k, v, backend="cudnn")


def test_the_sdpa_drop_in_hands_torch_four_dimensional_views(accepted):
    """torch's fused kernels take 4-D inputs only: the drop-in gives them its (B, H, S, E) views of any rank
    (3-D without heads, broadcast batch dimensions) and returns the caller's shape."""
    g = torch.Generator().manual_seed(3)
    for shape_q, shape_kv in (((2, 24, 32), (2, 24, 32)), ((2, 3, 4, 24, 32), (1, 3, 4, 24, 32))):
        q = torch.randn(shape_q, generator=g).to(DEVICE, torch.float16)
        k, v = (torch.randn(shape_kv, generator=g).to(DEVICE, torch.float16) for _ in range(2))
        with kp_core.record_launches() as rec:
            out = kp_attention.scaled_dot_product_attention(q, k, v, is_causal=True, backend="torch:flash")
        assert rec.count(backend.TORCH_OP) == 1 and out.shape == shape_q
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


def test_a_forced_torch_kernel_restores_torch_s_switches_even_when_it_fails():
    """backends.sdpa switches torch's SDPA backends as sdpa_kernel does (without its context manager's cost): on
    the way out, whatever happened, every switch is as it was."""
    names = ("flash", "mem_efficient", "math", "cudnn")
    before = [getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in names]
    q = torch.randn(1, 2, 8, 16)  # CPU: torch's cuDNN kernel cannot run here
    with pytest.raises(RuntimeError):
        backend.sdpa(q, q, q, "torch:cudnn")
    assert [getattr(torch._C, f"_get_{n}_sdp_enabled")() for n in names] == before
    torch._C._set_sdp_use_math(False)
    try:
        out = backend.sdpa(q, q, q, "torch:flash", is_causal=True)  # switched on for this call alone
        assert not torch._C._get_math_sdp_enabled() and torch._C._get_flash_sdp_enabled()
    finally:
        torch._C._set_sdp_use_math(before[2])
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out, ref)


def test_torch_s_flash_kernel_is_refused_top_left_causal_with_sq_not_sk(accepted):
    """The SDPA drop-in's causal diagonal is torch's (top-left): cuDNN takes Sq != Sk there, FlashAttention-2 not."""
    q, k, v = (torch.randn(1, 2, s, 32).to(DEVICE, torch.float16) for s in (5, 9, 9))
    with pytest.raises(ValueError, match="backend='torch:flash' cannot take this call: causal with Sq != Sk"):
        kp_attention.scaled_dot_product_attention(q, k, v, is_causal=True, backend="torch:flash")
    with kp_core.record_launches() as rec:
        kp_attention.scaled_dot_product_attention(q, k, k, is_causal=False, backend="torch:flash")
    assert rec.count(backend.TORCH_OP, kernel="torch:flash") == 1


@pytest.fixture
def replays(accepted, monkeypatch):
    """accepted, with replayed timings from a table too: {"kp": ms, "torch": ms} (kp faster replayed)."""
    times = {"kp": 0.1, "torch": 0.3}
    replayed = []

    def fake_graph_timer(name, fn):
        fn()
        replayed.append(name)
        return times[name.split(" ")[1].split(":")[0]]

    monkeypatch.setattr(backend, "graph_timer", fake_graph_timer)
    return accepted[0], replayed


def test_a_call_being_captured_takes_what_was_fastest_replayed(replays, monkeypatch):
    """Decoding-sized calls: timed eagerly the host's cost decides (torch here), replayed from a graph the GPU's
    (kp here). An eager call runs the eager choice, a call being captured the replayed one, each decided once."""
    eager_times, replayed = replays
    eager_times["torch"] = 0.5
    q, k, v = _qkv()
    kp_attention.flash_attention(q, k, v, causal=True)  # measures both ways
    assert sorted(backend.decided().values()) == ["kp", "torch"] and len(replayed) == 2
    for capturing, ran_kp in ((True, True), (False, False)):
        monkeypatch.setattr(backend, "capturing", lambda device, now=capturing: now)
        with kp_core.record_launches() as rec:
            kp_attention.flash_attention(q, k, v, causal=True)
        assert bool(rec.backends("kp::flash_attention")) == ran_kp
        assert (rec.count(backend.TORCH_OP) == 1) != ran_kp
    assert len(replayed) == 2, "decided once"
    backend.forget()  # a new process: both choices come from the file
    monkeypatch.setattr(backend, "capturing", lambda device: True)
    with kp_core.record_launches() as rec:
        kp_attention.flash_attention(q, k, v, causal=True)
    assert rec.backends("kp::flash_attention") and len(replayed) == 2
    monkeypatch.setattr(backend, "capturing", lambda device: False)
    q.requires_grad_()
    kp_attention.flash_attention(q, k, v, causal=True)  # with a backward: timed eagerly alone
    assert len(replayed) == 2


def test_a_kvcache_call_being_captured_takes_what_was_fastest_replayed(replays, monkeypatch):
    """The KV-cache function's checked signatures (backend.CALLS) keep a captured call's route apart."""
    eager_times, _ = replays
    eager_times["torch"] = 0.5
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 4, 32, generator=g).to(DEVICE, torch.float16)
    caches = [torch.randn(1, 64, 2, 32, generator=g).to(DEVICE, torch.float16) for _ in range(2)]
    kp_attention.flash_attention_with_kvcache(q, *caches, 9)  # measures both ways
    for capturing, ran_kp in ((False, False), (True, True), (False, False)):
        monkeypatch.setattr(backend, "capturing", lambda device, now=capturing: now)
        with kp_core.record_launches() as rec:
            kp_attention.flash_attention_with_kvcache(q, *caches, 9)
        assert bool(rec.backends("kp::flash_attention_with_kvcache")) == ran_kp
        assert (rec.count(backend.TORCH_OP) == 1) != ran_kp
