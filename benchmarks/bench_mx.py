"""MX formats (kp_precision.mx_quantize, mx_dequantize, mx_matmul): kp vs the anchors in one run.

    python benchmarks/bench_mx.py            # writes results/<device>/mx.*
    python benchmarks/bench_mx.py --smoke    # CPU, Triton's interpreter: each provider once on a tiny input, kp
                                             # checked against the plain-PyTorch cast; nothing timed or written

Casts ("mode"): bf16 to MXFP8 (e4m3, e5m2) and MXFP4 (e2m1), and back: blocks of 32 along the last dim, one E8M0
scale each (OCP MX v1.0). Anchors: the specification's cast in plain PyTorch (fp8 elements), eager and under
torch.compile; torchao's `to_mx` (torchao.prototype.mx_formats, FLOOR scales: the specification's rule, as kp's)
under torch.compile, and its Triton cast `triton_to_mxfp8_dim0` (e4m3, floor). GB/s counts the bytes a cast must
move: the bf16 side 2*M*N, the elements M*N (fp8) or M*N/2 (fp4), the scales M*N/32.

Matmul ("mode" = a x b): a (M, K) MXFP8 e4m3 times b (N, K) MXFP8 e4m3 or MXFP4 e2m1, bf16 out. Hopper has no MX
tensor cores, so kp's kernel emulates them (elements decoded in registers, TF32 tensor cores); beside it, kp's two
passes (mx_dequantize both operands, then torch.mm) and bf16 torch.mm (cuBLAS), the dense baseline.
TFLOP/s = 2*M*N*K / time; CUDA-graph and plain-launch timing as every benchmark.
"""

from __future__ import annotations

import itertools

import harness
import torch

import kp_precision

DTYPE = torch.bfloat16
SHAPES = [(16384, 4096), (8192, 8192), (16384, 14336)]
MM_SHAPES = [(8192, 8192, 8192), (16384, 4096, 14336)]
# element format -> (torch's element dtype, largest normal exponent, largest value): OCP MX v1.0, tables 1-2
ELEMENTS = {
    "fp8_e4m3": (torch.float8_e4m3fn, 8, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 15, 57344.0),
    "fp4_e2m1": (torch.float4_e2m1fn_x2, 2, 6.0),
}
MODES = [f"quantize {e}" for e in ELEMENTS] + ["dequantize fp8_e4m3", "dequantize fp4_e2m1"]
MM_MODES = ("fp8_e4m3 x fp8_e4m3", "fp8_e4m3 x fp4_e2m1")
torch._dynamo.config.cache_size_limit = 256


def mx_in_torch(x, elem):
    """(elements, E8M0 scale bytes) by the specification's conversion (section 6.3) in plain PyTorch: per block
    X = 2**(floor(log2 amax) - emax) (frexp: amax = m * 2**e, 0.5 <= m < 1), elements clamp(x / X) cast to the fp8
    dtype; for fp4, which torch cannot cast to, the clamped values before rounding. A zero block takes the smallest
    scale, a NaN / inf amax the NaN scale 255."""
    dtype, emax, vmax = ELEMENTS[elem]
    blocks = x.float().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True)
    exp = torch.where(amax == 0, -127, torch.frexp(amax).exponent - 1 - emax).clamp(-127, 127)
    values = (blocks * torch.ldexp(torch.ones_like(amax), -exp)).clamp(-vmax, vmax).flatten(-2)
    scale = torch.where(amax.isfinite(), exp + 127, 255).squeeze(-1).to(torch.uint8)
    return (values if elem == "fp4_e2m1" else values.to(dtype)), scale


def dequantize_in_torch(data, scale):
    """fp8 elements times 2**(scale - 127) per block of 32 (NaN where the scale byte is 255), rounded to bf16."""
    x = torch.where(scale == 255, float("nan"), torch.exp2(scale.float() - 127)).unsqueeze(-1)
    return (data.float().unflatten(-1, (-1, 32)) * x).flatten(-2).to(DTYPE)


def providers(mode: str, x: torch.Tensor, compiled: bool = True) -> dict:
    """{name: callable} for a cast mode on x: kp, the plain-PyTorch formula (fp8), torchao where it imports."""
    op, elem = mode.split()
    if op == "quantize":
        out = {"kp": lambda: kp_precision.mx_quantize(x, elem)}
        formula, args = mx_in_torch, (x, elem)
    else:
        t = kp_precision.mx_quantize(x, elem)
        out = {"kp": lambda: kp_precision.mx_dequantize(t, DTYPE)}
        formula, args = dequantize_in_torch, (t.data, t.scale)
    if elem != "fp4_e2m1":  # the formula's fp4 is not the whole cast (no rounding to the grid)
        out["eager"] = lambda: formula(*args)
        if compiled:
            formula_c = torch.compile(formula, dynamic=False)
            out["compile"] = lambda: formula_c(*args)
    try:
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

        if op == "quantize":
            fn, ao_args = to_mx, (x, ELEMENTS[elem][0], 32, ScaleCalculationMode.FLOOR)
        else:  # kp's layout is torchao's: fp4 two codes a byte, the first in the low nibble; scales E8M0 bytes
            fn, ao_args = to_dtype, (t.data, t.scale.view(torch.float8_e8m0fnu), ELEMENTS[elem][0], 32, DTYPE)
        fn_c = torch.compile(fn, dynamic=False) if compiled else fn
        out[f"torchao {fn.__name__}" + (" (compile)" if compiled else "")] = lambda: fn_c(*ao_args)
        if mode == "quantize fp8_e4m3" and x.is_cuda:
            from torchao.prototype.mx_formats.kernels import triton_to_mxfp8_dim0

            out["torchao triton"] = lambda: triton_to_mxfp8_dim0(x, 32, "floor")
    except Exception as e:  # absent or incompatible: reported, not hidden
        print(f"torchao anchor for {mode} unavailable: {type(e).__name__}: {str(e)[:200]}")
    return out


def mm_providers(mode: str, m: int, k: int, n: int, device) -> dict:
    elem_a, elem_b = mode.split(" x ")
    x, w = (torch.randn(rows, k, device=device, dtype=DTYPE) for rows in (m, n))
    a, b = kp_precision.mx_quantize(x, elem_a), kp_precision.mx_quantize(w, elem_b)
    return {
        "kp": lambda: kp_precision.mx_matmul(a, b),
        "kp dequantize + torch.mm": lambda: (
            kp_precision.mx_dequantize(a, DTYPE) @ kp_precision.mx_dequantize(b, DTYPE).t()
        ),
        "bf16 torch.mm": lambda: x @ w.t(),
    }


def check_correct(x, mode) -> None:
    """Before timing: kp's scales equal the plain-PyTorch cast's, and so do its fp8 elements, bit for bit; fp4
    elements dequantise to within half a step of the fp4 grid (at most 1, between 4 and 6) of the clamped value."""
    elem = mode.split()[1]
    t = kp_precision.mx_quantize(x, elem)
    values, scale = mx_in_torch(x, elem)
    assert torch.equal(t.scale, scale), f"kp mx_quantize {elem}: scales differ from the plain-PyTorch cast"
    if elem != "fp4_e2m1":
        assert torch.equal(t.data.view(torch.uint8), values.view(torch.uint8)), f"kp mx_quantize {elem}: elements"
        return
    step = torch.exp2(t.scale.float() - 127).repeat_interleave(32, -1)
    err = (kp_precision.mx_dequantize(t, torch.float32) / step - values).abs()
    assert bool((err <= 1).all()), "kp mx_quantize fp4_e2m1: an element is not the fp4 value nearest the input"


def check_matmul(fns: dict, mode: str) -> None:
    """Before timing: kp's matmul within 1 % (relative Frobenius) of torch.mm of the dequantised operands (exact in
    bf16: at most 3 mantissa bits times a power of two)."""
    ours, ref = fns["kp"]().float(), fns["kp dequantize + torch.mm"]().float()
    rel = ((ours - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"kp mx_matmul {mode} differs from the dequantised matmul: relative error {rel:.3g}"


def smoke() -> None:
    """Every provider once on tiny inputs on the CPU (kp under Triton's interpreter), kp checked; no torch.compile
    (its CPU build would take minutes here)."""
    x = torch.randn(48, 96, dtype=DTYPE)
    x[0, :32] = 0  # a zero block
    for mode in MODES:
        if mode.startswith("quantize"):
            check_correct(x, mode)
        harness.run_each(mode, providers(mode, x, compiled=False))
    for mode in MM_MODES:
        fns = mm_providers(mode, 32, 64, 48, "cpu")
        check_matmul(fns, mode)
        harness.run_each(mode, fns)


def main() -> None:
    copy = harness.start(__doc__, smoke)
    if copy is None:
        return
    rows, mm_rows = [], []
    for (m, n), mode in harness.progress(list(itertools.product(SHAPES, MODES)), "mx casts"):
        x = torch.randn(m, n, device="cuda", dtype=DTYPE)
        if mode.startswith("quantize"):
            check_correct(x, mode)
        elem_bytes = 0.5 if mode.endswith("fp4_e2m1") else 1
        nbytes = int(m * n * (2 + elem_bytes + 1 / 32))
        with torch.no_grad():
            for name, fn in providers(mode, x).items():
                rows.append(harness.timed(dict(M=m, N=n, mode=mode, provider=name), fn, nbytes=nbytes, copy_gbps=copy))
    for (m, k, n), mode in harness.progress(list(itertools.product(MM_SHAPES, MM_MODES)), "mx matmul"):
        fns = mm_providers(mode, m, k, n, "cuda")
        check_matmul(fns, mode)
        for name, fn in fns.items():
            mm_rows.append(harness.timed(dict(M=m, K=k, N=n, mode=mode, provider=name), fn, flops=2 * m * n * k))
    meta = {"kernel": "mx", "op": "mx_quantize, mx_dequantize, mx_matmul", "dtype": "bfloat16", "copy_gbps": copy}
    meta.update(harness.versions())
    note = "; bytes: the bf16 side 2*M*N + elements (M*N fp8, M*N/2 fp4) + scales M*N/32"
    md = harness.render(harness.header("MX casts (OCP Microscaling v1.0)", meta, note), meta, rows)
    mm_note = "Cells: TFLOP/s (2*M*N*K / time); ratio: kp / bf16 torch.mm (Hopper: kp emulates MX on TF32 cores)."
    md += "\n" + harness.render_tflops("MX matmul, bf16 out", meta, mm_rows, mm_note, _ratio)
    title = f"MX casts, bf16 <-> MX, {meta['device']}"
    plot = lambda p: harness.plot_bars(rows, meta, p, SHAPES, MODES, "gbps_graph", "GB/s, CUDA graph", title)  # noqa: E731
    out = harness.write_results("mx", meta, rows + mm_rows, md, plot)
    print(md)
    print(f"wrote {out}")


def _ratio(by: dict) -> str:
    return f"{by['kp'] / by['bf16 torch.mm']:.2f}x" if "kp" in by and "bf16 torch.mm" in by else "-"


if __name__ == "__main__":
    main()
