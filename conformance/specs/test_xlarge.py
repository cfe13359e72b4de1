"""Past 2^31 elements: int32 offsets overflow there, so every row, elementwise, quantize and 2:4 kernel runs on an
input of more than 2^31 elements in the xlarge tier (KP_TIER=xlarge, a GPU with >= 80 GB), and attention and
decode on 128k keys. Each either gives, in the rows past 2^31, exactly what it gives for those rows alone (the
same kernel on a small input, so nothing but the offsets differs), or raises a TypeError/ValueError before
launching. Smaller tiers run the same tests on small inputs: they check the tests, not the offsets."""

from __future__ import annotations

import pytest
import torch

import kp_attention
import kp_conformance as kc
import kp_core
import kp_norms
import kp_precision
import kp_sparsity
from kp_conformance.references import attention64, attention_lowp

DEVICE = kc.device()
TIER = kc.current()
XLARGE = TIER.name == "xlarge"
COLS = 4096 if XLARGE else 256  # small tiers check the tests themselves, quickly
# rows so that rows * COLS passes 2^31 by a few rows in the xlarge tier
ROWS = (2**31 // COLS + 64) if XLARGE else 64
KEYS = 131072 if XLARGE else 512

kc.declare(
    kc.Spec(
        name="xlarge",
        package="kp-conformance",
        ops=(),
        reference="the same kernel on the same rows alone (offsets are all that differ); attention: float64",
        dtypes=(torch.float16, torch.bfloat16),
        properties=("past_2_31", "long_keys"),
    )
)


def _need_memory():
    if XLARGE and (DEVICE.type != "cuda" or torch.cuda.get_device_properties(DEVICE).total_memory < 80 * 2**30):
        pytest.skip("not covered: the xlarge tier needs a GPU with >= 80 GB")


def _rows(n: int, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn((n, COLS), generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


def _tail(t):
    """The last 32 rows (past 2^31 elements in the xlarge tier), and 32 from the start and the middle: blocks of 32,
    which 2:4 packing needs."""
    mid = t.shape[0] // 64 * 32
    return torch.cat([t[:32], t[mid : mid + 32], t[-32:]])


def _bits(x):
    return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in (x if isinstance(x, (list, tuple)) else [x])]


# name -> (inputs from (rows, dtype), the op's call on them, its result as tensors whose rows follow the input's)
ROW_OPS = {
    "rms_norm": (1, lambda x: kp_norms.rms_norm(x, (COLS,), torch.ones(COLS, device=DEVICE, dtype=x.dtype))),
    "layer_norm": (1, lambda x: kp_norms.layer_norm(x, (COLS,))),
    "add_rms_norm": (2, lambda x, r: kp_norms.add_rms_norm(x, r)),
    "swiglu": (2, lambda g, u: kp_norms.swiglu(g, u)),
    "geglu_packed": (1, lambda x: kp_norms.geglu_packed(x)),
    "quantize_rowwise": (1, lambda x: (lambda q: (q.data, q.scale))(kp_precision.quantize(x, granularity="rowwise"))),
    "fake_quantize": (1, lambda x: kp_precision.fake_quantize(x, "int4", group_size=32)),
    "mx_quantize": (1, lambda x: (lambda q: (q.data, q.scale))(kp_precision.mx_quantize(x))),
    "prune_2_4": (1, lambda x: kp_sparsity.prune_2_4(x)),
    # the metadata's layout is CUTLASS's permutation across rows: compared through torch's own unpacking
    "pack_2_4": (1, lambda x: kp_sparsity.unpack_2_4(*kp_sparsity.pack_2_4(x))),
}


@pytest.mark.conformance(kernel="xlarge", prop="past_2_31")
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=kc.dtype_id)
@pytest.mark.parametrize("name", list(ROW_OPS))
def test_rows_past_2_31(name, dtype):
    """A row op on (ROWS, 4096): its last rows equal the same rows computed alone, bit for bit."""
    _need_memory()
    kc.skip_if_not_covered(dtype)
    count, fn = ROW_OPS[name]
    inputs = [_rows(ROWS, dtype, seed) for seed in range(count)]
    with kp_core.record_launches() as rec:
        try:
            whole = fn(*inputs)
        except (TypeError, ValueError) as e:  # a clear refusal before launch is allowed
            assert not rec.launches, f"{name}: raised {e!r} after launching {rec.launches}"
            pytest.skip(f"not covered: {name} refuses {ROWS} x {COLS} before launch: {e}")
    assert kc.kernel_backend() in rec.backends(), f"{name}: no kernel launched ({rec.backends()})"
    alone = fn(*(_tail(t) for t in inputs))
    for i, (a, b) in enumerate(zip(_bits(whole), _bits(alone))):
        a = _tail(a) if a.dim() and a.shape[0] == ROWS else a
        assert torch.equal(a, b), f"{name} output {i}: rows past 2^31 differ from the same rows alone"


@pytest.mark.conformance(kernel="xlarge", prop="past_2_31")
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=kc.dtype_id)
def test_quantize_tensorwise_past_2_31(dtype):
    """Tensorwise: the amax covers all rows (those past 2^31 included: the largest value is put in the last row),
    and a cast with a given scale gives, in the last rows, what it gives for those rows alone."""
    _need_memory()
    kc.skip_if_not_covered(dtype)
    x = _rows(ROWS, dtype, 0)
    x[-1, -1] = 1000.0
    q = kp_precision.quantize(x)
    assert q.amax.item() == 1000.0, f"amax {q.amax.item()}: the last row's largest value was not seen"
    given = kp_precision.quantize(x, scale=q.scale)
    alone = kp_precision.quantize(_tail(x), scale=q.scale)
    assert torch.equal(_tail(given.data).view(torch.uint8), alone.data.view(torch.uint8))


@pytest.mark.conformance(kernel="xlarge", prop="long_keys")
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=kc.dtype_id)
def test_attention_long_keys(dtype):
    """flash_attention with KEYS keys (128k in the xlarge tier): the last queries by the 2x rule."""
    _need_memory()
    kc.skip_if_not_covered(dtype, uses_dot=True)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    queries = 256 if XLARGE else 32
    q, k, v = (torch.randn((1, n, 4, 128), generator=g, device=DEVICE).to(dtype) for n in (queries, KEYS, KEYS))
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention(q, k, v, causal=True)
    kc.assert_kernel_ran(rec, "kp::flash_attention")
    # causal, bottom-right aligned: the last 16 queries see (almost) every key
    tail = q[:, -16:]
    ref, _ = attention64(tail, k, v, causal=True)
    kc.check_close("attention, last queries", out[:, -16:], ref, attention_lowp(tail, k, v, causal=True), dtype)


@pytest.mark.conformance(kernel="xlarge", prop="long_keys")
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=kc.dtype_id)
def test_decode_long_keys(dtype):
    """flash_attention_with_kvcache over a KEYS-long cache (128k in the xlarge tier), by the 2x rule."""
    _need_memory()
    kc.skip_if_not_covered(dtype, uses_dot=True)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    q = torch.randn((2, 1, 8, 128), generator=g, device=DEVICE).to(dtype)
    k_cache, v_cache = (torch.randn((2, KEYS, 2, 128), generator=g, device=DEVICE).to(dtype) for _ in range(2))
    lens = torch.tensor([KEYS, KEYS - KEYS // 7], dtype=torch.int32, device=DEVICE)
    with kp_core.record_launches() as rec:
        out = kp_attention.flash_attention_with_kvcache(q, k_cache, v_cache, lens)
    kc.assert_kernel_ran(rec, "kp::flash_attention_with_kvcache")
    for b in range(2):
        n = int(lens[b])
        args = (q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n])
        ref, _ = attention64(*args)
        kc.check_close(f"decode, sequence {b}", out[b : b + 1], ref, attention_lowp(*args), dtype)
