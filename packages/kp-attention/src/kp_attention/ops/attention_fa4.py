"""FlashAttention-4 (CuTe DSL, `flash_attn.cute`) as a second kernel language behind kp's attention ops.

kp::flash_attention, kp::flash_attention_varlen (ops/attention.py) and kp::flash_attention_with_kvcache
(ops/decode.py) take `impl="fa4"` to run this module's calls in place of kp's Triton kernels: the same op
declaration, checks, saved tensors and spec (conformance/specs/test_attention.py, test_decode.py). Which calls
may come here is `refuses` (what FlashAttention-4 cannot compute) and `unavailable` (where it cannot run); the
public functions choose with kp_attention.backend.

FlashAttention-4 is an optional dependency (`pip install "kp-attention[fa4]"`), pinned to the pre-release kp was
tested with (TESTED): kp calls its interface's `_flash_attn_fwd` / `_flash_attn_bwd` (the functions under its
autograd.Function), so that kp's op declaration owns autograd, torch.compile and the launch record, and those
are private names that change between pre-releases. It is imported on the first call that could use it on an
SM 9.0+ GPU (the import takes seconds), never at kp_attention's import.

Mapping: kp's window (left, right), -1 unbounded, becomes FlashAttention-4's (None or int, None or int), causal
being (None, 0); its masks are bottom-right aligned as kp's. lse is (B, Hq, Sq) or (Hq, total_q) fp32 in both;
rows that see no key give out 0 and lse -inf in both. A paged varlen cache passes per-sequence key counts
(seqused_k) instead of cu_seqlens_k, as FlashAttention-4 takes pages.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch

import kp_core

TRITON, FA4 = "triton", "fa4"  # the ops' `impl`: kp's Triton kernels, or this module's calls
IMPLS = (TRITON, FA4)
CUTE = "cute"  # the launch record's backend of FlashAttention-4's kernels (kp_core.Launch.backend)
TESTED = ("4.0.0b36",)  # flash-attn-4 versions kp-attention was checked with (its [fa4] extra pins them)
DTYPES = (torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM, HEAD_DIM_MULTIPLE = 8, 256, 8  # SM 9.0: 16-byte rows of fp16/bf16
INSTALL = 'pip install "kp-attention[fa4]"'


@functools.lru_cache(maxsize=1)
def _module():
    """flash_attn.cute.interface, or the reason it cannot be used (a string)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("flash-attn-4")
        except PackageNotFoundError:
            return f"flash-attn-4 is not installed ({INSTALL})"
        if found not in TESTED:
            return (
                f"flash-attn-4 {found} is not a version kp-attention was tested with ({', '.join(TESTED)}: {INSTALL})"
            )
        return importlib.import_module("flash_attn.cute.interface")
    except Exception as e:  # a broken install (a CUDA runtime it cannot load, ...): a reason, not a crash
        return f"flash_attn.cute does not import: {type(e).__name__}: {e}"


def interface():
    """FlashAttention-4's interface module (tests put a stand-in here)."""
    found = _module()
    if isinstance(found, str):
        raise RuntimeError(f"kp_attention: FlashAttention-4 unavailable: {found}")
    return found


_UNAVAILABLE: dict[tuple, Optional[str]] = {}


@torch.compiler.assume_constant_result  # torch.compile asks once, while tracing, and keeps the answer
def _unavailable_on(device_type: str, index: Optional[int]) -> Optional[str]:
    key = (device_type, index)
    if key not in _UNAVAILABLE:
        _UNAVAILABLE[key] = _why_not(device_type, index)
    return _UNAVAILABLE[key]


def _why_not(device_type: str, index: Optional[int]) -> Optional[str]:
    if device_type != "cuda":
        return "not on a CUDA device"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return f"SM {major}.{minor} (kp routes to FlashAttention-4 on SM 9.0 and newer)"
    found = _module()
    return found if isinstance(found, str) else None


def unavailable(device: torch.device) -> Optional[str]:
    """Why FlashAttention-4 cannot run on `device` here, or None when it can (cached per device)."""
    return _unavailable_on(device.type, device.index)


def refuses(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    alibi: bool = False,
    mask: bool = False,
    dropout: bool = False,
    top_left: bool = False,
    causal: bool = False,
    leftpad: bool = False,
) -> Optional[str]:
    """Why FlashAttention-4 cannot compute this call, or None: the call's own limits first (dtype, head dims, what it
    has no form for), then where it runs (`unavailable`). q/k/v as the kernels get them (heads and head dim last);
    top_left: the call's causal diagonal is torch's (SDPA), which differs from FlashAttention's where Sq != Sk."""
    if q.dtype not in DTYPES:
        return f"{str(q.dtype).replace('torch.', '')} (FlashAttention-4 takes float16 and bfloat16)"
    d, dv = q.shape[-1], v.shape[-1]
    for what, n in (("head dim", d), ("value head dim", dv)):
        if not MIN_HEAD_DIM <= n <= MAX_HEAD_DIM or n % HEAD_DIM_MULTIPLE:
            return (
                f"{what} {n} (FlashAttention-4 takes {MIN_HEAD_DIM} to {MAX_HEAD_DIM}, a multiple of "
                f"{HEAD_DIM_MULTIPLE})"
            )
    for what, present in (
        ("ALiBi", alibi),
        ("an attention mask", mask),
        ("dropout", dropout),
        ("cache_leftpad", leftpad),
    ):
        if present:
            return f"{what} (FlashAttention-4 has none)"
    if causal and top_left and q.shape[-3] != k.shape[-3]:
        return "causal with Sq != Sk and torch's top-left diagonal (FlashAttention-4's is bottom-right)"
    return unavailable(q.device)


def check(op: str, impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **call) -> None:
    """The ops are public: `impl` one of IMPLS, and "fa4" only for a call FlashAttention-4 can compute where it can
    run (`refuses`, with `call`'s options); ValueError naming why otherwise."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    why = refuses(q, k, v, **call) if impl == FA4 else None
    if why:
        raise ValueError(f"{op}: impl='fa4' cannot take this call: {why}")


def _window(left: int, right: int) -> dict:
    """kp's (left, right), -1 unbounded (causal: right 0), as FlashAttention-4's keyword arguments."""
    return dict(
        causal=False,  # causal is the window (None, 0): FlashAttention-4 reads it as causal
        window_size_left=None if left < 0 else left,
        window_size_right=None if right < 0 else right,
    )


def forward(
    op: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
    cu_q: Optional[torch.Tensor] = None,
    cu_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    block_table: Optional[torch.Tensor] = None,
    seqused_k: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) from FlashAttention-4's forward: dense (B, S, H, D), packed (total, H, D) with cu_q / cu_k, or
    with k/v pages (num_blocks, page, Hkv, D) read through block_table (then seqused_k gives each sequence's keys)."""
    kp_core.note_launch(op, "flash_attn_fwd", CUTE)
    out, lse, *_ = interface()._flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=None if block_table is not None else cu_k,
        seqused_k=seqused_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        page_table=block_table,
        softmax_scale=scale,
        softcap=softcap,
        num_splits=1,  # split-KV is not supported on SM 9.0
        return_lse=True,
        **_window(window_left, window_right),
    )
    return out, lse


def backward(
    op: str,
    dout: Optional[torch.Tensor],
    dlse: Optional[torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    softcap: float,
    window_left: int,
    window_right: int,
    cu_q: Optional[torch.Tensor] = None,
    cu_k: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    deterministic: bool = False,
    *,
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from FlashAttention-4's backward, for the gradients dout of out (zeros when None) and dlse of
    lse, written into `grads` (the op's buffers, laid out as its fake kernel says; FlashAttention-4 takes any
    layout); deterministic: its backward without atomic adds (slower; kp's Triton backward never has any)."""
    kp_core.note_launch(op, "flash_attn_bwd", CUTE)
    window = _window(window_left, window_right)
    dq, dk, dv = grads
    dq, dk, dv = interface()._flash_attn_bwd(
        q,
        k,
        v,
        out,
        torch.zeros_like(out) if dout is None else dout,
        lse,
        scale,
        window.pop("causal"),
        softcap,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        deterministic=deterministic,
        dlse=dlse,
        dq=dq,
        dk=dk,
        dv=dv,
        **window,
    )
    return dq, dk, dv
