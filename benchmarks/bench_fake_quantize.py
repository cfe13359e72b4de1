"""Fake quantisation for QAT (kp_precision.fake_quantize): kp vs the anchors in one run.

    python benchmarks/bench_fake_quantize.py          # writes results/<device>/fake_quantize.*
    python benchmarks/bench_fake_quantize.py --smoke  # CPU, Triton's interpreter: each provider once on a tiny
                                                      # input, kp checked; nothing timed or written

Formats ("mode"), as prepare_qat uses them: int4 in groups of 32 (its weight default), int8 per row, fp8 e4m3 per
row; bf16 in and out, at Llama weight and activation shapes. Forward only: the gradient is straight-through (the
upstream gradient as it is), so the backward launches nothing. Anchors: the fake quant written in plain PyTorch,
eager and under torch.compile; PyTorch's own torch.fake_quantize_per_channel_affine (rows, or groups as rows of a
view), its scales from the amax in the same call, eager and compiled; torchao's QAT fake quantizers
(IntxFakeQuantizer, Float8FakeQuantizer) under torch.compile. GB/s counts the bytes a fake quant must move: read
the input and write the output, 4*M*N (scales are a rounding error).
"""

from __future__ import annotations

import itertools

import harness
import torch

import kp_precision

DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (16384, 4096)]
MODES = {"int4 group 32": ("int4", 7, 32), "int8 row": ("int8", 127, None), "fp8 row": ("fp8", None, None)}
torch._dynamo.config.cache_size_limit = 256


def int_in_torch(x, qmax, group):
    """The integer fake quant in plain PyTorch: per group (None: per row) scale = max(amax, 1e-12) / qmax, divided
    by a tensor (CUDA turns a division by a Python number into a multiplication by its reciprocal, not IEEE),
    codes round_half_even(x / scale) clamped to [-qmax - 1, qmax], code * scale in float32 rounded once to bf16."""
    xg = x.float().unflatten(-1, (-1, group or x.shape[-1]))
    scale = xg.abs().amax(-1, keepdim=True).clamp(min=1e-12) / torch.full((), float(qmax), device=x.device)
    return (torch.round(xg / scale).clamp(-qmax - 1, qmax) * scale).flatten(-2).to(x.dtype)


def fp8_in_torch(x):
    """fp8 e4m3 per row in plain PyTorch, the rowwise float8 recipe: q = 448 / max(amax, 1e-12), the value
    float(cast(clamp(x * q))) * (1 / q), rounded to bf16."""
    xf = x.float()
    q = FP8_MAX / xf.abs().amax(-1, keepdim=True).clamp(min=1e-12)
    return ((xf * q).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * (1 / q)).to(x.dtype)


def torch_per_channel(x, qmax, group):
    """torch.fake_quantize_per_channel_affine over rows (groups: rows of a view), scales from the amax."""
    xg = x.reshape(-1, group or x.shape[-1])
    scale = xg.abs().amax(-1).float().clamp(min=1e-12) / qmax
    zero = torch.zeros(scale.shape, dtype=torch.int32, device=x.device)
    return torch.fake_quantize_per_channel_affine(xg, scale, zero, 0, -qmax - 1, qmax).view(x.shape)


def providers(mode: str, x: torch.Tensor, compiled: bool = True) -> dict:
    """{name: callable} for a format on x; torchao's only where it imports (else it says why)."""
    fmt, qmax, group = MODES[mode]
    maybe = (lambda f: torch.compile(f, dynamic=False)) if compiled else (lambda f: f)
    tag = " (compile)" if compiled else ""
    args = (x,) if fmt == "fp8" else (x, qmax, group)
    formula = fp8_in_torch if fmt == "fp8" else int_in_torch
    formula_c = maybe(formula)
    out = {
        "kp": lambda: kp_precision.fake_quantize(x, fmt, group_size=group),
        "eager": lambda: formula(*args),
    }
    if compiled:
        out["compile"] = lambda: formula_c(*args)
    if fmt != "fp8":
        per_channel = maybe(torch_per_channel)
        out["torch.fake_quantize_per_channel_affine"] = lambda: torch_per_channel(x, qmax, group)
        if compiled:
            out["torch.fake_quantize_per_channel_affine (compile)"] = lambda: per_channel(x, qmax, group)
    try:
        from torchao.quantization import qat
        from torchao.quantization.granularity import PerRow

        if fmt == "fp8":
            quantizer = qat.Float8FakeQuantizer(qat.Float8FakeQuantizeConfig(FP8, PerRow()))
        else:
            scales = dict(group_size=group) if group else dict(granularity="per_channel")
            config = qat.IntxFakeQuantizeConfig(getattr(torch, fmt), is_symmetric=True, **scales)
            quantizer = qat.IntxFakeQuantizer(config)
        quantizer_c = maybe(quantizer)
        out["torchao QAT" + tag] = lambda: quantizer_c(x)
    except Exception as e:  # absent or incompatible: reported, not hidden
        print(f"torchao anchor for {mode} unavailable: {type(e).__name__}: {str(e)[:200]}")
    return out


def check_correct(x, mode) -> None:
    """Before timing: kp equals the plain-PyTorch fake quant bit for bit (int4, int8); fp8 within one float8 step
    (kp's scale is 1 / q rounded once, the formula's too, by another path)."""
    fmt, qmax, group = MODES[mode]
    y = kp_precision.fake_quantize(x, fmt, group_size=group)
    if fmt != "fp8":
        assert torch.equal(y, int_in_torch(x, qmax, group)), f"kp fake_quantize {mode} differs from the formula"
        return
    ref = fp8_in_torch(x).float()
    assert bool(((y.float() - ref).abs() <= ref.abs() * 2.0**-3 + 2.0**-9).all()), f"kp fake_quantize {mode}"


def smoke() -> None:
    """Every provider once on a tiny input on the CPU (kp under Triton's interpreter), kp checked; no torch.compile
    (its CPU build would take minutes here). fp16, not bf16: the interpreter truncates float32 to bf16 on stores
    (kp_conformance.env.interpreter_truncates_bf16), which the GPU rounds to nearest."""
    x = torch.randn(24, 96, dtype=torch.float16)
    for mode in MODES:
        check_correct(x, mode)
        harness.run_each(mode, providers(mode, x, compiled=False))


def main() -> None:
    copy = harness.start(__doc__, smoke)
    if copy is None:
        return
    rows = []
    for (m, n), mode in harness.progress(list(itertools.product(SHAPES, MODES)), "fake_quantize"):
        x = torch.randn(m, n, device="cuda", dtype=DTYPE)
        check_correct(x, mode)
        with torch.no_grad():
            for name, fn in providers(mode, x).items():
                row = dict(M=m, N=n, mode=mode, provider=name)
                rows.append(harness.timed(row, fn, nbytes=4 * m * n, copy_gbps=copy))
    meta = {"kernel": "fake_quantize", "op": "fake_quantize", "dtype": "bfloat16", "copy_gbps": copy}
    meta.update(harness.versions())
    note = "; bytes 4*M*N (read and write bf16), forward (the gradient is straight-through)"
    md = harness.render(harness.header("Fake quantisation (QAT)", meta, note), meta, rows)
    title = f"fake quantisation, bf16, {meta['device']}"
    plot = lambda p: harness.plot_bars(rows, meta, p, SHAPES, list(MODES), "gbps_graph", "GB/s, CUDA graph", title)  # noqa: E731
    out = harness.write_results("fake_quantize", meta, rows, md, plot)
    print(md)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
