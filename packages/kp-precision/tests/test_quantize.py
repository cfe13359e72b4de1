"""kp-precision's package tests: API behaviour beyond the conformance spec (which checks the values)."""

import pytest
import torch

import kp_core
import kp_precision

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_reference_path_matches_the_kernels(monkeypatch):
    """KP_BACKEND=reference (PyTorch only) gives the kernels' bits, for every recipe."""
    x = torch.randn(67, 300, device=DEVICE) * torch.logspace(-6, 3, 300, device=DEVICE)
    x[5, 7] = float("nan")
    for kw in (
        dict(),
        dict(granularity="rowwise"),
        dict(granularity="blockwise", block=(32, 64), power_of_2=True),
        dict(scale=torch.tensor(0.3, device=DEVICE)),
    ):
        with kp_core.record_launches() as rec:
            a = kp_precision.quantize(x, **kw)
        assert rec.backends() == {kp_core.INTERPRET if DEVICE == "cpu" else kp_core.TRITON}
        monkeypatch.setenv("KP_BACKEND", "reference")
        with kp_core.record_launches() as rec:
            b = kp_precision.quantize(x, **kw)
            yb = kp_precision.dequantize(b, torch.float16)
        monkeypatch.delenv("KP_BACKEND")
        assert rec.backends() == {kp_core.REFERENCE}
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), kw
        torch.testing.assert_close(a.scale, b.scale, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(a.amax, b.amax, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(kp_precision.dequantize(a, torch.float16), yb, rtol=0, atol=0, equal_nan=True)


def test_float8_tensor_describes_itself():
    x = torch.randn(4, 256, device=DEVICE, dtype=torch.bfloat16)
    t = kp_precision.quantize(x, torch.float8_e5m2, granularity="blockwise")
    assert isinstance(t, tuple) and t.granularity == "blockwise" and t.block == (1, 128)
    assert t.shape == x.shape and t.dtype == torch.float8_e5m2 and t.scale.shape == (4, 2)
    assert kp_precision.quantize(x).granularity == "tensorwise" and kp_precision.quantize(x).scale.shape == ()
    assert kp_precision.quantize(x, granularity="rowwise").scale.shape == (4, 1)
    data, scale, amax, block = t  # unpacks like the tuple it is
    assert torch.equal(amax, x.float().view(4, 2, 128).abs().amax(-1))


def test_delayed_scaling_saturates_and_reports_the_amax():
    x = torch.tensor([[1.0, -1000.0, 3.0, float("inf")]], device=DEVICE)
    t = kp_precision.quantize(x, scale=torch.tensor(1.0, device=DEVICE))
    assert t.data.float().tolist() == [[1.0, -448.0, 3.0, 448.0]]
    assert t.amax.item() == float("inf") and t.scale.item() == 1.0


def test_power_of_2_scales_are_powers_of_two():
    x = torch.randn(33, 130, device=DEVICE) * 7.3
    t = kp_precision.quantize(x, granularity="rowwise", power_of_2=True)
    m, e = torch.frexp(t.scale)
    assert torch.all(m == 0.5), "a power-of-two scale has mantissa 0.5 in frexp"


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_round_trip_error_is_within_half_a_step(fp8):
    """|dequantize(quantize(x)) - x| is at most half a float8 step at the scaled magnitude (normal range)."""
    x = torch.randn(64, 512, device=DEVICE)
    t = kp_precision.quantize(x, fp8, granularity="rowwise")
    y = kp_precision.dequantize(t)
    mant = 3 if fp8 == torch.float8_e4m3fn else 2
    scaled = (x / t.scale).abs()
    step = torch.exp2(torch.floor(torch.log2(scaled.clamp(min=torch.finfo(fp8).smallest_normal))) - mant)
    assert torch.all((y - x).abs() / t.scale <= step / 2 * (1 + 1e-6))


@pytest.mark.parametrize("elem,rel", [("fp8_e4m3", 0.25), ("fp8_e5m2", 0.25), ("fp4_e2m1", 0.5)])
def test_mx_round_trip_error_is_bounded_by_the_clip(elem, rel):
    """|mx_dequantize(mx_quantize(x)) - x| per block stays below what MX's floor-based scale can clip: with amax in
    [2**k, 2**(k+1)) and X = 2**(k - emax), x / X < 2**(emax+1) saturates at the largest element (448 of 512,
    57344 of 65536, 6 of 8), an error under a quarter (fp4: half) of the amax; rounding errors are smaller."""
    x = torch.randn(8, 256, device=DEVICE) * torch.logspace(-4, 4, 256, device=DEVICE)
    y = kp_precision.mx_dequantize(kp_precision.mx_quantize(x, elem))
    err = (y - x).abs().view(8, -1, 32).amax(-1)
    amax = x.abs().view(8, -1, 32).amax(-1)
    assert bool((err <= rel * amax).all()), f"{elem}: worst relative block error {(err / amax).max().item():.3g}"
