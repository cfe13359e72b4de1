"""kp-attention's own tests of kp::flash_attention and kp::flash_attention_varlen: forward, lse and gradients by
the conformance rule against the shared float64 reference (kp_conformance.references), SDPA against torch, varlen
against a per-sequence loop, masks, errors, backends. Broad numerics live in conformance/specs/test_attention.py.
Every tensor is made on the device under test."""

import math

import pytest
import torch
import torch.nn.functional as F

import kp_attention
import kp_core
from kp_attention.ops import attention
from kp_conformance import references as ref
from kp_conformance.launched import skip_if_not_covered
from kp_conformance.tolerance import check_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON


def randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(device=DEVICE, dtype=dtype)


def run(fn, inputs, dout, dlse=None):
    """(out, lse, dq, dk, dv) of fn(q, k, v) -> (out, lse); the loss is <out, dout> (+ <lse, dlse>)."""
    inputs = [t.detach().requires_grad_() for t in inputs]
    out, lse = fn(*inputs)
    loss = (out.double() * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse).double() * dlse).sum()
    loss.backward()
    return (out.detach(), lse.detach(), *(t.grad for t in inputs))


def check_against_reference(got, q, k, v, dout, dlse=None, **kw):
    """out, dq, dk, dv by the rule against float64 and PyTorch in q's dtype; lse against float64 and logsumexp of
    the scores PyTorch forms in q's dtype."""
    dtype = q.dtype
    want = run(lambda *t: ref.attention64(*t, **kw), (q, k, v), dout, dlse)
    low = run(lambda *t: (ref.attention_lowp(*t, **kw), ref.lse_lowp(*t[:2], **kw)), (q, k, v), dout, dlse)
    for name, a, w, lo in zip(("out", "lse", "dq", "dk", "dv"), got, want, low):
        if name == "lse":
            assert torch.equal(torch.isinf(a), torch.isinf(w)), "rows with no visible key must have lse -inf"
            fin = torch.isfinite(w)
            check_close("lse", a[fin], w[fin], lo[fin], torch.float32)
        else:
            check_close(name, a, w, lo.nan_to_num(0.0), dtype)  # torch: NaN where a row sees no key


def make(b, sq, sk, hq, hkv, d, dtype, seed=0):
    return (
        randn(b, sq, hq, d, dtype=dtype, seed=seed),
        randn(b, sk, hkv, d, dtype=dtype, seed=seed + 1),
        randn(b, sk, hkv, d, dtype=dtype, seed=seed + 2),
        randn(b, sq, hq, d, dtype=dtype, seed=seed + 3),
    )


def check_dense(b, sq, sk, hq, hkv, d, dtype, with_lse_grad=False, **kw):
    q, k, v, dout = make(b, sq, sk, hq, hkv, d, dtype)
    dlse = randn(b, hq, sq, dtype=torch.float64, seed=9) if with_lse_grad else None
    with kp_core.record_launches() as rec:
        got = run(lambda q, k, v: kp_attention.flash_attention(q, k, v, return_lse=True, **kw), (q, k, v), dout, dlse)
    assert rec.backends(attention.OP) == {KERNEL} and rec.backends(attention.OP_BWD) == {KERNEL}
    assert [t.dtype for t in got] == [dtype, torch.float32, dtype, dtype, dtype]
    check_against_reference(got, q, k, v, dout, dlse, **kw)
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


def _tma_switches(monkeypatch) -> list:
    """The TMA switch of every kp launch from here on, in order."""
    switches, launch = [], kp_core.launch
    monkeypatch.setattr(kp_core, "launch", lambda *a, **k_: switches.append(a[5].get("TMA")) or launch(*a, **k_))
    return switches


def _has_descriptors() -> bool:
    """Triton >= 3.4 makes tensor descriptors in a kernel; before it the forward never takes TMA."""
    import triton.language as tl

    return hasattr(tl, "make_tensor_descriptor")


TMA_CASES = [  # head dims of a power of 2: the descriptors' condition
    (2, 57, 83, 4, 2, 32, {"causal": True}),  # batch 2, GQA, Sq < Sk, lengths off the blocks (zero-filled tails)
    (1, 130, 90, 3, 1, 16, {"window": (17, 9), "softcap": 5.0}),  # MQA, Sq > Sk
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: f"{c[:6]}{c[6]}")
def test_tma_forward_matches_float64_and_the_pointer_loads(case, dtype, monkeypatch):
    """The forward's TMA switch (off by default): it runs where pinned, by the rule against float64 (gradients
    through the usual backward), and gives the pointer loads' values (the same maths on the same tiles)."""
    skip_if_not_covered(dtype, uses_dot=True)
    if not _has_descriptors():  # test_tma_is_refused_... checks that no call takes it then
        pytest.skip("Triton < 3.4: no tl.make_tensor_descriptor, the forward has no TMA path")
    *shape, kw = case
    q, k, v, _ = make(*shape, dtype)
    assert attention.tma_ok(q, k, v, varlen=False, paged=False)
    switches = _tma_switches(monkeypatch)
    with kp_core.pinned("_attn_fwd", tma=True):
        got = check_dense(*shape, dtype, **kw)
    assert switches[0] is True, "the forward must have taken the TMA switch"
    out, lse = kp_attention.flash_attention(q, k, v, return_lse=True, **kw)
    assert switches[-1] is False, "off by default"
    if KERNEL == kp_core.INTERPRET:  # on a GPU the tiles reach the MMA by another route: the rule above judges
        assert torch.equal(got[0], out) and torch.equal(got[1], lse)


def test_tma_is_refused_where_descriptors_cannot_address_the_tensors(monkeypatch):
    q = randn(1, 40, 2, 64, dtype=torch.float16)
    # allowed exactly where this Triton makes descriptors; where it cannot, a pinned forward keeps pointer loads
    assert attention.tma_ok(q, q, q, varlen=False, paged=False) == _has_descriptors()
    if not _has_descriptors():
        switches = _tma_switches(monkeypatch)
        with kp_core.pinned("_attn_fwd", tma=True):
            kp_attention.flash_attention(q, q, q)
        assert switches == [False]
        return
    odd = randn(1, 40, 2, 48, dtype=torch.float16)  # padded head dim
    wide = randn(1, 40, 2, 65, dtype=torch.float16)[..., :64]  # rows 130 bytes apart
    shifted = randn(1, 40 * 2 * 64 + 1, dtype=torch.float16)[:, 1:].view(1, 40, 2, 64)  # base 2 bytes off
    for bad in (odd, wide, shifted, q.float()):
        assert not attention.tma_ok(bad, bad, bad, varlen=False, paged=False)
    assert not attention.tma_ok(q, q, q, varlen=True, paged=False)
    assert not attention.tma_ok(q, q, q, varlen=False, paged=True)


def test_lse_gradient_and_unequal_blocks():
    """dlse flows into the gradients; tiles with BLOCK_M != BLOCK_N cross the band at other points."""
    tiles = dict(block_m=16, block_n=32, num_warps=4, num_stages=1)
    with kp_core.pinned("_attn_fwd", **tiles), kp_core.pinned("_attn_bwd_dkdv", **tiles):
        with kp_core.pinned("_attn_bwd_dq", **tiles):
            check_dense(1, 77, 100, 2, 1, 48, torch.float32, with_lse_grad=True, causal=True, window=(30, 0))


def test_fully_masked_rows_give_zeros_and_no_nan():
    q, k, v, dout = make(1, 80, 20, 2, 2, 32, torch.float32)
    with kp_core.record_launches() as rec:
        out, lse, dq, dk, dv = run(
            lambda q, k, v: kp_attention.flash_attention(q, k, v, causal=True, return_lse=True), (q, k, v), dout
        )
    assert rec.backends() == {KERNEL}
    blind = 80 - 20  # rows i < Sq - Sk see no key under bottom-right causal
    assert torch.all(out[:, :blind] == 0) and torch.all(lse[:, :, :blind] == -math.inf)
    assert torch.all(dq[:, :blind] == 0)
    for t in (out, lse[:, :, blind:], dq, dk, dv):
        assert torch.isfinite(t).all()


def test_strided_inputs_are_read_in_place():
    base = randn(2, 4, 57, 3 * 32)  # (B, H, S, 3D): q, k, v as slices of one tensor
    q, k, v = (base[..., i * 32 : (i + 1) * 32].transpose(1, 2) for i in range(3))
    before = base.clone()
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention(q, k, v, causal=True)
    assert rec.backends() == {KERNEL}
    check_close("out", out, ref.attention64(q, k, v, causal=True)[0], ref.attention_lowp(q, k, v, causal=True), q.dtype)
    assert torch.equal(base, before)


# SDPA's input forms: (query, key, value) shapes, the head dim of value, keyword arguments. Leading dimensions
# broadcast as in torch (dim -3 is the heads dimension).
SDPA_FORMS = {
    "none": ((2, 4, 45, 24), (2, 4, 70, 24), 24, {}),
    "causal": ((2, 4, 45, 24), (2, 4, 70, 24), 24, {"is_causal": True}),  # top-left: ones(L, S).tril()
    "bool": ((2, 4, 45, 24), (2, 4, 70, 24), 24, {"attn_mask": "bool"}),
    "float": ((2, 4, 45, 24), (2, 4, 70, 24), 24, {"attn_mask": "float"}),
    "gqa": ((2, 4, 45, 24), (2, 2, 70, 24), 24, {"enable_gqa": True}),
    "3d": ((3, 45, 24), (3, 70, 24), 24, {}),  # (N, L, E), L != S
    "3d gqa causal": ((4, 45, 20), (2, 70, 20), 20, {"enable_gqa": True, "is_causal": True}),
    "2d": ((45, 24), (70, 24), 24, {"attn_mask": "bool"}),
    "5d": ((2, 3, 4, 45, 24), (3, 4, 70, 24), 24, {"attn_mask": "float"}),  # key/value broadcast over dim 0
    "3d query, 4d key": ((4, 45, 24), (2, 4, 70, 24), 24, {}),
    "query broadcast": ((1, 4, 45, 24), (2, 4, 70, 24), 24, {"is_causal": True}),
    "one kv head, no gqa": ((2, 4, 45, 24), (2, 1, 70, 24), 24, {}),
    "value head dim larger": ((2, 4, 45, 24), (2, 4, 70, 24), 40, {}),
    "value head dim smaller": ((2, 2, 45, 24), (2, 2, 70, 24), 16, {"is_causal": True}),
}


def _sdpa_4d(q, k, v, mask, gqa):
    """The same call as 4-D (B, H, L, E) tensors, torch's broadcasting written out, and the output shape: the
    baseline's inputs, so its low-precision error is that of torch's own 4-D kernels."""
    nd = max(3, q.dim(), k.dim(), v.dim())
    q, k, v = (t.reshape((1,) * (nd - t.dim()) + tuple(t.shape)) for t in (q, k, v))
    if gqa:
        k, v = (t.repeat_interleave(q.shape[-3] // t.shape[-3], -3) for t in (k, v))
    full = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    q, k, v = (t.expand(*full, *t.shape[-2:]).reshape(-1, full[-1], *t.shape[-2:]) for t in (q, k, v))
    if mask is not None:
        mask = mask.expand(*full, q.shape[-2], k.shape[-2]).reshape(-1, full[-1], q.shape[-2], k.shape[-2])
    return q, k, v, mask, (*full, q.shape[-2], v.shape[-1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", list(SDPA_FORMS))
def test_sdpa_matches_torch(kind, dtype):
    """Every input form torch's SDPA takes gives torch's shape, and values and gradients by the rule against torch
    in float64; the baseline error is torch's SDPA in the input dtype on the same call written as 4-D tensors."""
    skip_if_not_covered(dtype, uses_dot=True)
    q_shape, k_shape, ev, kw = SDPA_FORMS[kind]
    q, k = randn(*q_shape, dtype=dtype, seed=1), randn(*k_shape, dtype=dtype, seed=2)
    v = randn(*k_shape[:-1], ev, dtype=dtype, seed=3)
    out_shape = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), **{key: val for key, val in kw.items() if key != "attn_mask"}
    ).shape
    dout = randn(*out_shape, dtype=dtype, seed=4)
    lq, s = q_shape[-2], k_shape[-2]
    kw = dict(kw)
    if kw.get("attn_mask") == "bool":
        mask = randn(lq, s, seed=5) > -0.5
        mask[..., 0] = True  # torch gives NaN for empty rows; kp gives 0
        kw["attn_mask"] = mask
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = randn(q_shape[-3], lq, s, dtype=dtype, seed=6)  # broadcast over the batch dims

    def grads(fn, inputs):
        return run(lambda q, k, v: (fn(q, k, v), q[..., 0]), inputs, dout)

    def low_fn(q, k, v):
        q4, k4, v4, mask4, shape = _sdpa_4d(q, k, v, kw.get("attn_mask"), kw.get("enable_gqa", False))
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask4, is_causal=kw.get("is_causal", False))
        return out.reshape(shape).reshape(out_shape)

    with kp_core.record_launches() as rec:
        got = grads(lambda *t: kp_attention.scaled_dot_product_attention(*t, **kw), (q, k, v))
    assert rec.backends() == {KERNEL}
    kw64 = {key: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for key, t in kw.items()}
    want = grads(lambda *t: F.scaled_dot_product_attention(*t, **kw64), [t.double() for t in (q, k, v)])
    low = grads(low_fn, (q, k, v))
    assert got[0].shape == out_shape
    for i, name in zip((0, 2, 3, 4), ("out", "dq", "dk", "dv")):
        check_close(f"sdpa {kind} {name}", got[i], want[i], low[i], dtype)


def test_sdpa_fully_masked_row_is_zero():
    q, k, v = (randn(1, 2, 5, 16, seed=i) for i in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool, device=DEVICE)
    mask[2] = False
    with kp_core.record_launches() as rec:
        out = kp_attention.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert rec.backends() == {KERNEL}
    assert torch.all(out[:, :, 2] == 0) and torch.isfinite(out).all()


@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"causal": True, "window": (5, -1), "softcap": 3.0}], ids=str)
def test_varlen_matches_per_sequence_loop(kw):
    lens_q, lens_k = [5, 0, 37, 64, 1], [9, 4, 37, 33, 1]
    hq, hkv, d = 4, 2, 40
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, dout = randn(sum(lens_q), hq, d, seed=2), randn(sum(lens_q), hq, d, seed=3)
    k, v = randn(sum(lens_k), hkv, d, seed=4), randn(sum(lens_k), hkv, d, seed=5)

    def ours(q, k, v):
        return kp_attention.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **kw)

    def loop(attention_fn):
        def fn(q, k, v):
            outs, lses = [], []
            for i in range(len(lens_q)):
                sl_q, sl_k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
                out, lse = attention_fn(q[None, sl_q], k[None, sl_k], v[None, sl_k])
                outs.append(out[0])
                lses.append(lse[0])
            return torch.cat(outs), torch.cat(lses, 1)

        return fn

    with kp_core.record_launches() as rec:
        got = run(ours, (q, k, v), dout)
    assert rec.backends(attention.OP_VARLEN) == {KERNEL} and rec.backends(attention.OP_VARLEN_BWD) == {KERNEL}
    assert got[1].shape == (hq, sum(lens_q))
    want = run(loop(lambda *t: ref.attention64(*t, **kw)), (q, k, v), dout)
    low = run(loop(lambda *t: (ref.attention_lowp(*t, **kw), ref.lse_lowp(*t[:2], **kw))), (q, k, v), dout)
    for name, a, w, lo in zip(("out", "lse", "dq", "dk", "dv"), got, want, low):
        if name == "lse":
            fin = torch.isfinite(w)
            a, w, lo = a[fin], w[fin], lo[fin]
        check_close(f"varlen {name}", a, w, lo.nan_to_num(0.0), a.dtype)  # torch: NaN where a row sees no key


def test_zero_sizes_launch_nothing():
    with kp_core.record_launches() as rec:
        q, k, v, _ = make(0, 5, 5, 2, 2, 16, torch.float32)
        assert kp_attention.flash_attention(q, k, v).shape == (0, 5, 2, 16)
        q, k, v, _ = make(2, 0, 7, 2, 2, 16, torch.float32)
        assert kp_attention.flash_attention(q, k, v).shape == (2, 0, 2, 16)
    assert rec.count() == 0
    q, k, v, _ = make(1, 3, 0, 2, 2, 16, torch.float32)  # no keys: every row is empty
    out, lse = kp_attention.flash_attention(q, k, v, return_lse=True)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_compile_and_opcheck():
    q, k, v, dout = make(1, 33, 40, 2, 1, 16, torch.float32)
    cu_q = torch.tensor([0, 10, 33], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 25, 40], dtype=torch.int32, device=DEVICE)
    mask = torch.rand(33, 40, device=DEVICE) > 0.2
    seed = torch.tensor([1234], device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with kp_core.record_launches() as rec:
        torch.library.opcheck(
            attention.FLASH.op, (*leaves, None, None, None, 0.25, 0.0, 7, 0, True, 0.0, "triton", False)
        )
        transposed = q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
        args = (transposed, *leaves[1:], mask, None, seed, 0.25, 1.5, -1, -1, False, 0.3, "triton", False)  # dropout
        torch.library.opcheck(attention.FLASH.op, args)
        packed = [t[0].detach().requires_grad_() for t in (q, k, v)]
        args = (*packed, cu_q, cu_k, None, seed, None, 23, 25, 0.25, 0.0, -1, 0, 0.3, "triton", False)
        torch.library.opcheck(attention.FLASH_VARLEN.op, args)
    assert rec.backends() == {KERNEL}

    def fn(q, k, v):
        return kp_attention.flash_attention(q, k, v, causal=True, softcap=3.0, return_lse=True)

    eager = run(fn, (q, k, v), dout)
    with kp_core.record_launches() as rec:
        compiled = run(torch.compile(fn, fullgraph=True), (q, k, v), dout)
    assert rec.backends(attention.OP) == {KERNEL} and rec.backends(attention.OP_BWD) == {KERNEL}
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def test_a_tensor_on_another_device_is_refused_by_the_op():
    """The ops are public torch ops: called directly, a cu_seqlens or mask on another device raises."""
    q, k, v, _ = make(1, 8, 8, 2, 2, 16, torch.float32)
    other = torch.ones(3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the same device as q"):
        attention.FLASH_VARLEN(
            q[0], k[0], v[0], other, other, None, None, None, 8, 8, 0.25, 0.0, -1, -1, 0.0, "triton", False
        )
    with pytest.raises(ValueError, match="attn_mask must be on the same device as q"):
        meta_mask = torch.ones(8, 8, dtype=torch.bool, device="meta")
        attention.FLASH(q, k, v, meta_mask, None, None, 0.25, 0.0, -1, -1, False, 0.0, "triton", False)
    with pytest.raises(ValueError, match="dropout_seed"):
        attention.FLASH(q, k, v, None, None, None, 0.25, 0.0, -1, -1, False, 0.5, "triton", False)


def test_reference_backend_is_selectable(monkeypatch):
    monkeypatch.setenv("KP_BACKEND", "reference")
    q, k, v, dout = make(1, 20, 30, 2, 1, 16, torch.float32)
    with kp_core.record_launches() as rec:
        got = run(lambda q, k, v: kp_attention.flash_attention(q, k, v, causal=True, return_lse=True), (q, k, v), dout)
    assert rec.backends() == {kp_core.REFERENCE}
    check_against_reference(got, q, k, v, dout, causal=True)


def test_errors_name_the_argument():
    fa, sdpa, varlen = kp_attention.flash_attention, kp_attention.scaled_dot_product_attention, None
    q, k, v, _ = make(1, 4, 4, 2, 2, 16, torch.float32)
    varlen = kp_attention.flash_attention_varlen
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)

    def ints(*values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    cases = [
        (TypeError, "q", lambda: fa(q.tolist(), k, v)),
        (TypeError, "k", lambda: fa(q, k.double(), v)),
        (TypeError, "v", lambda: fa(q, k, v.half())),
        (TypeError, "q", lambda: fa(q.int(), k, v)),
        (ValueError, "q", lambda: fa(q[0], k, v)),
        (ValueError, "head dim", lambda: fa(q, k[..., :8], v)),
        (ValueError, "head dim", lambda: fa(q, k, v[..., :8])),
        (ValueError, "heads", lambda: fa(q[:, :, :1].expand(1, 4, 3, 16), k, v)),
        (ValueError, "batch", lambda: fa(q, k.expand(2, 4, 2, 16), v.expand(2, 4, 2, 16))),
        (ValueError, "seqlen", lambda: fa(q, k, v[:, :3])),
        (ValueError, "256", lambda: fa(*(torch.zeros(1, 2, 1, 257, device=DEVICE) for _ in range(3)))),
        (ValueError, "window", lambda: fa(q, k, v, window=(-2, 0))),
        (ValueError, "window", lambda: fa(q, k, v, window=5)),
        (ValueError, "softcap", lambda: fa(q, k, v, softcap=-1.0)),
        (ValueError, "scale", lambda: fa(q, k, v, scale=float("nan"))),
        (TypeError, "cu_seqlens_q", lambda: varlen(q[0], k[0], v[0], cu.long(), cu, 4, 4)),
        (ValueError, "cu_seqlens_k", lambda: varlen(q[0], k[0], v[0], cu, cu[None], 4, 4)),
        (ValueError, "non-decreasing", lambda: varlen(q[0], k[0], v[0], ints(0, 3, 2, 4), ints(0, 1, 2, 4), 4, 4)),
        (ValueError, "same length", lambda: varlen(q[0], k[0], v[0], cu, ints(0, 2, 4), 4, 4)),
        (ValueError, "packed length", lambda: varlen(q[0], k[0], v[0], ints(0, 3), cu, 4, 4)),
        (ValueError, "start at 0", lambda: varlen(q[0], k[0], v[0], ints(1, 4), cu, 4, 4)),
        (ValueError, "max_seqlen_k", lambda: varlen(q[0], k[0], v[0], cu, cu, 4, 3)),
        (ValueError, "max_seqlen_q", lambda: varlen(q[0], k[0], v[0], cu, cu, -1, 4)),
        (ValueError, "dropout_p", lambda: sdpa(q, k, v, dropout_p=1.5)),
        (ValueError, "dropout_p", lambda: fa(q, k, v, dropout_p=-0.1)),
        (TypeError, "dropout_seed", lambda: fa(q, k, v, dropout_p=0.1, dropout_seed=torch.zeros(1, device=DEVICE))),
        (
            ValueError,
            "dropout_seed",
            lambda: fa(q, k, v, dropout_p=0.1, dropout_seed=torch.zeros(2, 1, dtype=torch.int64, device=DEVICE)),
        ),
        (ValueError, "enable_gqa", lambda: sdpa(q, k[:, :3], v[:, :3])),  # 4 heads against 3
        (ValueError, "multiple", lambda: sdpa(q, k[:, :3], v[:, :3], enable_gqa=True)),
        (ValueError, "at least 2 dimensions", lambda: sdpa(q[0, 0, 0], k, v)),
        (
            ValueError,
            "batch dimensions",
            lambda: sdpa(q.expand(2, 4, 2, 16), k.expand(3, 4, 2, 16), v.expand(3, 4, 2, 16)),
        ),
        (ValueError, "sequence lengths", lambda: sdpa(q, k, v[:, :, :1])),
        (ValueError, "head dims", lambda: sdpa(q, k[..., :8], v)),
        (ValueError, "value", lambda: sdpa(q, k, torch.zeros(1, 4, 2, 257, device=DEVICE))),
        (TypeError, "value", lambda: sdpa(q, k, v.double())),
        (ValueError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=torch.ones(3, 4, dtype=torch.bool, device=DEVICE))),
        (ValueError, "attn_mask", lambda: sdpa(q, k, v, attn_mask=torch.zeros(4, 4, device=DEVICE).requires_grad_())),
        (
            ValueError,
            "is_causal",
            lambda: sdpa(q, k, v, attn_mask=torch.ones(4, 4, device=DEVICE).bool(), is_causal=True),
        ),
    ]
    for exc, word, call in cases:
        with pytest.raises(exc, match=word):
            call()


def test_zero_alibi_slopes_are_plain_attention_and_slopes_move_the_output():
    """s - 0 * |j - i - diag| is s exactly: zero slopes give the plain kernel's bits, forward and backward; real
    slopes change the output (the conformance spec checks the values)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, s, 4, 32, generator=g).to(DEVICE, torch.float16) for s in (37, 45, 45))
    do = torch.randn(2, 37, 4, 32, generator=g).to(DEVICE, torch.float16)

    def run(slopes):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = kp_attention.flash_attention(*leaves, causal=True, alibi_slopes=slopes)
        out.backward(do)
        return [out.detach()] + [t.grad for t in leaves]

    plain, zero = run(None), run(torch.zeros(4, device=DEVICE))
    assert all(torch.equal(a, b) for a, b in zip(plain, zero))
    assert not torch.equal(plain[0], run(torch.full((2, 4), 0.5, device=DEVICE))[0])


@pytest.mark.parametrize("shape", [(3, 4, 4, 1, 8), (2, 9, 33, 2, 16)], ids=str)
def test_large_logits_gradients_round_like_fp32_maths(shape):
    """Values in [-9, 9] at small head dims (PyTorch's own SDPA tests): rows near one-hot, dS all cancellation.
    The dQ kernel's exact delta (EXACT_DELTA) keeps dq and dk by the rule against fp32 maths rounded to fp16 once;
    delta from the rounded O missed it by 5-10x (PyTorch's CPU fp16 SDPA does the same, so the spec's baseline
    cannot show it on the CPU; on the GPU torch's fused kernels do)."""
    b, sq, sk, h, d = shape
    g = torch.Generator().manual_seed(sum(shape))
    q, k, v = ((torch.rand(b, s, h, d, generator=g, dtype=torch.float64) * 18 - 9) for s in (sq, sk, sk))
    q, k, v = (t.to(device=DEVICE, dtype=torch.float16) for t in (q, k, v))
    dout = randn(b, sq, h, d, dtype=torch.float16, seed=4)
    with kp_core.record_launches() as rec:
        got = run(lambda q, k, v: kp_attention.flash_attention(q, k, v, return_lse=True), (q, k, v), dout)
    assert rec.backends(attention.OP_BWD) == {KERNEL}
    want = run(lambda *t: ref.attention64(*t), (q, k, v), dout)
    fp32 = run(lambda *t: tuple(x.float() for x in ref.attention64(*(y.float() for y in t))), (q, k, v), dout)
    for name, a, w, lo in zip(("dq", "dk", "dv"), got[2:], want[2:], fp32[2:]):
        check_close(name, a, w, lo.half(), torch.float16)


def _paged(t: torch.Tensor, cu: torch.Tensor, page: int, spare: int, seed: int):
    """(pages (num_blocks, page, H, D), block_table (batch, max pages)) holding packed t's sequences in shuffled
    pages, with `spare` unused pages of noise."""
    lens = (cu[1:] - cu[:-1]).tolist()
    per = max(-(-n // page) for n in lens)
    total = per * len(lens) + spare
    order = torch.randperm(total, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    pages = randn(total, page, *t.shape[1:], dtype=t.dtype, seed=seed)
    table = order[: per * len(lens)].view(len(lens), per).to(torch.int32)
    for b, (start, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        j = torch.arange(n, device=DEVICE)
        pages[table[b].long()[j // page], j % page] = t[start : start + n]
    return pages, table


@pytest.mark.parametrize("dtype,page", [(torch.float32, 48), (torch.float16, 16)], ids=str)
def test_paged_varlen_reads_the_pages_as_the_packed_keys(dtype, page):
    q, k, v, _ = make(1, 70, 90, 4, 2, 32, dtype)
    q, k, v = q[0], k[0], v[0]
    cu_q = torch.tensor([0, 30, 31, 70], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 40, 41, 90], dtype=torch.int32, device=DEVICE)
    kp_pages, table = _paged(k, cu_k, page, 3, seed=5)
    vp_pages, _ = _paged(v, cu_k, page, 3, seed=5)
    kw = dict(causal=True, alibi_slopes=torch.tensor([0.1, 0.2, 0.3, 0.4], device=DEVICE), return_lse=True)
    want = kp_attention.flash_attention_varlen(q, k, v, cu_q, cu_k, 39, 49, **kw)
    with kp_core.record_launches() as rec:
        got = kp_attention.flash_attention_varlen(q, kp_pages, vp_pages, cu_q, cu_k, 39, 49, block_table=table, **kw)
    assert rec.backends(attention.OP_VARLEN) == {KERNEL}
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got[0], want[0], **tol)  # the key blocks may split otherwise: not bit for bit
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


def test_paged_varlen_refuses_what_it_cannot_do():
    q, k, v, _ = make(1, 20, 20, 2, 2, 16, torch.float32)
    cu = torch.tensor([0, 20], dtype=torch.int32, device=DEVICE)
    pages, table = _paged(k[0], cu, 16, 0, seed=1)
    varlen = kp_attention.flash_attention_varlen
    with pytest.raises(NotImplementedError, match="no backward"):
        varlen(q[0].requires_grad_(), pages, pages, cu, cu, 20, 20, block_table=table)
    with pytest.raises(ValueError, match="page ids in use"):
        varlen(q[0], pages, pages, cu, cu, 20, 20, block_table=table + 5)
    with pytest.raises(ValueError, match="exceeds its block_table"):
        varlen(q[0], pages, pages, cu, cu, 20, 20, block_table=table[:, :1])
    with pytest.raises(ValueError, match="multiple of 16"):
        varlen(q[0], pages[:, :8], pages[:, :8], cu, cu, 20, 20, block_table=table)
    with pytest.raises(ValueError, match="k must have 4 dimensions"):
        varlen(q[0], k[0], v[0], cu, cu, 20, 20, block_table=table)
    with pytest.raises(ValueError, match="one row per sequence"):
        varlen(q[0], pages, pages, cu, cu, 20, 20, block_table=table.repeat(2, 1))
