"""Attention dropout (kp_attention.ops.dropout): the Philox draw against its published known answers, the kernels'
forward and backward by the rule against the float64 reference given the same mask (drawn in PyTorch from the
call's seed: a kernel drawing another mask fails by far more than the rule allows), reproducibility, the drop
rate, varlen, SDPA, the HF patch and FlashAttention's S_dmask. Every tensor is made on the device under test."""

import pytest
import torch
from test_attention import DEVICE, KERNEL, check_against_reference, make, run

import kp_attention
import kp_attention.flash_attn as fa
import kp_core
from kp_attention.ops import attention, dropout
from kp_conformance.launched import skip_if_not_covered


def test_philox_gives_the_published_known_answers():
    """Random123's kat_vectors for philox4x32-10 (the generator of torch's CUDA RNG and Triton's tl.philox)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, (k0, k1), want in cases:
        got = dropout.philox(k0 | (k1 << 32), *(torch.tensor(c, device=DEVICE) for c in counter))
        assert [int(w) for w in got] == list(want)


def _keep(seed, b, hq, sq, sk, p):
    bh = torch.arange(b * hq, device=DEVICE)
    return dropout.keep_mask(seed, bh, sq, sk, p).view(b, hq, sq, sk)


CASES = [  # (b, sq, sk, hq, hkv, d, p, options)
    (2, 67, 50, 2, 1, 24, 0.17, {"window": (20, 5), "softcap": 4.0}),  # MQA, Sq > Sk
    (1, 45, 90, 4, 2, 16, 0.5, {"causal": True, "alibi": "head"}),  # GQA, Sq < Sk, ALiBi
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[:7]}{c[7]}")
def test_forward_and_backward_match_float64_with_the_same_mask(case, dtype):
    skip_if_not_covered(dtype, uses_dot=True)
    b, sq, sk, hq, hkv, d, p, kw = case
    kw = dict(kw)
    if kw.pop("alibi", None):
        kw["alibi_slopes"] = torch.linspace(0.05, 0.4, hq, device=DEVICE)
    q, k, v, dout = make(b, sq, sk, hq, hkv, d, dtype)
    seed = torch.tensor([20261127 + sq], device=DEVICE)
    with kp_core.record_launches() as rec:
        fn = lambda q, k, v: kp_attention.flash_attention(  # noqa: E731
            q, k, v, dropout_p=p, dropout_seed=seed, return_lse=True, **kw
        )
        got = run(fn, (q, k, v), dout)
    assert rec.backends(attention.OP) == {KERNEL} and rec.backends(attention.OP_BWD) == {KERNEL}
    keep = _keep(seed, b, hq, sq, sk, p)
    check_against_reference(got, q, k, v, dout, keep=keep, dropout_p=p, **kw)
    without = kp_attention.flash_attention(q, k, v, **kw)
    assert not torch.allclose(got[0].float(), without.float(), atol=0.05)  # dropout did something


def test_the_seed_comes_from_torchs_generator_and_the_rate_is_p():
    q, k, v, _ = make(2, 64, 64, 4, 4, 16, torch.float32)
    torch.manual_seed(7)
    a = kp_attention.flash_attention(q, k, v, dropout_p=0.3)
    b = kp_attention.flash_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(7)
    again = kp_attention.flash_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, again) and not torch.equal(a, b)
    keep = _keep(torch.tensor([123], device=DEVICE), 2, 4, 64, 64, 0.3)
    rate = 1 - keep.double().mean().item()
    assert abs(rate - 0.3) < 4 * (0.3 * 0.7 / keep.numel()) ** 0.5  # 4 standard deviations of 32768 draws
    none = kp_attention.flash_attention(q, k, v, dropout_p=1.0)
    assert torch.equal(none, torch.zeros_like(none))


def test_varlen_numbers_each_sequence_as_a_batch():
    """A packed batch drops what the padded one drops: sequence b draws batch b's mask."""
    q, k, v, dout = make(2, 40, 40, 2, 2, 16, torch.float32)
    seed = torch.tensor([99], device=DEVICE)
    dense = run(
        lambda *t: kp_attention.flash_attention(*t, causal=True, dropout_p=0.25, dropout_seed=seed, return_lse=True),
        (q, k, v),
        dout,
    )
    cu = torch.tensor([0, 40, 80], dtype=torch.int32, device=DEVICE)

    def packed(q, k, v):
        flat = (t.reshape(80, *t.shape[2:]) for t in (q, k, v))
        kw = dict(causal=True, dropout_p=0.25, dropout_seed=seed, return_lse=True)
        out, lse = kp_attention.flash_attention_varlen(*flat, cu, cu, 40, 40, **kw)
        return out.view(2, 40, *out.shape[1:]), lse

    with kp_core.record_launches() as rec:
        got = run(packed, (q, k, v), dout)
    assert rec.backends(attention.OP_VARLEN) == {KERNEL} and rec.backends(attention.OP_VARLEN_BWD) == {KERNEL}
    for name, a, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (dense[0], *dense[2:])):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6, msg=name)


def test_sdpa_and_flash_attn_take_dropout():
    q, k, v, _ = make(1, 33, 33, 2, 2, 16, torch.float32)
    torch.manual_seed(3)
    got = kp_attention.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.2)
    torch.manual_seed(3)
    want = kp_attention.flash_attention(q, k, v, dropout_p=0.2, dropout_seed=dropout.draw_seed(q.device))
    assert torch.equal(got.transpose(1, 2), want)
    torch.manual_seed(5)
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, 0.2, causal=True, return_attn_probs=True)
    torch.manual_seed(5)
    seed = dropout.draw_seed(q.device)
    assert torch.equal(out, kp_attention.flash_attention(q, k, v, causal=True, dropout_p=0.2, dropout_seed=seed))
    keep = _keep(seed, 1, 2, 33, 33, 0.2)
    causal = torch.ones(33, 33, dtype=torch.bool, device=DEVICE).tril()
    assert s_dmask.shape == (1, 2, 33, 33) and torch.equal(s_dmask < 0, ~keep & causal)  # dropped: negative
    # |S_dmask| is exp(s - row max): normalised, the softmax of the scores
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / 4.0
    want = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    got = s_dmask.abs().double()
    torch.testing.assert_close(got / got.sum(-1, keepdim=True), want, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs are a GPU path")
def test_a_captured_cuda_graph_draws_a_new_mask_on_each_replay():
    q, k, v, _ = make(1, 64, 64, 2, 2, 32, torch.float16)
    kp_attention.flash_attention(q, k, v, dropout_p=0.3)  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seed = dropout.draw_seed(q.device)
        out = kp_attention.flash_attention(q, k, v, dropout_p=0.3, dropout_seed=seed)
    runs = []
    for _ in range(2):
        graph.replay()
        runs.append((seed.clone(), out.clone()))
    (s1, o1), (s2, o2) = runs
    assert not torch.equal(s1, s2) and not torch.equal(o1, o2)
    for s, o in runs:  # each replay's output is the eager call's with that replay's seed
        assert torch.equal(o, kp_attention.flash_attention(q, k, v, dropout_p=0.3, dropout_seed=s))
