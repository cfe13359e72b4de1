"""Float8 training linear (kp_precision.Float8Linear): kp vs the anchors in one run.

    python benchmarks/bench_float8_linear.py     # writes results/<device>/float8_linear.*

x (M, K) bf16 through a linear K -> N with float32 master weights (the mixed-precision training layout), forward
and forward+backward. Providers: bf16 nn.Linear (cuBLAS; eager and torch.compile), kp Float8Linear per recipe
(eager and torch.compile; tensorwise also with delayed scaling, whose casts skip the amax pass), torchao's
convert_to_float8_training with the same recipe under torch.compile (how torchao is meant to run; torchao has
dynamic scaling only). TFLOP/s = 2*M*K*N (forward) or 6*M*K*N (forward+backward) / time, CUDA-graph timing.
"""

from __future__ import annotations

import copy
import itertools

import harness
import torch
from torch import nn

import kp_precision

SHAPES = [(8192, 8192, 8192), (16384, 4096, 14336)]
RECIPES = ("tensorwise", "rowwise", "blockwise")
torch._dynamo.config.cache_size_limit = 256


def layers(k: int, n: int) -> dict:
    base = nn.Linear(k, n, bias=False, device="cuda")
    bf16 = copy.deepcopy(base).bfloat16()
    out = {"bf16 nn.Linear": bf16, "bf16 nn.Linear (compile)": torch.compile(bf16)}
    for recipe in RECIPES:
        f8 = kp_precision.Float8Linear.from_linear(copy.deepcopy(base), config=kp_precision.Float8Config(recipe))
        out[f"kp {recipe}"] = f8
        out[f"kp {recipe} (compile)"] = torch.compile(f8)
        if recipe == "tensorwise":  # delayed scaling: the cast reads its input once (no amax pass before it)
            config = kp_precision.Float8Config(recipe, scaling="delayed")
            delayed = kp_precision.Float8Linear.from_linear(copy.deepcopy(base), config=config)
            out["kp tensorwise delayed"] = delayed
            out["kp tensorwise delayed (compile)"] = torch.compile(delayed)
        if recipe == "blockwise":
            print("torchao blockwise: not compared (its blockwise float8 training is a prototype with its own API)")
            continue
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            ao = convert_to_float8_training(
                nn.Sequential(copy.deepcopy(base)), config=Float8LinearConfig.from_recipe_name(recipe)
            )
            out[f"torchao {recipe} (compile)"] = torch.compile(ao)
        except Exception as e:  # absent or incompatible: reported, not hidden
            print(f"torchao {recipe} unavailable: {type(e).__name__}: {str(e)[:200]}")
    return out


def main() -> None:
    harness.require_gpu()
    rows = []
    for (m, k, n), mode in harness.progress(list(itertools.product(SHAPES, ("fwd", "fwd+bwd"))), "float8_linear"):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=mode == "fwd+bwd")
        flops = (2 if mode == "fwd" else 6) * m * k * n
        for name, layer in layers(k, n).items():
            params = list(layer.parameters())

            def step(layer=layer, x=x, mode=mode):
                y = layer(x)
                if mode == "fwd+bwd":
                    y.backward(torch.ones_like(y))

            row = dict(M=m, K=k, N=n, mode=mode, provider=name)
            for timing in ("graph", "eager"):
                bench = harness.bench_graph_ms if timing == "graph" else harness.bench_ms
                try:
                    with torch.set_grad_enabled(mode == "fwd+bwd"):
                        ms = bench(step, grad_to_none=[x, *params] if mode == "fwd+bwd" else None)
                except Exception as e:
                    print(f"{name} ({timing}) failed at {m}x{k}x{n} {mode}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                row.update({f"ms_{timing}": ms, f"tflops_{timing}": flops / ms / 1e9})
            rows.append(row)
    meta = {"kernel": "float8_linear", "op": "float8_linear", "dtype": "bf16 activations, fp32 master weights"}
    meta.update(harness.versions())
    note = (
        "Cells: TFLOP/s (2*M*K*N forward, 6*M*K*N forward+backward); ratio, per recipe: kp's best / bf16's best, "
        "and / torchao's same recipe."
    )
    md = harness.render_tflops("Float8 training linear", meta, rows, note, _ratios)
    plot = lambda p: harness.plot_tflops(rows, meta, p, SHAPES, ["fwd", "fwd+bwd"], "float8 training linear")  # noqa: E731
    out = harness.write_results("float8_linear", meta, rows, md, plot)
    print(md)
    print(f"wrote {out}")


def _ratios(by: dict) -> str:
    bf16 = max([v for p, v in by.items() if p.startswith("bf16")], default=0)
    out = []
    for recipe in RECIPES:
        kp = max([v for p, v in by.items() if p.startswith(f"kp {recipe}")], default=0)
        ao = max([v for p, v in by.items() if p.startswith(f"torchao {recipe}")], default=0)
        if kp and bf16:
            out.append(f"{recipe}: {kp / bf16:.2f}x bf16" + (f", {kp / ao:.2f}x torchao" if ao else ""))
    return "; ".join(out) or "-"


if __name__ == "__main__":
    main()
