"""Which implementation runs an attention call: kp's kernel, or PyTorch's fused SDPA (cuDNN, flash) where it can
stand for the call and was measured faster.

    backend="auto"   the default: per call signature (shapes, dtype, causal, whether a backward follows, the GPU),
                     the faster of the two, measured once on random tensors of that signature and kept for the
                     process
    backend="kp"     kp's kernel (tests and benchmarks pin it)
    backend="torch"  torch.nn.functional.scaled_dot_product_attention, where it can stand for the call

PyTorch's fused kernels stand for a call only where they give what kp gives: fp16/bf16 on a CUDA device, no
softcap, ALiBi, window, dropout or mask (a row a mask hides entirely is NaN there and 0 in kp), causal with
Sq != Sk only where the call's diagonal is top-left as torch's (the SDPA drop-in; FlashAttention's is
bottom-right), and no lse asked for. Anything else runs kp's kernel, whatever the backend asked: off a GPU "auto"
is kp's kernel and costs nothing. `kp_core.pin("attention_backend", backend=...)` overrides the argument (kp's own
test suites and the conformance specs pin "kp", so that they check kp's kernel).

The measurement runs on fresh random tensors, so it also runs while torch.compile traces the call (on real tensors,
outside the trace), but not under CUDA graph capture, where the call runs kp's kernel and the signature stays
undecided. `timer` (a function of (name, fn) returning ms) replaces the measurement: tests inject timings with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

import kp_core

BACKENDS = ("auto", "kp", "torch")
KP, TORCH = "kp", "torch"
timer: Callable[[str, Callable[[], object]], float] | None = None
_DECIDED: dict[tuple, str] = {}


def check(op: str, backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")


def torch_refuses(
    q, k, *, causal: bool, window, softcap: float, alibi, mask, lse: bool, dropout: bool = False, top_left=False
) -> str | None:
    """Why PyTorch's fused SDPA cannot stand for this call of q (B, Sq, Hq, D), k (B, Sk, Hkv, D); None if it can.
    window: the call's (left, right) after causal ((-1, 0) when causal); top_left: the call's causal diagonal is
    torch's (the SDPA drop-in)."""
    if not q.is_cuda:
        return "not on a CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"{q.dtype} (torch's fused kernels take fp16 and bf16)"
    for what, present in (("softcap", softcap > 0), ("ALiBi", alibi is not None), ("a mask", mask is not None)):
        if present:
            return f"{what} (torch's fused kernels have none, or give NaN where kp gives 0)"
    if dropout:
        return "dropout (kp draws its mask its own way: the same call gives the same values on either backend)"
    if tuple(window) != ((-1, 0) if causal else (-1, -1)):
        return "a sliding window"
    if causal and q.shape[1] != k.shape[1] and not top_left:
        return "causal with Sq != Sk (torch's diagonal is top-left)"
    if lse:
        return "lse asked for"
    return None


def torch_attention(q, k, v, *, causal: bool, scale: float) -> torch.Tensor:
    """(B, Sq, Hq, D) in and out, through torch's (B, H, S, D) layout."""
    t = [x.transpose(1, 2) for x in (q, k, v)]
    gqa = q.shape[2] != k.shape[2]
    return F.scaled_dot_product_attention(*t, is_causal=causal, scale=scale, enable_gqa=gqa).transpose(1, 2)


def choose(op: str, backend: str, refused: str | None, q, k, v, causal: bool, scale: float, run_kp: Callable) -> str:
    """kp or torch for this call (refused: torch_refuses' answer), backend after kp_core.settings'
    "attention_backend" pin. run_kp(q, k, v) runs kp's kernel."""
    if backend == KP or refused is not None:
        return KP
    if backend == TORCH:
        return TORCH
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    key = (op, tuple(q.shape), tuple(k.shape), q.dtype, q.device, causal, scale, training)
    if key not in _DECIDED:
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            return KP
        with _disable_current_modes():
            _DECIDED[key] = _measure(op, q, k, v, causal, scale, training, run_kp)
    return _DECIDED[key]


def _measure(op, q, k, v, causal, scale, training, run_kp) -> str:
    g = torch.Generator(device=q.device).manual_seed(0)
    args = [torch.randn(t.shape, generator=g, device=q.device, dtype=q.dtype) for t in (q, k, v)]
    args = [a.requires_grad_(training) for a in args]
    grad = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=g, device=q.device, dtype=q.dtype)

    def call(fn):
        def run():
            out = fn(*args)
            if training:
                torch.autograd.backward(out, grad)

        return run

    time = timer or (lambda name, fn: kp_core.median_ms(fn))
    with torch.enable_grad() if training else torch.no_grad():
        kp_ms = time(f"{op} kp", call(run_kp))
        torch_ms = time(f"{op} torch", call(lambda q, k, v: torch_attention(q, k, v, causal=causal, scale=scale)))
    return TORCH if torch_ms < kp_ms else KP


def decided() -> dict[tuple, str]:
    """The signatures measured so far and their choice (a copy): call signature -> "kp" or "torch".

    Examples:
        >>> import torch
        >>> import kp_attention
        >>> from kp_attention import backend
        >>> q = torch.randn(1, 64, 4, 32)
        >>> out = kp_attention.flash_attention(q, q, q, causal=True)
        >>> backend.decided()  # off a GPU nothing is measured: "auto" runs kp's kernel
        {}
    """
    return dict(_DECIDED)


def forget() -> None:
    """Drop every decision (the next call of each signature measures again).

    Examples:
        >>> from kp_attention import backend
        >>> backend.forget()
        >>> backend.decided()
        {}
    """
    _DECIDED.clear()
