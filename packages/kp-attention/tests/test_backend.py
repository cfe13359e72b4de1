"""backend="auto" / "torch" / "kp" (kp_attention.backend): which calls PyTorch's fused SDPA may take, the measured
choice per signature (timings injected through kp_attention.backend.timer), and what runs then. The GPU's own
measurement is exercised by the benchmarks; off a GPU torch's fused kernels cannot take a call, so these tests
let backend.torch_refuses accept it (torch's math kernel then runs)."""

import pytest
import torch

import kp_attention
import kp_core
from kp_attention import backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(grad=False, sq=24, sk=24):
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(2, s, h, 32, generator=g).to(DEVICE, torch.float16).requires_grad_(grad)
        for s, h in ((sq, 4), (sk, 2), (sk, 2))
    ]


@pytest.fixture
def accepted(monkeypatch):
    """torch's SDPA may stand for every call; timings from a table: {"kp": ms, "torch": ms}; the names timed."""
    times, timed = {"kp": 1.0, "torch": 2.0}, []

    def fake_timer(name, fn):
        fn()  # the call runs, as a real measurement's would
        timed.append(name)
        return times[name.rsplit(" ", 1)[1]]

    monkeypatch.setattr(backend, "torch_refuses", lambda *a, **kw: None)
    monkeypatch.setattr(backend, "timer", fake_timer)
    backend.forget()
    yield times, timed
    backend.forget()


def _run(**kw):
    q, k, v = _qkv()
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention(q, k, v, causal=True, **kw)
    return out, rec


def test_auto_takes_the_faster_once_per_signature(accepted):
    times, timed = accepted
    times["torch"] = 0.5
    _run(backend="auto")  # measures (both run once then)
    assert timed == ["kp_attention.flash_attention kp", "kp_attention.flash_attention torch"]
    out, rec = _run(backend="auto")
    assert len(timed) == 2, "a decided signature is not measured again"
    assert not rec.backends("kp::flash_attention"), "torch was measured faster: kp's kernel must not run"
    q, k, v = _qkv()
    assert torch.equal(out, backend.torch_attention(q, k, v, causal=True, scale=32**-0.5))
    assert list(backend.decided().values()) == ["torch"]


def test_auto_keeps_kp_when_it_is_faster_and_a_backward_is_its_own_signature(accepted):
    times, timed = accepted
    out, rec = _run(backend="auto")
    assert rec.backends("kp::flash_attention")
    q, k, v = _qkv(grad=True)
    kp_attention.flash_attention(q, k, v, causal=True, backend="auto").sum().backward()
    assert len(timed) == 4 and sorted(k[-1] for k in backend.decided()) == [False, True]


def test_pinned_setting_overrides_the_argument(accepted):
    times, timed = accepted
    times["torch"] = 0.5
    with kp_core.pinned("attention_backend", backend="kp"):
        out, rec = _run(backend="auto")
    assert rec.backends("kp::flash_attention") and not timed


def test_what_torch_cannot_take_runs_kp_whatever_is_asked():
    q, k, v = _qkv()
    with kp_core.record_launches() as rec:
        kp_attention.flash_attention(q, k, v, causal=True, softcap=5.0, backend="torch")
    assert rec.backends("kp::flash_attention")
    why = backend.torch_refuses(q, k, causal=True, window=(-1, 0), softcap=0.0, alibi=None, mask=None, lse=False)
    assert why is not None if DEVICE == "cpu" else why is None
    gpu_q = q.cuda() if torch.cuda.is_available() else None
    if gpu_q is not None:
        for kw, what in (
            (dict(softcap=1.0), "softcap"),
            (dict(window=(8, 0)), "window"),
            (dict(lse=True), "lse"),
        ):
            args = dict(causal=True, window=(-1, 0), softcap=0.0, alibi=None, mask=None, lse=False) | kw
            assert what in backend.torch_refuses(gpu_q, gpu_q, **args)


def test_bad_backend_names_itself():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend"):
        kp_attention.flash_attention(q, k, v, backend="cudnn")
