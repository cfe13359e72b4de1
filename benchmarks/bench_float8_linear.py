"""Float8 training linear (kp_precision.Float8Linear): kp vs the anchors in one run.

    python benchmarks/bench_float8_linear.py     # writes results/<device>/float8_linear.*

x (M, K) bf16 through a linear K -> N with float32 master weights (the mixed-precision training layout), forward
and forward+backward. Providers: bf16 nn.Linear (cuBLAS; eager and torch.compile), kp Float8Linear per recipe
(eager and torch.compile), torchao's convert_to_float8_training with the same recipe under torch.compile (how
torchao is meant to run). TFLOP/s = 2*M*K*N (forward) or 6*M*K*N (forward+backward) / time, CUDA-graph timing.
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
        try:
            if recipe == "blockwise":
                raise NotImplementedError("torchao's blockwise float8 training is a prototype with its own API")
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
    md = render(meta, rows)
    out = harness.write_results("float8_linear", meta, rows, md, lambda path: _plot(rows, meta, path))
    print(md)
    print(f"wrote {out}")


def render(meta, rows) -> str:
    lines = [
        f"# Float8 training linear, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}. Cells: TFLOP/s (2*M*K*N forward, 6*M*K*N forward+backward); "
        "the last column is kp's best / the best torchao provider of the same recipe and / bf16 cuBLAS.",
    ]
    names = list(dict.fromkeys(r["provider"] for r in rows))
    for timing, title in (("graph", "CUDA graph replay"), ("eager", "plain launches")):
        lines += ["", f"## {title}", "", "| M x K x N | mode | " + " | ".join(names) + " | ratios |"]
        lines.append("|---|---|" + "---|" * (len(names) + 1))
        for (m, k, n, mode), group in itertools.groupby(rows, key=lambda r: (r["M"], r["K"], r["N"], r["mode"])):
            by = {r["provider"]: r[f"tflops_{timing}"] for r in group if f"tflops_{timing}" in r}
            cells = [f"{by[p]:.0f}" if p in by else "-" for p in names]
            bf16 = max([v for p, v in by.items() if p.startswith("bf16")], default=0)
            ratios = []
            for recipe in RECIPES:
                kp = max([v for p, v in by.items() if p.startswith(f"kp {recipe}")], default=0)
                ao = max([v for p, v in by.items() if p.startswith(f"torchao {recipe}")], default=0)
                if kp:
                    vs_ao = f" / {kp / ao:.2f}x torchao" if ao else ""
                    ratios.append(f"{recipe}: {kp / bf16:.2f}x bf16{vs_ao}" if bf16 else recipe)
            lines.append(f"| {m} x {k} x {n} | {mode} | " + " | ".join(cells) + f" | {'; '.join(ratios)} |")
    return "\n".join(lines) + "\n"


def _plot(rows, meta, path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(7 * len(SHAPES), 5), sharey=True)
    for ax, (m, k, n) in zip(axes, SHAPES):
        sub = [r for r in rows if (r["M"], r["K"], r["N"]) == (m, k, n) and "tflops_graph" in r]
        names = list(dict.fromkeys(r["provider"] for r in sub))
        modes = ("fwd", "fwd+bwd")
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            vals = [
                next((r["tflops_graph"] for r in sub if r["provider"] == name and r["mode"] == md), 0) for md in modes
            ]
            ax.bar([j + i * width for j in range(len(modes))], vals, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], modes)
        ax.set_title(f"{m} x {k} x {n}")
    axes[0].set_ylabel("TFLOP/s, CUDA graph")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"float8 training linear, {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
