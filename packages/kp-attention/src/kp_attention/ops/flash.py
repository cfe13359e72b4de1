"""FlashAttention op family: launch settings, launchers, the PyTorch reference, custom ops and the eager autograd.

One op pair serves every public entry point (kp_attention.functional): dense (B, S, H, D) tensors with arbitrary
strides, (B, H, S, D) views (SDPA), and packed varlen (total, H, D) tensors with cu_seqlens. The maths and the
kernels are described in kp_attention.ops.flash_kernels.

fp16/bf16 use tensor-core dots with fp32 accumulation; fp32 inputs use `input_precision="ieee"` dots (exact fp32
products, no TF32), a correctness path rather than a fast one.
"""

import dataclasses
import math
from typing import Optional

import torch

import kp_core

OP = "kp::flash_attention"
OP_BWD = "kp::flash_attention_backward"
PACKAGE = "kp-attention"
SPEC = "attention"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
# Eager varlen calls check cu_seqlens' values (one host sync); set False to skip (values are then trusted).
VALIDATE_CU_SEQLENS = True

if kp_core.has_triton():
    import triton

    from kp_attention.ops import flash_kernels as fk


@dataclasses.dataclass(frozen=True)
class AttnConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int


# (kernel, BLOCK_D, element size) -> AttnConfig, for a benchmark sweep to pin (kernels: "fwd", "dkdv", "dq",
# "preprocess"); empty normally.
CONFIG_OVERRIDE: dict[tuple[str, int, int], AttnConfig] = {}


def _config(kernel: str, block_d: int, element_size: int, device: torch.device) -> AttnConfig:
    """Tile shape per kernel. GPU values are starting points for the H100 sweep (FlashAttention-2 and the Triton
    tutorial's choices); the interpreter gets small tiles so tests cross several block boundaries quickly."""
    key = (kernel, block_d, element_size)
    if key in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE[key]
    if device.type != "cuda":
        return AttnConfig(32, 32, 4, 1)
    if kernel == "preprocess":
        return AttnConfig(64, 1, 4, 1)
    if element_size == 4:  # fp32: twice the bytes per tile, no fp32 tensor cores
        small = block_d > 128
        return {
            "fwd": AttnConfig(32 if small else 64, 32, 4, 2),
            "dkdv": AttnConfig(16, 32 if small else 64, 4, 1),
            "dq": AttnConfig(32 if small else 64, 16 if small else 32, 4, 1),
        }[kernel]
    # fp16/bf16: chosen so ptxas (sm_90a) reports no or few spills (bytes spilled noted); not yet timed.
    table = {
        64: {"fwd": AttnConfig(128, 64, 4, 3), "dkdv": AttnConfig(32, 128, 8, 3), "dq": AttnConfig(128, 32, 8, 3)},
        128: {"fwd": AttnConfig(128, 64, 8, 3), "dkdv": AttnConfig(32, 64, 8, 3), "dq": AttnConfig(64, 32, 4, 3)},
        256: {"fwd": AttnConfig(128, 32, 8, 2), "dkdv": AttnConfig(32, 32, 8, 2), "dq": AttnConfig(64, 32, 8, 2)},
    }  # spills: D64 0/4/0, D128 0/152/0, D256 30/248/84 bytes
    return table[64 if block_d <= 64 else 128 if block_d <= 128 else 256][kernel]


@dataclasses.dataclass(frozen=True)
class Params:
    """Everything but the tensors: the structural mask, the score transform, and the layout."""

    scale: float
    softcap: float = 0.0
    window_left: int = -1  # -1: unbounded
    window_right: int = -1
    bottom_right: bool = True  # diagonal offset Sk - Sq (FlashAttention) or 0 (torch's is_causal)
    max_seqlen_q: int = 0  # varlen only
    max_seqlen_k: int = 0


def _block_d(d: int) -> int:
    return max(16, kp_core.next_power_of_2(d))  # tl.dot needs K >= 16


def _bshd(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, seq, head, dim) strides; packed varlen tensors have no batch stride."""
    return (0, *t.stride()) if varlen else tuple(t.stride())


def _mask_args(mask: Optional[torch.Tensor], b: int, h: int, sq: int, sk: int):
    """(tensor, 4 broadcast strides, kind): kind 0 none, 1 boolean (read as uint8), 2 additive float."""
    if mask is None:
        return None, (0, 0, 0, 0), 0
    m = mask.expand(b, h, sq, sk)
    kind = 1 if m.dtype == torch.bool else 2
    if kind == 1:
        m = m.view(torch.uint8)
    return m, tuple(m.stride()), kind


def _score_args(p: Params, dtype: torch.dtype) -> tuple[float, float, float]:
    """(qk_scale, sc_in, sc_out): the scale in the scores' units (base 2, natural for fp32: flash_kernels._exp),
    and the softcap constants of flash_kernels._scores."""
    unit = 1.0 if dtype == torch.float32 else LOG2E
    if p.softcap > 0:
        return p.scale * unit, 2.0 * LOG2E * p.scale / p.softcap, p.softcap * unit
    return p.scale * unit, 1.0, 1.0


def _structure(p: Params, q, k, cu_q, cu_k):
    """(batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, varlen) of a call."""
    varlen = cu_q is not None
    if varlen:
        return cu_q.shape[0] - 1, p.max_seqlen_q, p.max_seqlen_k, q.shape[1], k.shape[1], q.shape[2], True
    return q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], False


def _lse_empty(q, b, hq, sq, varlen):
    shape = (hq, q.shape[0]) if varlen else (b, hq, sq)
    return torch.empty(shape, dtype=torch.float32, device=q.device)


def _lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int]:
    return (0, lse.stride(0)) if varlen else (lse.stride(0), lse.stride(1))


def _constexprs(p: Params, d: int, varlen: bool, mask_kind: int, dtype: torch.dtype) -> dict:
    """The kernels' compile-time switches (one compiled variant per combination)."""
    return dict(
        HEAD_DIM=d, BLOCK_D=_block_d(d), PAD_D=d != _block_d(d), VARLEN=varlen, BOTTOM_RIGHT=p.bottom_right,
        HAS_LEFT=p.window_left >= 0, HAS_RIGHT=p.window_right >= 0, SOFTCAP=p.softcap > 0, MASK_KIND=mask_kind,
        IEEE=dtype == torch.float32,
    )  # fmt: skip


def check_cu_seqlens(op: str, cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int, p: Params) -> None:
    """Values of cu_seqlens: start at 0, non-decreasing, end at the packed length, max <= max_seqlen (host sync)."""
    for name, cu, total, max_len in (("cu_seqlens_q", cu_q, total_q, p.max_seqlen_q),
                                     ("cu_seqlens_k", cu_k, total_k, p.max_seqlen_k)):  # fmt: skip
        vals = cu.tolist()
        lens = [b - a for a, b in zip(vals[:-1], vals[1:])]
        if vals[0] != 0:
            raise ValueError(f"{op}: {name} must start at 0, got {vals[0]}")
        if any(n < 0 for n in lens):
            raise ValueError(f"{op}: {name} must be non-decreasing, got {vals}")
        if vals[-1] != total:
            raise ValueError(f"{op}: {name}[-1] must equal the packed length {total}, got {vals[-1]}")
        if lens and max(lens) > max_len:
            name_max = "max_seqlen_q" if name.endswith("q") else "max_seqlen_k"
            raise ValueError(f"{op}: {name_max}={max_len} is smaller than the longest sequence ({max(lens)})")


# ---- reference path (CPU without the interpreter, or KP_BACKEND=reference) ----


def _reference_dense(q, k, v, mask, p: Params):
    """(out, lse) for (B, S, H, D) tensors, in fp32 from the formula; fully masked rows give 0 and -inf."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf = kf.repeat_interleave(hq // hkv, dim=1)
    vf = vf.repeat_interleave(hq // hkv, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * p.scale
    if p.softcap > 0:
        s = p.softcap * torch.tanh(s / p.softcap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.float()
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    rel = j - i - (sk - sq if p.bottom_right else 0)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if p.window_right >= 0:
        allowed &= rel <= p.window_right
    if p.window_left >= 0:
        allowed &= rel >= -p.window_left
    s = s.masked_fill(~allowed, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(-1, keepdim=True)
    has = denom > 0
    denom_safe = torch.where(has, denom, torch.ones_like(denom))
    out = (e / denom_safe) @ vf
    lse = torch.where(has, torch.log(denom_safe) + m, torch.full_like(m, float("-inf")))
    return out.transpose(1, 2).to(q.dtype), lse.squeeze(-1)


def _reference_forward(q, k, v, mask, cu_q, cu_k, p: Params):
    if cu_q is None:
        return _reference_dense(q, k, v, mask, p)
    outs, lses = [], []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        sl_q = slice(bounds_q[i], bounds_q[i + 1])
        sl_k = slice(bounds_k[i], bounds_k[i + 1])
        o, lse = _reference_dense(q[None, sl_q], k[None, sl_k], v[None, sl_k], None, p)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1) if lses else _lse_empty(q, 0, q.shape[1], 0, True)


def _reference_backward(dout, dlse, q, k, v, mask, cu_q, cu_k, p: Params):
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = _reference_forward(*leaves, mask, cu_q, cu_k, p)
        outputs, grads = [out], [dout]
        if dlse is not None:
            outputs.append(torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)))
            grads.append(dlse)
        dq, dk, dv = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip((dq, dk, dv), (q, k, v)))


# ---- launchers ----


def forward_impl(q, k, v, mask, cu_q, cu_k, p: Params):
    """(out, lse): out like q (contiguous, q's layout), lse fp32 (B, Hq, Sq), or (Hq, total_q) when packed."""
    b, sq, sk, hq, hkv, d, varlen = _structure(p, q, k, cu_q, cu_k)
    if varlen and VALIDATE_CU_SEQLENS and not torch.compiler.is_compiling():
        check_cu_seqlens(OP, cu_q, cu_k, q.shape[0], k.shape[0], p)
    backend = kp_core.choose_backend(OP, q)
    if q.numel() == 0 or k.shape[0] == 0 or b == 0 or sq == 0 or sk == 0:  # nothing to launch
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return out, _lse_empty(q, b, hq, sq, varlen).fill_(float("-inf"))
    if backend == kp_core.REFERENCE:
        kp_core.note_launch(OP, "reference", kp_core.REFERENCE)
        out, lse = _reference_forward(q, k, v, mask, cu_q, cu_k, p)
        return out.contiguous(), lse.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = _lse_empty(q, b, hq, sq, varlen)
    m, m_strides, mask_kind = _mask_args(mask, b, hq, sq, sk)
    cfg = _config("fwd", _block_d(d), q.element_size(), q.device)
    grid = (triton.cdiv(sq, cfg.block_m), hq, b)
    dummy_cu = cu_q if varlen else lse
    fk._attn_fwd[grid](
        q, k, v, out, lse, m if m is not None else lse, dummy_cu, cu_k if varlen else lse,
        *_bshd(q, varlen), *_bshd(k, varlen), *_bshd(v, varlen), *_bshd(out, varlen), *_lse_strides(lse, varlen),
        *m_strides, sq, sk, hq // hkv, *_score_args(p, q.dtype), p.window_left, p.window_right,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_constexprs(p, d, varlen, mask_kind, q.dtype),
    )  # fmt: skip
    kp_core.note_launch(OP, "_attn_fwd", backend)
    return out, lse


def backward_impl(dout, dlse, q, k, v, out, lse, mask, cu_q, cu_k, p: Params):
    """(dq, dk, dv), each contiguous in its input's layout. dlse (may be None) is the gradient that reached lse."""
    b, sq, sk, hq, hkv, d, varlen = _structure(p, q, k, cu_q, cu_k)
    backend = kp_core.choose_backend(OP_BWD, q)
    if q.numel() == 0 or k.numel() == 0 or b == 0 or sq == 0 or sk == 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if backend == kp_core.REFERENCE:
        kp_core.note_launch(OP_BWD, "reference", kp_core.REFERENCE)
        return tuple(g.contiguous() for g in _reference_backward(dout, dlse, q, k, v, mask, cu_q, cu_k, p))
    if dlse is not None:  # the kernels read dlse in lse's layout
        dlse = dlse.to(torch.float32).contiguous()
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    lse_strides = _lse_strides(lse, varlen)
    cu_qa, cu_ka = (cu_q, cu_k) if varlen else (lse, lse)
    block_d = _block_d(d)
    pre = _config("preprocess", block_d, q.element_size(), q.device)
    fk._attn_bwd_preprocess[(triton.cdiv(sq, pre.block_m), hq, b)](
        out, dout, dlse if dlse is not None else lse, delta, cu_qa, *_bshd(out, varlen), *_bshd(dout, varlen),
        *lse_strides, sq, HEAD_DIM=d, BLOCK_M=pre.block_m, BLOCK_D=block_d, VARLEN=varlen,
        HAS_DLSE=dlse is not None, num_warps=pre.num_warps,
    )  # fmt: skip
    kp_core.note_launch(OP_BWD, "_attn_bwd_preprocess", backend)
    m, m_strides, mask_kind = _mask_args(mask, b, hq, sq, sk)
    m = m if m is not None else lse
    consts = _constexprs(p, d, varlen, mask_kind, q.dtype)
    scalars = (sq, sk, hq // hkv, p.scale, *_score_args(p, q.dtype), p.window_left, p.window_right)
    strides_qkv = (*_bshd(q, varlen), *_bshd(k, varlen), *_bshd(v, varlen), *_bshd(dout, varlen))
    cfg = _config("dkdv", block_d, q.element_size(), q.device)
    fk._attn_bwd_dkdv[(triton.cdiv(sk, cfg.block_n), hkv, b)](
        q, k, v, dout, lse, delta, m, dk, dv, cu_qa, cu_ka, *strides_qkv, *_bshd(dk, varlen), *_bshd(dv, varlen),
        *lse_strides, *m_strides, *scalars, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **consts,
    )  # fmt: skip
    kp_core.note_launch(OP_BWD, "_attn_bwd_dkdv", backend)
    cfg = _config("dq", block_d, q.element_size(), q.device)
    fk._attn_bwd_dq[(triton.cdiv(sq, cfg.block_m), hq, b)](
        q, k, v, dout, lse, delta, m, dq, cu_qa, cu_ka, *strides_qkv, *_bshd(dq, varlen), *lse_strides,
        *m_strides, *scalars, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **consts,
    )  # fmt: skip
    kp_core.note_launch(OP_BWD, "_attn_bwd_dq", backend)
    return dq, dk, dv


# ---- torch.library ops (what torch.compile sees) and the eager autograd path ----


def _params(scale, softcap, window_left, window_right, bottom_right, max_seqlen_q, max_seqlen_k) -> Params:
    return Params(float(scale), float(softcap), int(window_left), int(window_right), bool(bottom_right),
                  int(max_seqlen_q), int(max_seqlen_k))  # fmt: skip


def _fwd_fake(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, softcap,
              window_left, window_right, bottom_right):  # fmt: skip
    varlen = cu_seqlens_q is not None
    b = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    hq = q.shape[1] if varlen else q.shape[2]
    sq = max_seqlen_q if varlen else q.shape[1]
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), _lse_empty(q, b, hq, sq, varlen)


def _bwd_fake(dout, dlse, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              scale, softcap, window_left, window_right, bottom_right):  # fmt: skip
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, attn_mask, cu_q, cu_k, *rest = inputs
    out, lse = output
    ctx.rest = rest
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, cu_q, cu_k)


def _op_backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward_op(dout, dlse, q, k, v, out, lse, attn_mask, cu_q, cu_k, *ctx.rest)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


@kp_core.custom_op(OP_BWD, package=PACKAGE, spec=SPEC, dtypes=DTYPES, fake=_bwd_fake)
def flash_attention_backward_op(
    dout: torch.Tensor, dlse: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, attn_mask: Optional[torch.Tensor], cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int, scale: float, softcap: float,
    window_left: int, window_right: int, bottom_right: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dq, dk, dv) of kp::flash_attention."""
    p = _params(scale, softcap, window_left, window_right, bottom_right, max_seqlen_q, max_seqlen_k)
    return backward_impl(dout, dlse, q, k, v, out, lse, attn_mask, cu_seqlens_q, cu_seqlens_k, p)


@kp_core.custom_op(
    OP, package=PACKAGE, spec=SPEC, dtypes=DTYPES, fake=_fwd_fake, backward=_op_backward,
    setup_context=_setup_context,
)  # fmt: skip
def flash_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor], max_seqlen_q: int, max_seqlen_k: int,
    scale: float, softcap: float, window_left: int, window_right: int, bottom_right: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse). Dense: q (B, Sq, Hq, D), k/v (B, Sk, Hkv, D), lse (B, Hq, Sq). Packed (cu_seqlens given):
    q (total_q, Hq, D), k/v (total_k, Hkv, D), lse (Hq, total_q). attn_mask broadcasts to (B, Hq, Sq, Sk)."""
    p = _params(scale, softcap, window_left, window_right, bottom_right, max_seqlen_q, max_seqlen_k)
    return forward_impl(q, k, v, attn_mask, cu_seqlens_q, cu_seqlens_k, p)


class FlashAttentionFunction(torch.autograd.Function):
    """Eager calls skip the custom-op dispatch; the same launchers run."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, cu_q, cu_k, p: Params):
        ctx.set_materialize_grads(False)  # an unused lse must not cost a pass over zeros
        out, lse = forward_impl(q, k, v, attn_mask, cu_q, cu_k, p)
        ctx.p = p
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, cu_q, cu_k)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, cu_q, cu_k = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = backward_impl(dout, dlse, q, k, v, out, lse, attn_mask, cu_q, cu_k, ctx.p)
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, attn_mask, cu_q, cu_k, p: Params):
    """(out, lse) through the custom op under torch.compile, else through the autograd.Function."""
    if torch.compiler.is_compiling():
        return flash_attention_op(q, k, v, attn_mask, cu_q, cu_k, p.max_seqlen_q, p.max_seqlen_k, p.scale,
                                  p.softcap, p.window_left, p.window_right, p.bottom_right)  # fmt: skip
    return FlashAttentionFunction.apply(q, k, v, attn_mask, cu_q, cu_k, p)


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d) if d > 0 else 1.0
