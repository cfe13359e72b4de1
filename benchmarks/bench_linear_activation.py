"""Fused linear + activation (kp_precision.linear_activation): kp vs the anchors in one run.

    python benchmarks/bench_linear_activation.py     # writes results/<device>/linear_activation.*

y = gelu(x @ w.T + b), bf16, at the Llama MLP's up-projection shapes, forward and forward+backward. Anchors:
cuBLAS then a separate activation (F.linear + F.gelu, eager), torch._addmm_activation (cuBLASLt's fused GELU
epilogue, forward only), torch.compile(mode="max-autotune") of F.linear + F.gelu. TFLOP/s = 2*M*K*N (forward)
or 6*M*K*N (forward+backward) / time, CUDA-graph timing.
"""

from __future__ import annotations

import itertools

import harness
import torch
import torch.nn.functional as F

import kp_precision

SHAPES = [(8192, 4096, 14336), (16384, 4096, 14336), (8192, 8192, 8192), (4096, 4096, 11008)]
torch._dynamo.config.cache_size_limit = 256


def eager(x, w, b):
    return F.gelu(F.linear(x, w, b))


def providers(mode):
    out = {
        "kp": lambda x, w, b: kp_precision.linear_activation(x, w, b, "gelu"),
        "F.linear + F.gelu": eager,
        "compile max-autotune": torch.compile(eager, mode="max-autotune-no-cudagraphs", dynamic=False),
    }
    if mode == "fwd":
        out["torch._addmm_activation"] = lambda x, w, b: torch._addmm_activation(b, x, w.t(), use_gelu=True)
    return out


def main() -> None:
    harness.require_gpu()
    rows = []
    for (m, k, n), mode in harness.progress(list(itertools.product(SHAPES, ("fwd", "fwd+bwd"))), "linear_activation"):
        grad = mode == "fwd+bwd"
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        w = (torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5).requires_grad_(grad)
        b = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        ref = eager(x.float(), w.float(), b.float())
        for name, fn in providers(mode).items():
            with torch.no_grad():
                err = ((fn(x, w, b).float() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"{name}: relative error {err:.3g} against float32"

            def step(fn=fn, x=x, w=w, b=b, grad=grad):
                y = fn(x, w, b)
                if grad:
                    y.backward(torch.ones_like(y))

            row = dict(M=m, K=k, N=n, mode=mode, provider=name)
            for timing in ("graph", "eager"):
                bench = harness.bench_graph_ms if timing == "graph" else harness.bench_ms
                try:
                    with torch.set_grad_enabled(grad):
                        ms = bench(step, grad_to_none=[x, w, b] if grad else None)
                except Exception as e:
                    print(f"{name} ({timing}) failed at {m}x{k}x{n} {mode}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                row.update({f"ms_{timing}": ms, f"tflops_{timing}": (6 if grad else 2) * m * k * n / ms / 1e9})
            rows.append(row)
    meta = {"kernel": "linear_activation", "op": "linear_activation", "dtype": "bfloat16"}
    meta.update(harness.versions())
    md = render(meta, rows)
    out = harness.write_results("linear_activation", meta, rows, md, lambda path: _plot(rows, meta, path))
    print(md)
    print(f"wrote {out}")


def render(meta, rows) -> str:
    lines = [
        f"# Fused linear + GELU, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}. Cells: TFLOP/s (2*M*K*N forward, 6*M*K*N forward+backward); "
        "the last column is kp / the best anchor.",
    ]
    names = list(dict.fromkeys(r["provider"] for r in rows))
    for timing, title in (("graph", "CUDA graph replay"), ("eager", "plain launches")):
        lines += ["", f"## {title}", "", "| M x K x N | mode | " + " | ".join(names) + " | kp / best anchor |"]
        lines.append("|---|---|" + "---|" * (len(names) + 1))
        for (m, k, n, mode), group in itertools.groupby(rows, key=lambda r: (r["M"], r["K"], r["N"], r["mode"])):
            by = {r["provider"]: r[f"tflops_{timing}"] for r in group if f"tflops_{timing}" in r}
            cells = [f"{by[p]:.0f}" if p in by else "-" for p in names]
            anchors = [v for p, v in by.items() if p != "kp"]
            ratio = f"{by['kp'] / max(anchors):.2f}x" if "kp" in by and anchors else "-"
            lines.append(f"| {m} x {k} x {n} | {mode} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def _plot(rows, meta, path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        sub = [r for r in rows if r["mode"] == mode and "tflops_graph" in r]
        names = list(dict.fromkeys(r["provider"] for r in sub))
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            vals = [
                next((r["tflops_graph"] for r in sub if r["provider"] == name and (r["M"], r["K"], r["N"]) == s), 0)
                for s in SHAPES
            ]
            ax.bar([j + i * width for j in range(len(SHAPES))], vals, width, label=name)
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(SHAPES))], [f"{m}x{k}x{n}" for m, k, n in SHAPES], fontsize=7
        )
        ax.set_title(f"linear + gelu {mode} (CUDA graph)")
    axes[0].set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=7)
    fig.suptitle(meta["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
