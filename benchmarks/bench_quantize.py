"""Float8 quantisation (kp_precision.quantize): kp vs the anchors in one run.

    python benchmarks/bench_quantize.py          # writes results/<device>/quantize.*
    python benchmarks/bench_quantize.py --tune   # sweep kp's tile settings (kp_core.pin) per recipe

Recipes ("mode" column): tensorwise (dynamic: an amax pass, then the cast), delayed (tensorwise with a given
scale: one pass, the amax folded in), rowwise, blockwise 1x128 (activations) and 128x128 (weights); bf16 input,
float8_e4m3fn output. Anchors: the recipe written in PyTorch, eager and under torch.compile; torchao's
`hp_tensor_to_float8_dynamic` under torch.compile (tensorwise, rowwise: how torchao's float8 training casts);
torchao's Triton blockwise kernels (1x128 activations, 128x128 weights). GB/s counts the bytes a cast must
move: read the input once and write the float8 data, 3*M*N bytes (scales are a rounding error). A dynamic
tensorwise cast must read the input twice (the amax comes before any value can be cast), so it moves 5*M*N
bytes and its GB/s by this count is at most 60 % of copy bandwidth for every provider alike.
"""

from __future__ import annotations

import argparse
import itertools

import harness
import torch

import kp_core
import kp_precision

DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
FMAX = torch.finfo(FP8).max
SHAPES = [(16384, 4096), (8192, 8192), (16384, 14336), (4096, 16384)]
RECIPES = {
    "tensorwise": dict(granularity="tensorwise"),
    "delayed": dict(granularity="tensorwise"),
    "rowwise": dict(granularity="rowwise"),
    "block 1x128": dict(granularity="blockwise", block=(1, 128)),
    "block 128x128": dict(granularity="blockwise", block=(128, 128)),
}
torch._dynamo.config.cache_size_limit = 256


def recipe_in_torch(x, mode, given=None):
    """The recipe in plain PyTorch (what a user writes, and what torch.compile fuses)."""
    xf = x.float()
    if mode == "delayed":  # the amax still has to be taken, for the history the next scale comes from
        q = 1.0 / given
        return (xf * q).clamp(-FMAX, FMAX).to(FP8), xf.abs().amax()
    elif mode == "tensorwise":
        q = FMAX / xf.abs().amax().clamp(min=1e-12)
    elif mode == "rowwise":
        q = FMAX / xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    else:
        bm, bk = (1, 128) if mode == "block 1x128" else (128, 128)
        m, k = xf.shape
        blocks = xf.view(m // bm, bm, k // bk, bk)
        q = FMAX / blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12)
        return (blocks * q).clamp(-FMAX, FMAX).to(FP8).view(m, k), 1.0 / q
    return (xf * q).clamp(-FMAX, FMAX).to(FP8), 1.0 / q


def providers(mode: str) -> dict:
    given = torch.tensor(0.01, device="cuda")
    kw = RECIPES[mode]
    out = {
        "kp": lambda x: kp_precision.quantize(x, FP8, scale=given if mode == "delayed" else None, **kw),
        "eager": lambda x: recipe_in_torch(x, mode, given),
        "compile": torch.compile(lambda x: recipe_in_torch(x, mode, given), dynamic=False),
    }
    try:
        if mode in ("tensorwise", "rowwise"):
            from torchao.float8.config import ScalingGranularity
            from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
            from torchao.float8.float8_training_tensor import LinearMMConfig

            gran = ScalingGranularity.TENSORWISE if mode == "tensorwise" else ScalingGranularity.AXISWISE
            dim = None if mode == "tensorwise" else -1
            cfg = LinearMMConfig()
            out["torchao (compile)"] = torch.compile(
                lambda x: hp_tensor_to_float8_dynamic(x, FP8, cfg, scaling_granularity=gran, axiswise_dim=dim),
                dynamic=False,
            )
        elif mode == "block 1x128":
            from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_act_quant_lhs

            out["torchao triton"] = lambda x: triton_fp8_blockwise_act_quant_lhs(x, 128)
        elif mode == "block 128x128":
            from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_weight_quant_rhs

            out["torchao triton"] = lambda x: triton_fp8_blockwise_weight_quant_rhs(x, 128)
    except Exception as e:  # absent or incompatible: reported, not hidden
        print(f"torchao anchor for {mode} unavailable: {type(e).__name__}: {e}")
    return out


def check_correct(x, mode) -> None:
    """Before timing: kp's float8 data equals the PyTorch recipe's bit for bit (tensorwise, rowwise, delayed);
    blockwise within one float8 step (the eager recipe divides 1 / q with a Python number, a different
    rounding of q by at most an ulp)."""
    given = torch.tensor(0.01, device="cuda")
    t = kp_precision.quantize(x, FP8, scale=given if mode == "delayed" else None, **RECIPES[mode])
    ref, _ = recipe_in_torch(x, mode, given)
    diff = (t.data.float() - ref.float()).abs()
    step = ref.float().abs() * 2.0**-3 + 2.0**-9
    assert bool((diff <= step).all()), f"kp quantize {mode} differs from the recipe by more than a float8 step"


TUNED = {
    "tensorwise": ("_amax", "_quantize_tensorwise"),
    "delayed": ("_quantize_tensorwise",),
    "block 1x128": ("_quantize",),
}


def tune() -> None:
    for (m, n), (mode, kernels) in itertools.product(SHAPES[:2], TUNED.items()):
        x = torch.randn(m, n, device="cuda", dtype=DTYPE)
        kp = providers(mode)["kp"]
        results = []
        for elements, warps in itertools.product((2048, 4096, 8192, 16384, 32768), (4, 8, 16)):
            for k in kernels:
                kp_core.pin(k, elements=elements, num_warps=warps)
            with torch.no_grad():
                ms = harness.bench_graph_ms(lambda kp=kp, x=x: kp(x))
            results.append((3 * m * n / ms / 1e6, elements, warps))
        for k in kernels:
            kp_core.unpin(k)
        print(f"tune {m}x{n} {mode}: best GB/s, elements, num_warps")
        for r in sorted(results, reverse=True)[:5]:
            print(f"   {r[0]:7.0f}  {r[1]:6d}  {r[2]:2d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true")
    harness.require_gpu()
    if parser.parse_args().tune:
        tune()
        return
    copy = harness.copy_bandwidth_gbps()
    print(f"device copy bandwidth this run: {copy:.0f} GB/s")
    rows = []
    for m, n in harness.progress(SHAPES, "quantize"):
        x = torch.randn(m, n, device="cuda", dtype=DTYPE)
        for mode in RECIPES:
            check_correct(x, mode)
            for name, fn in providers(mode).items():
                row = dict(group="headline", M=m, N=n, mode=mode, provider=name)
                with torch.no_grad():
                    rows.append(harness.timed(row, lambda fn=fn, x=x: fn(x), nbytes=3 * m * n, copy_gbps=copy))
    meta = {"kernel": "quantize", "op": "quantize", "dtype": "bfloat16 -> float8_e4m3fn", "copy_gbps": copy}
    meta.update(harness.versions())
    note = "; bytes 3*M*N (read bf16, write fp8); dynamic tensorwise must read twice (see the script)"
    md = harness.render(harness.header("Float8 quantisation", meta, note), meta, rows)
    title = f"float8 quantisation, bf16 -> e4m3, {meta['device']}"
    ylabel = "GB/s (3*M*N bytes), CUDA graph"
    plot = lambda path: harness.plot_bars(rows, meta, path, SHAPES, list(RECIPES), "gbps_graph", ylabel, title)  # noqa: E731
    out = harness.write_results("quantize", meta, rows, md, plot)
    print(md)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
