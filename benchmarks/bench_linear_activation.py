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
        with torch.no_grad():  # no autograd graph kept alive: CUDA graph capture of the backward needs none
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
    note = "Cells: TFLOP/s (2*M*K*N forward, 6*M*K*N forward+backward); ratio: kp / the best anchor."
    md = harness.render_tflops("Fused linear + GELU, bf16", meta, rows, note, _ratio)
    modes = ["fwd", "fwd+bwd"]
    plot = lambda p: harness.plot_tflops(rows, meta, p, SHAPES, modes, "linear + gelu, bf16")  # noqa: E731
    out = harness.write_results("linear_activation", meta, rows, md, plot)
    print(md)
    print(f"wrote {out}")


def _ratio(by: dict) -> str:
    anchors = [v for p, v in by.items() if p != "kp"]
    return f"{by['kp'] / max(anchors):.2f}x" if "kp" in by and anchors else "-"


if __name__ == "__main__":
    main()
