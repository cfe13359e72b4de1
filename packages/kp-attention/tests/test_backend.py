"""backend="auto" / "torch" / "kp" (kp_attention.backend): which calls PyTorch's fused SDPA may take, the measured
choice per signature (timings injected through kp_attention.backend.timer), and what runs then. The GPU's own
measurement is exercised by the benchmarks; off a GPU torch's fused kernels cannot take a call, so these tests
let backend.torch_refuses accept it (torch's math kernel then runs)."""

import inspect

import pytest
import torch

import kp_attention
import kp_attention.flash_attn as fa
import kp_core
from kp_attention import backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


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
            (dict(dropout=True), "dropout"),
        ):
            args = dict(causal=True, window=(-1, 0), softcap=0.0, alibi=None, mask=None, lse=False) | kw
            assert what in backend.torch_refuses(gpu_q, gpu_q, **args)
        # causal with Sq != Sk: FlashAttention's diagonal is bottom-right, torch's (and the SDPA drop-in's) top-left
        args = dict(causal=True, window=(-1, 0), softcap=0.0, alibi=None, mask=None, lse=False)
        assert "top-left" in backend.torch_refuses(gpu_q, gpu_q[:, :5], **args)
        assert backend.torch_refuses(gpu_q, gpu_q[:, :5], top_left=True, **args) is None


def test_bad_backend_names_itself():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend"):
        kp_attention.flash_attention(q, k, v, backend="cudnn")
