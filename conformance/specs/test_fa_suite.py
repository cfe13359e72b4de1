"""The fa-suite plugin and its `flash_attn` shim (kp_conformance.fa_suite; `nox -s fa-suite` runs FlashAttention's
own tests with them on a GPU): the shim's padding and rotary helpers against plain formulas in float64, and a
pytest run of a small FlashAttention-style test file through the plugin: `flash_attn` resolves to
kp_attention.flash_attn, the sample has the asked size and the same cases for the same seed, private-API tests
are left out, and the summary counts cases per test function."""

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import kp_conformance as kc
from kp_conformance import fa_suite

kc.declare(
    kc.Spec(
        name="fa_suite",
        package="kp-conformance",
        ops=(),
        reference="padding by index arithmetic and rotation by complex multiplication in float64; the plugin's "
        "counts against the cases a file defines",
        dtypes=(),
        properties=("shim_helpers", "plugin_run"),
    )
)


def _shim():
    sys.path.insert(0, str(fa_suite.SHIM))
    try:
        from flash_attn import bert_padding
        from flash_attn.layers import rotary
    finally:
        sys.path.remove(str(fa_suite.SHIM))
    return bert_padding, rotary


@pytest.mark.conformance(kernel="fa_suite", prop="shim_helpers")
def test_shim_padding_and_rotary_helpers():
    bert_padding, rotary = _shim()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 2, 8, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    packed, indices, cu, longest, used = bert_padding.unpad_input(x, mask)
    assert cu.tolist() == [0, 3, 8, 9] and longest == 5 and used.tolist() == [3, 5, 1]
    assert torch.equal(packed, x[mask]) and torch.equal(indices, torch.nonzero(mask.flatten()).flatten())
    assert torch.equal(bert_padding.pad_input(packed, indices, 3, 5), x * mask[..., None, None])
    # rotary: row t + offset of the tables, the first 2 * half dims rotated as complex numbers
    cos_sin = torch.rand(12, 3, generator=g, dtype=torch.float64) * 6
    cos, sin = cos_sin.cos(), cos_sin.sin()
    offsets = torch.tensor([0, 4, 7])
    for interleaved in (False, True):
        got = rotary.apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
        rows = torch.arange(5)[None, :] + offsets[:, None]
        turn = torch.polar(torch.ones_like(cos_sin), cos_sin)[rows][:, :, None]  # (3, 5, 1, 3)
        part = x[..., :6]
        pairs = part.unflatten(-1, (3, 2)) if interleaved else torch.stack((part[..., :3], part[..., 3:]), -1)
        turned = torch.view_as_real(torch.view_as_complex(pairs.contiguous()) * turn)
        want = turned.flatten(-2) if interleaved else torch.cat((turned[..., 0], turned[..., 1]), -1)
        torch.testing.assert_close(got, torch.cat((want, x[..., 6:]), -1), rtol=1e-6, atol=1e-6)


FAKE_SUITE = """
    import pytest
    import torch
    import kp_attention.flash_attn
    from flash_attn import flash_attn_func
    from flash_attn.flash_attn_interface import _get_block_size_n, USE_TRITON_ROCM

    @pytest.mark.parametrize("i", range(10))
    def test_resolves_to_kp(i):
        kp_function = getattr(flash_attn_func, "__wrapped__", flash_attn_func)  # torch:*: without lse
        assert kp_function is kp_attention.flash_attn.flash_attn_func and not USE_TRITON_ROCM

    @pytest.mark.parametrize("i", range(6))
    def test_skips(i):
        pytest.skip("not here")

    def test_flash_attn_generator_arg_must_be_none():
        raise AssertionError("a private-API test must be left out")

    def test_a_call():
        q = torch.randn(1, 8, 2, 16)
        assert flash_attn_func(q, q, q, causal=True).shape == q.shape
"""


def _run(tmp_path, *args):
    (tmp_path / "test_flash_attn.py").write_text(textwrap.dedent(FAKE_SUITE))
    report = tmp_path / "counts.json"
    cmd = [sys.executable, "-m", "pytest", "-p", "kp_conformance.fa_suite", "-p", "no:cacheprovider", "-q"]
    cmd += ["-p", "no:kp_conformance.plugin", "--rootdir", str(tmp_path), "--fa-report", str(report), *args]
    cmd.append(str(tmp_path / "test_flash_attn.py"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KP_")}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return done, json.loads(report.read_text()) if report.exists() else None


@pytest.mark.conformance(kernel="fa_suite", prop="plugin_run")
def test_plugin_samples_resolves_and_counts(tmp_path):
    done, counts = _run(tmp_path, "--fa-sample", "0")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    skips = {"skipped": 6, "skip reasons": {"not here": 6}}  # the suite's own skips, with their message
    assert counts == {"test_resolves_to_kp": {"passed": 10}, "test_skips": skips, "test_a_call": {"passed": 1}}
    assert "left out: test_flash_attn_generator_arg_must_be_none" in done.stdout
    done, in_workers = _run(tmp_path, "--fa-sample", "0", "-n", "2")  # under xdist the controller counts alike
    assert done.returncode == 0 and in_workers == counts, done.stdout[-3000:] + done.stderr[-3000:]
    done, counts = _run(tmp_path, "--fa-sample", "5", "--fa-seed", "3", "-rA")
    assert sum(sum(c.values()) for c in counts.values()) == 5
    # the sample: 5 of the 16 public cases, in collection order, by the seed's draw
    public = [f"test_resolves_to_kp[{i}]" for i in range(10)] + [f"test_skips[{i}]" for i in range(6)]
    public.append("test_a_call")
    chosen = sorted(random.Random(3).sample(range(len(public)), 5))
    ran = [line for line in done.stdout.splitlines() if line.startswith("PASSED")]
    want = [public[i] for i in chosen if not public[i].startswith("test_skips")]
    assert sorted(line.split("::")[-1] for line in ran) == sorted(want)


@pytest.mark.conformance(kernel="fa_suite", prop="backend")
def test_the_suite_checks_the_backend_asked_for(tmp_path):
    """--fa-backend pins kp_attention's backend; a case it cannot take is skipped with the reason (here
    FlashAttention-4 off a GPU), the others run; a name that is no backend stops the run."""
    done, counts = _run(tmp_path, "--fa-sample", "0", "--fa-backend", "fa4", "-rs")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "backend fa4" in done.stdout
    if not torch.cuda.is_available():
        why = "float32 (FlashAttention-4 takes float16 and bfloat16)"  # the call's first refusal
        assert counts["test_a_call"] == {"skipped": 1, "skip reasons": {why: 1}}, counts
        assert "backend='fa4' cannot take this call" in done.stdout
        assert f"skipped test_a_call: 1 x {why}" in done.stdout
    done, counts = _run(tmp_path, "--fa-sample", "0", "--fa-backend", "torch", "-rs")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert counts["test_resolves_to_kp"] == {"passed": 10}  # the shim's functions wrapped, kp's underneath
    done, _ = _run(tmp_path, "--fa-backend", "cudnn")
    assert done.returncode != 0 and "backend must be one of" in done.stdout + done.stderr


@pytest.mark.conformance(kernel="fa_suite", prop="backend")
def test_torch_backends_answer_attention_probabilities_with_none():
    """torch's kernels return no lse: return_attn_probs=True gives (out, None, None), so that a test reading lse
    fails rather than reads another backend's."""
    from kp_conformance import fa_suite

    calls = []
    fn = fa_suite._without_lse(lambda *a, **k: calls.append((a, k)) or "out")
    assert fn(1, dropout_p=0.0, return_attn_probs=True) == ("out", None, None)
    assert fn(2) == "out" and calls == [((1,), {"dropout_p": 0.0}), ((2,), {})]
