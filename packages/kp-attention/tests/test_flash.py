"""kp-attention's own tests of the FlashAttention kernels: forward, lse and gradients against a float64 reference
written from the formula, SDPA against torch, varlen against a per-sequence loop, masks, errors, backends.
Broad numerics over shapes and dtypes live in conformance/specs/test_attention.py."""

import math

import kp_attention
import pytest
import torch
import torch.nn.functional as F
from kp_attention.ops import flash

import kp_core
from kp_conformance.launched import skip_if_not_covered

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, scale=None, mask=None, diag=None):
    """float64 softmax(q k^T * scale [softcapped] + mask) v on (B, S, H, D) tensors, with GQA expansion.
    Key j is visible from query i iff i + diag - left <= j <= i + diag + right (diag = Sk - Sq by default:
    FlashAttention's bottom-right alignment). Returns (out, lse); rows with no visible key give 0 and -inf."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    sq, sk, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ k.transpose(-1, -2) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    left, right = window
    right = 0 if causal else right
    rel = torch.arange(sk)[None, :] - torch.arange(sq)[:, None] - (sk - sq if diag is None else diag)
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= rel <= right
    if left >= 0:
        visible &= rel >= -left
    s = s.masked_fill(~visible.to(s.device), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return (p @ v).transpose(1, 2), lse


def run(fn, inputs, dout, dlse=None):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse)."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    out, lse = fn(*inputs)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse).double() * dlse).sum()
    loss.backward()
    return (out.detach(), lse.detach(), *(t.grad for t in inputs))


def assert_close(got, want, dtype, what):
    err = (got.double() - want.double()).abs()
    err = torch.where(torch.isnan(err) | (got.double() == want.double()), 0.0, err)  # -inf == -inf
    tol = TOL[dtype] * (1 + want.double().abs().nan_to_num(posinf=0, neginf=0).max().item())
    assert not torch.isnan(got).any(), f"{what}: NaN"
    assert err.max().item() <= tol, f"{what}: max err {err.max().item():.3g} (mean {err.mean().item():.3g}) > {tol:.3g}"


def make(b, sq, sk, hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=g).to(DEVICE, dtype)
    k = torch.randn(b, sk, hkv, d, generator=g).to(DEVICE, dtype)
    v = torch.randn(b, sk, hkv, d, generator=g).to(DEVICE, dtype)
    dout = torch.randn(b, sq, hq, d, generator=g).to(DEVICE, dtype)
    return q, k, v, dout


def check_dense(b, sq, sk, hq, hkv, d, dtype, with_lse_grad=False, **kw):
    q, k, v, dout = make(b, sq, sk, hq, hkv, d, dtype)
    dlse = torch.randn(b, hq, sq, dtype=torch.float64, device=DEVICE) if with_lse_grad else None
    with kp_core.record_launches() as rec:
        got = run(lambda q, k, v: kp_attention.flash_attention(q, k, v, return_lse=True, **kw), (q, k, v), dout, dlse)
    assert rec.backends(flash.OP) == {KERNEL} and rec.backends(flash.OP_BWD) == {KERNEL}
    want = run(lambda q, k, v: reference(q, k, v, **kw), (q, k, v), dout, dlse)
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.dtype == (torch.float32 if name == "lse" else dtype)
        assert_close(a, w, dtype, name)
    return got


CASES = [  # (b, sq, sk, hq, hkv, d, options)
    (2, 97, 97, 2, 2, 64, {}),
    (1, 113, 203, 4, 2, 59, {"causal": True}),  # GQA, odd head dim, Sq < Sk
    (1, 203, 113, 3, 1, 16, {"causal": True}),  # MQA, Sq > Sk: the first rows see no key
    (1, 130, 130, 2, 1, 80, {"window": (17, 9)}),
    (1, 90, 150, 2, 2, 32, {"causal": True, "window": (40, -1), "softcap": 5.0}),
    (2, 70, 45, 2, 2, 111, {"softcap": 2.0, "scale": 0.3, "window": (-1, 3)}),
    (1, 1, 257, 2, 2, 96, {"causal": True}),
    (1, 65, 1, 1, 1, 1, {}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[:6]}{c[6]}")
def test_forward_lse_and_grads_match_float64(case, dtype):
    skip_if_not_covered(dtype, uses_dot=True)
    *shape, kw = case
    check_dense(*shape, dtype, **kw)


def test_lse_gradient_and_unequal_blocks(monkeypatch):
    """dlse flows into the gradients; tiles with BLOCK_M != BLOCK_N cross the band at other points."""
    cfgs = {key: flash.AttnConfig(16, 32, 4, 1) for key in (("fwd", 64, 4), ("dkdv", 64, 4), ("dq", 64, 4))}
    monkeypatch.setattr(flash, "CONFIG_OVERRIDE", cfgs)
    check_dense(1, 77, 100, 2, 1, 48, torch.float32, with_lse_grad=True, causal=True, window=(30, 0))


def test_fully_masked_rows_give_zeros_and_no_nan():
    q, k, v, dout = make(1, 80, 20, 2, 2, 32, torch.float32)
    out, lse, dq, dk, dv = run(lambda q, k, v: kp_attention.flash_attention(q, k, v, causal=True, return_lse=True),
                               (q, k, v), dout)  # fmt: skip
    blind = 80 - 20  # rows i < Sq - Sk see no key under bottom-right causal
    assert torch.all(out[:, :blind] == 0) and torch.all(lse[:, :, :blind] == -math.inf)
    assert torch.all(dq[:, :blind] == 0)
    for t in (out, lse[:, :, blind:], dq, dk, dv):
        assert torch.isfinite(t).all()


def test_strided_inputs_are_read_in_place():
    base = torch.randn(2, 4, 57, 3 * 32, device=DEVICE)  # (B, H, S, 3D): q, k, v as slices of one tensor
    q, k, v = (base[..., i * 32 : (i + 1) * 32].transpose(1, 2) for i in range(3))
    before = base.clone()
    out = kp_attention.flash_attention(q, k, v, causal=True)
    assert_close(out, reference(q, k, v, causal=True)[0], torch.float32, "out")
    assert torch.equal(base, before)


@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float", "gqa"])
def test_sdpa_matches_torch(kind):
    b, h, lq, s, e = 2, 4, 45, 70, 24
    g = torch.Generator().manual_seed(1)
    q = torch.randn(b, h, lq, e, generator=g)
    k, v = (torch.randn(b, h // 2 if kind == "gqa" else h, s, e, generator=g) for _ in range(2))
    kw = {}
    if kind == "causal":
        kw["is_causal"] = True  # top-left: ones(L, S).tril()
    elif kind == "bool":
        kw["attn_mask"] = torch.rand(b, 1, lq, s, generator=g) > 0.3  # broadcast over heads
        kw["attn_mask"][..., 0] = True  # torch gives NaN for empty rows; we give 0
    elif kind == "float":
        kw["attn_mask"] = torch.randn(lq, s, generator=g)
    elif kind == "gqa":
        kw["enable_gqa"] = True
    dout = torch.randn(b, h, lq, e, generator=g)
    inputs = [t.double().to(DEVICE) for t in (q, k, v)]
    kw = {key: (t.to(DEVICE) if isinstance(t, torch.Tensor) else t) for key, t in kw.items()}
    # torch's float64 autograd path mishandles a float32 mask: give it the mask in float64
    kw64 = {key: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for key, t in kw.items()}
    want = run(lambda q, k, v: (F.scaled_dot_product_attention(q, k, v, **kw64), q[..., 0]), inputs, dout.double())
    inputs = [t.float() for t in inputs]
    got = run(lambda q, k, v: (kp_attention.scaled_dot_product_attention(q, k, v, **kw), q[..., 0]), inputs,
              dout.float().to(DEVICE))  # fmt: skip
    for name, a, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
        assert_close(a, w, torch.float32, name)


def test_sdpa_fully_masked_row_is_zero():
    q, k, v = (torch.randn(1, 2, 5, 16, device=DEVICE) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool, device=DEVICE)
    mask[2] = False
    out = kp_attention.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 2] == 0) and torch.isfinite(out).all()


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"causal": True, "window": (5, -1), "softcap": 3.0}], ids=str)
def test_varlen_matches_per_sequence_loop(kw):
    lens_q, lens_k = [5, 0, 37, 64, 1], [9, 4, 37, 33, 1]
    hq, hkv, d = 4, 2, 40
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(DEVICE)
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g).to(DEVICE) for _ in range(2))
    dout = torch.randn(sum(lens_q), hq, d, generator=g).to(DEVICE)

    def ours(q, k, v):
        return kp_attention.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True,
                                                   **kw)  # fmt: skip

    def loop(q, k, v):
        outs, lses = [], []
        for i in range(len(lens_q)):
            sl_q, sl_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            o, lse = reference(q[None, sl_q], k[None, sl_k], v[None, sl_k], **kw)
            outs.append(o[0])
            lses.append(lse[0])
        return torch.cat(outs), torch.cat(lses, 1)

    with kp_core.record_launches() as rec:
        got = run(ours, (q, k, v), dout)
    assert rec.backends(flash.OP) == {KERNEL} and rec.backends(flash.OP_BWD) == {KERNEL}
    assert got[1].shape == (hq, sum(lens_q))
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, run(loop, (q, k, v), dout)):
        assert_close(a, w, torch.float32, name)


def test_zero_sizes_launch_nothing():
    q, k, v, _ = make(0, 5, 5, 2, 2, 16, torch.float32)
    with kp_core.record_launches() as rec:
        assert kp_attention.flash_attention(q, k, v).shape == (0, 5, 2, 16)
        q, k, v, _ = make(2, 0, 7, 2, 2, 16, torch.float32)
        assert kp_attention.flash_attention(q, k, v).shape == (2, 0, 2, 16)
    assert rec.count() == 0
    q, k, v, _ = make(1, 3, 0, 2, 2, 16, torch.float32)  # no keys: every row is empty
    out, lse = kp_attention.flash_attention(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_compile_and_opcheck():
    q, k, v, dout = make(1, 33, 40, 2, 1, 16, torch.float32)
    cu = torch.tensor([0, 10, 33], dtype=torch.int32)
    cu_k = torch.tensor([0, 25, 40], dtype=torch.int32)
    mask = torch.rand(33, 40) > 0.2
    for args in (
        (q, k, v, None, None, None, 0, 0, 0.25, 0.0, 7, 0, True),
        (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, mask, None, None, 0, 0, 0.25, 1.5, -1, -1, False),
        (q[0], k[0], v[0], None, cu, cu_k, 23, 25, 0.25, 0.0, -1, 0, True),
    ):
        args = [t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in args]
        torch.library.opcheck(flash.flash_attention_op, args)

    def fn(q, k, v):
        return kp_attention.flash_attention(q, k, v, causal=True, softcap=3.0, return_lse=True)

    q, k, v = (t.requires_grad_() for t in (q, k, v))
    eager = run(fn, (q, k, v), dout)
    compiled = run(torch.compile(fn, fullgraph=True), (q, k, v), dout)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_reference_backend_is_selectable(monkeypatch):
    monkeypatch.setenv("KP_BACKEND", "reference")
    q, k, v, dout = make(1, 20, 30, 2, 1, 16, torch.float32)
    with kp_core.record_launches() as rec:
        got = run(lambda q, k, v: kp_attention.flash_attention(q, k, v, causal=True, return_lse=True),
                  (q, k, v), dout)  # fmt: skip
    assert rec.backends() == {kp_core.REFERENCE}
    for name, a, w in zip(("out", "lse", "dq", "dk", "dv"), got, run(lambda *t: reference(*t, causal=True), (q, k, v),
                                                                    dout)):  # fmt: skip
        assert_close(a, w, torch.float32, name)


def test_errors_name_the_argument():
    fa, sdpa, varlen = kp_attention.flash_attention, kp_attention.scaled_dot_product_attention, None
    q, k, v, _ = make(1, 4, 4, 2, 2, 16, torch.float32)
    varlen = kp_attention.flash_attention_varlen
    cu = torch.tensor([0, 4], dtype=torch.int32)
    cases = [
        (TypeError, "q", lambda: fa(q.numpy(), k, v)),
        (TypeError, "k", lambda: fa(q, k.double(), v)),
        (TypeError, "v", lambda: fa(q, k, v.half())),
        (TypeError, "q", lambda: fa(q.int(), k, v)),
        (ValueError, "q", lambda: fa(q[0], k, v)),
        (ValueError, "head dim", lambda: fa(q, k[..., :8], v)),
        (ValueError, "head dim", lambda: fa(q, k, v[..., :8])),
        (ValueError, "heads", lambda: fa(q[:, :, :1].expand(1, 4, 3, 16), k, v)),
        (ValueError, "batch", lambda: fa(q, k.expand(2, 4, 2, 16), v.expand(2, 4, 2, 16))),
        (ValueError, "seqlen", lambda: fa(q, k, v[:, :3])),
        (ValueError, "256", lambda: fa(*(torch.zeros(1, 2, 1, 257) for _ in range(3)))),
        (ValueError, "window", lambda: fa(q, k, v, window=(-2, 0))),
        (ValueError, "window", lambda: fa(q, k, v, window=5)),
        (ValueError, "softcap", lambda: fa(q, k, v, softcap=-1.0)),
        (ValueError, "scale", lambda: fa(q, k, v, scale=float("nan"))),
        (TypeError, "cu_seqlens_q", lambda: varlen(q[0], k[0], v[0], cu.long(), cu, 4, 4)),
        (ValueError, "cu_seqlens_k", lambda: varlen(q[0], k[0], v[0], cu, cu[None], 4, 4)),
        (
            ValueError,
            "non-decreasing",
            lambda: varlen(q[0], k[0], v[0], torch.tensor([0, 3, 2, 4]).int(), torch.tensor([0, 1, 2, 4]).int(), 4, 4),
        ),  # fmt: skip
        (ValueError, "same length", lambda: varlen(q[0], k[0], v[0], cu, torch.tensor([0, 2, 4]).int(), 4, 4)),
        (ValueError, "packed length", lambda: varlen(q[0], k[0], v[0], torch.tensor([0, 3]).int(), cu, 4, 4)),
        (ValueError, "start at 0", lambda: varlen(q[0], k[0], v[0], torch.tensor([1, 4]).int(), cu, 4, 4)),
        (ValueError, "max_seqlen_k", lambda: varlen(q[0], k[0], v[0], cu, cu, 4, 3)),
        (ValueError, "max_seqlen_q", lambda: varlen(q[0], k[0], v[0], cu, cu, -1, 4)),
        (NotImplementedError, "dropout", lambda: sdpa(q, k, v, dropout_p=0.1)),
        (ValueError, "enable_gqa", lambda: sdpa(q, k[:, :1], v[:, :1])),
        (ValueError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=torch.ones(3, 4, dtype=torch.bool))),
        (ValueError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=torch.zeros(4, 4, requires_grad=True))),
        (ValueError, "is_causal", lambda: sdpa(q, k, v, attn_mask=torch.ones(4, 4).bool(), is_causal=True)),
    ]
    for exc, word, call in cases:
        with pytest.raises(exc, match=word):
            call()
