"""kp_attention.flash_attn: FlashAttention 2's functions over kp's. Each one is checked against the kp call it
stands for (bit for bit: the same kernels run), the packed forms against the unpacked ones, gradients included,
and the pieces the module adds (rotary embedding, cache_batch_idx, FlashAttention's defaults) against independent
computations. The kernels themselves are checked by the conformance specs."""

import pytest
import torch

import kp_attention
import kp_attention.flash_attn as fa
import kp_core
from kp_attention.ops import decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float16


def _randn(*shape, seed=0, dtype=DTYPE):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(DEVICE, dtype)


def _grads(fn, *leaves):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    out.backward(_randn(*out.shape, seed=9))
    return [out.detach()] + [t.grad for t in leaves]


def _equal(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


OPTIONS = dict(causal=True, window_size=(24, -1), softcap=5.0, softmax_scale=0.2)


def test_flash_attn_func_is_kps_call_and_returns_as_flashattention():
    q, k, v = _randn(2, 37, 4, 32, seed=1), _randn(2, 45, 2, 32, seed=2), _randn(2, 45, 2, 32, seed=3)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with kp_core.record_launches() as rec:
        out, lse, probs = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **OPTIONS)
    assert rec.backends() and kp_core.REFERENCE not in rec.backends()
    want, want_lse = kp_attention.flash_attention(
        q, k, v, causal=True, window=(24, -1), softcap=5.0, scale=0.2, alibi_slopes=slopes, return_lse=True
    )
    assert torch.equal(out, want) and torch.equal(lse, want_lse) and probs is None  # None without dropout, as FA's
    assert lse.shape == (2, 4, 37)
    assert torch.equal(fa.flash_attn_func(q, k, v), kp_attention.flash_attention(q, k, v))  # FA's defaults


def test_packed_forms_equal_the_unpacked_call_forward_and_backward():
    qkv = _randn(2, 40, 3, 4, 32, seed=5)
    kv = qkv[:, :, 1:].clone()
    q = qkv[:, :, 0].clone()
    plain = _grads(lambda q, k, v: fa.flash_attn_func(q, k, v, **OPTIONS), *qkv.unbind(2))
    packed = _grads(lambda t: fa.flash_attn_qkvpacked_func(t, **OPTIONS), qkv)
    _equal(plain, [packed[0], *packed[1].unbind(2)])
    kv_packed = _grads(lambda q, t: fa.flash_attn_kvpacked_func(q, t, **OPTIONS), q, kv)
    _equal(plain, [kv_packed[0], kv_packed[1], *kv_packed[2].unbind(2)])


def test_varlen_forms_equal_kps_varlen_call():
    lens = [5, 33, 0, 17]
    cu = torch.tensor([0, 5, 38, 38, 55], dtype=torch.int32, device=DEVICE)
    qkv = _randn(sum(lens), 3, 4, 32, seed=6)
    kw = dict(causal=True, window_size=(8, -1))
    want = _grads(
        lambda q, k, v: kp_attention.flash_attention_varlen(q, k, v, cu, cu, 33, 33, causal=True, window=(8, -1)),
        *qkv.unbind(1),
    )
    plain = _grads(lambda q, k, v: fa.flash_attn_varlen_func(q, k, v, cu, cu, 33, 33, **kw), *qkv.unbind(1))
    packed = _grads(lambda t: fa.flash_attn_varlen_qkvpacked_func(t, cu, 33, **kw), qkv)
    kv_packed = _grads(
        lambda q, t: fa.flash_attn_varlen_kvpacked_func(q, t, cu, cu, 33, 33, **kw), qkv[:, 0], qkv[:, 1:]
    )
    _equal(want, plain)
    _equal(want, [packed[0], *packed[1].unbind(1)])
    _equal(want, [kv_packed[0], kv_packed[1], *kv_packed[2].unbind(1)])
    out, lse, probs = fa.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, 33, 33, return_attn_probs=True)
    assert lse.shape == (4, sum(lens)) and probs is None


def test_kvcache_defaults_to_flashattentions_non_causal_call():
    q, kc, vc = _randn(2, 3, 4, 32, seed=7), _randn(2, 48, 2, 32, seed=8), _randn(2, 48, 2, 32, seed=9)
    lens = torch.tensor([20, 41], dtype=torch.int32, device=DEVICE)
    got = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    assert torch.equal(got, kp_attention.flash_attention_with_kvcache(q, kc, vc, lens, causal=False))
    # cache_seqlens=None: the whole cache
    whole = kp_attention.flash_attention_with_kvcache(q, kc, vc, 48, causal=False)
    assert torch.equal(fa.flash_attn_with_kvcache(q, kc, vc), whole)


def test_window_size_may_be_a_tensor_pair():
    """FlashAttention's own tests draw window_size with torch.randint(0, seqlen_k, (2,))."""
    q = _randn(1, 20, 2, 16, seed=5)
    want = fa.flash_attn_func(q, q, q, window_size=(3, 2))
    assert torch.equal(fa.flash_attn_func(q, q, q, window_size=torch.tensor([3, 2])), want)
    with pytest.raises(ValueError, match="window must be a pair of ints"):
        fa.flash_attn_func(q, q, q, window_size=torch.tensor([3.0, 2.0]))


@pytest.mark.parametrize("length", [32, 39])  # any cache length (39: no multiple of the 16-key blocks)
def test_cache_batch_idx_reads_and_appends_the_rows_it_names(length):
    q, k, v = _randn(2, 2, 4, 32, seed=10), _randn(2, 2, 2, 32, seed=11), _randn(2, 2, 2, 32, seed=12)
    kc, vc = _randn(3, length, 2, 32, seed=13), _randn(3, length, 2, 32, seed=14)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([9, length - 2], dtype=torch.int32, device=DEVICE)
    kc_rows, vc_rows = kc[idx.long()].clone(), vc[idx.long()].clone()  # the sequences' own caches, gathered
    want = kp_attention.flash_attention_with_kvcache(q, kc_rows, vc_rows, lens, k=k, v=v, causal=True)
    got = fa.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=idx, causal=True)
    assert torch.equal(got, want)
    # the new tokens went into the named rows of the caller's cache, nowhere else
    assert torch.equal(kc[idx.long()], kc_rows) and torch.equal(vc[idx.long()], vc_rows)
    assert torch.equal(kc[1], _randn(3, length, 2, 32, seed=13)[1])


def _rotary_complex(x, cos, sin, positions, interleaved):
    """Rotary embedding through complex multiplication, in float64: x's pairs as complex numbers times
    exp(i theta) = cos + i sin (Su et al. 2021), the pairs (0, 1), (2, 3), ... or (j, j + rotary_dim / 2)."""
    half = cos.shape[1]
    xd = x.double()
    rot = xd[..., : 2 * half]
    pairs = rot.unflatten(-1, (half, 2)) if interleaved else torch.stack((rot[..., :half], rot[..., half:]), -1)
    z = torch.view_as_complex(pairs.contiguous())
    e = torch.polar(torch.ones_like(cos.double()), torch.atan2(sin.double(), cos.double()))[positions][:, :, None]
    r = torch.view_as_real(z * e)
    r = r.flatten(-2) if interleaved else torch.cat((r[..., 0], r[..., 1]), -1)
    return torch.cat((r, xd[..., 2 * half :]), -1)


def _decode_case(sq: int, rd: int, seed: int):
    """q, k, v (batch 2, sq new tokens, 4 / 2 heads, D 32), the caches (48 rows) and rotary tables (64 x rd / 2)."""
    b, hq, hkv, d = 2, 4, 2, 32
    q, k, v = (_randn(b, sq, h, d, seed=seed + i) for i, h in enumerate((hq, hkv, hkv)))
    kc, vc = _randn(b, 48, hkv, d, seed=seed + 3), _randn(b, 48, hkv, d, seed=seed + 4)
    theta = torch.arange(64, dtype=torch.float64)[:, None] * 10000 ** (-torch.arange(rd // 2) / (rd // 2))
    return q, k, v, kc, vc, theta.cos().float().to(DEVICE), theta.sin().float().to(DEVICE)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary_rotates_q_and_the_new_keys_at_their_positions(interleaved, causal):
    b, sq = 2, 3
    q, k, v, kc, vc, cos, sin = _decode_case(sq, 16, seed=15)
    lens = torch.tensor([7, 40], dtype=torch.int32, device=DEVICE)
    pos_k = lens.long()[:, None] + torch.arange(sq, device=DEVICE)
    pos_q = pos_k if causal else lens.long()[:, None].expand(b, sq)  # FlashAttention's rule
    q_rot = _rotary_complex(q, cos, sin, pos_q, interleaved).to(DTYPE)
    k_rot = _rotary_complex(k, cos, sin, pos_k, interleaved).to(DTYPE)
    kc_want, vc_want = kc.clone(), vc.clone()
    want = kp_attention.flash_attention_with_kvcache(q_rot, kc_want, vc_want, lens, k=k_rot, v=v, causal=causal)
    got = fa.flash_attn_with_kvcache(
        q, kc, vc, k, v, cos, sin, cache_seqlens=lens, causal=causal, rotary_interleaved=interleaved
    )
    # fp32 rotation rounded once to fp16 against float64 rounded once: at most one fp16 ulp apart, so compare
    # the caches' rotated keys to that and the outputs by the attention they feed
    torch.testing.assert_close(kc, kc_want, rtol=2**-10, atol=2**-14)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert torch.equal(vc, vc_want)


def test_bad_packed_and_rotary_arguments_name_themselves(monkeypatch):
    with pytest.raises(ValueError, match="qkv"):
        fa.flash_attn_qkvpacked_func(_randn(1, 8, 2, 1, 16))
    q = _randn(1, 1, 2, 16)
    cache = _randn(1, 16, 2, 16)
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin"):
        fa.flash_attn_with_kvcache(q, cache, cache.clone(), q, q, rotary_cos=torch.ones(16, 4, device=DEVICE))
    cos = torch.ones(4, 4, device=DEVICE)
    fa.flash_attn_with_kvcache(q, cache, cache.clone(), q, q, cos, cos, cache_seqlens=8)  # positions past the table
    with pytest.raises(ValueError, match="rotary positions"):  # by default flagged on the device, reported later
        decode.check_inputs(torch.device(DEVICE))
    monkeypatch.setattr(decode, "VALIDATE_VALUES", "sync")
    with pytest.raises(ValueError, match="rows"):
        fa.flash_attn_with_kvcache(q, cache, cache.clone(), q, q, cos, cos, cache_seqlens=8)
    with pytest.raises(TypeError, match="cache_batch_idx"):
        fa.flash_attn_with_kvcache(q, cache, cache, cache_batch_idx=torch.zeros(1, device=DEVICE))


def test_cache_leftpad_starts_each_sequence_and_rotary_positions_stay_the_rows(monkeypatch):
    sq = 2
    q, k, v, kc, vc, cos, sin = _decode_case(sq, 32, seed=20)
    lens = torch.tensor([10, 40], dtype=torch.int32, device=DEVICE)
    pad = torch.tensor([4, 0], dtype=torch.int32, device=DEVICE)
    # FlashAttention's positions are the cache rows, cache_leftpad or not (its own test's reference says so)
    pos = lens.long()[:, None] + torch.arange(sq, device=DEVICE)
    q_rot = _rotary_complex(q, cos, sin, pos, False).to(DTYPE)
    k_rot = _rotary_complex(k, cos, sin, pos, False).to(DTYPE)
    kc_want, vc_want = kc.clone(), vc.clone()
    want = kp_attention.flash_attention_with_kvcache(
        q_rot, kc_want, vc_want, lens, k=k_rot, v=v, causal=True, cache_leftpad=pad
    )
    got = fa.flash_attn_with_kvcache(
        q, kc, vc, k, v, cos, sin, cache_seqlens=lens, cache_leftpad=pad, causal=True, rotary_interleaved=False
    )
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)

    # and the rows before cache_leftpad are not attended: changing them changes nothing
    def attend():
        return fa.flash_attn_with_kvcache(q_rot, kc, vc, cache_seqlens=lens + sq, cache_leftpad=pad, causal=True)

    kc[0, :4] = 100.0
    again = attend()
    kc[0, :4] = 0.0
    assert torch.equal(again, attend())
    fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens + 1)
    with pytest.raises(ValueError, match="cache_leftpad"):  # flagged on the device, reported later
        decode.check_inputs(torch.device(DEVICE))
    monkeypatch.setattr(decode, "VALIDATE_VALUES", "sync")
    with pytest.raises(ValueError, match="cache_leftpad"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=lens + 1)
