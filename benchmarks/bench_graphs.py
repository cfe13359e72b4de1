"""CUDA graphs with shape buckets (kp_graphs.graphed) against eager, one static graph and torch.compile's
reduce-overhead, in one run.

    python benchmarks/bench_graphs.py     # writes results/<device>/graphs.*

The model is 64 x nn.Linear(1024, 1024) in fp16, a stack whose eager cost is all kernel launches at batch 1.
Two measurements, inference (torch.no_grad):
- fixed batch 1: wall microseconds per call with the GPU drained before and after (the CPU's cost is the
  point), for eager, a hand-captured torch.cuda.CUDAGraph (the floor: no copy in, no bookkeeping), kp graphed
  and torch.compile(mode="reduce-overhead");
- batches that vary: the same 400 batch sizes drawn from 1..64 for every provider, wall microseconds per call,
  the first pass (captures and compiles) timed on its own, kp's captures (one per bucket used), and the memory
  each holds above the model afterwards.
"""

from __future__ import annotations

import random
import time

import harness
import torch
from torch import nn

import kp_graphs

WIDTH, LAYERS = 1024, 64
BUCKETS = [1, 2, 4, 8, 16, 32, 64]
CALLS = 400


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to("cuda", torch.float16).eval()


def static_graph(m: nn.Module, batch: int):
    """One graph captured by hand at one batch size: the least a replay can cost."""
    x = torch.zeros(batch, WIDTH, device="cuda", dtype=torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            m(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = m(x)

    def call(inp):
        x.copy_(inp)
        g.replay()
        return y

    return call


def providers(m: nn.Module) -> dict:
    torch._dynamo.reset()
    return {
        "eager": m,
        "torch.compile reduce-overhead": torch.compile(m, mode="reduce-overhead"),
        "kp graphed": kp_graphs.graphed(m, buckets=BUCKETS, name="64 x Linear(1024)"),
        "kp graphed, copy_outputs=False": kp_graphs.graphed(
            m, buckets=BUCKETS, copy_outputs=False, name="64 x Linear(1024), views"
        ),
    }


def mib_now() -> float:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**20


def main() -> None:
    harness.require_gpu()
    rows = []
    with torch.no_grad():
        m = model()
        base = mib_now()
        x1 = torch.randn(1, WIDTH, device="cuda", dtype=torch.float16)
        fixed = {"static CUDA graph (batch 1)": static_graph(m, 1), **providers(m)}
        for name, fn in fixed.items():
            want = m(x1)
            assert torch.allclose(fn(x1).float(), want.float(), rtol=1e-2, atol=1e-2), name
            us = harness.wall_us_per_call(lambda fn=fn: fn(x1), iters=500, warmup=50)
            rows.append(dict(case="batch 1", provider=name, us_per_call=us))
            print(f"batch 1  {name:32s} {us:8.1f} us", flush=True)

        sizes = random.Random(0).choices(range(1, 65), k=CALLS)
        inputs = {n: torch.randn(n, WIDTH, device="cuda", dtype=torch.float16) for n in set(sizes)}
        for name, fn in providers(m).items():
            before = mib_now()
            start = time.perf_counter()
            for n in sizes:  # the first pass captures / compiles: timed separately
                fn(inputs[n])
            torch.cuda.synchronize()
            first = (time.perf_counter() - start) / CALLS * 1e6
            start = time.perf_counter()
            for n in sizes:
                fn(inputs[n])
            torch.cuda.synchronize()
            us = (time.perf_counter() - start) / CALLS * 1e6
            held = mib_now() - before
            captures = fn.stats.captures if isinstance(fn, kp_graphs.Graphed) else None
            rows.append(
                dict(
                    case="batch 1..64", provider=name, us_per_call=us, first_pass_us=first, mib=held, captures=captures
                )
            )
            print(f"1..64    {name:32s} {us:8.1f} us (first pass {first:9.1f}) {held:7.1f} MiB", flush=True)
        print(kp_graphs.report())
    meta = {"kernel": "graphs", "op": "graphed", "dtype": "float16", "model_mib": base}
    harness.publish("graphs", meta, rows, render, plot)


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# CUDA graphs with shape buckets, 64 x Linear(1024) fp16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}. Wall microseconds per call, GPU drained before and after.",
        "",
        "| case | provider | us / call | first pass us / call | MiB held | captures |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        first = f"{r['first_pass_us']:.0f}" if "first_pass_us" in r else "-"
        mib = f"{r['mib']:.1f}" if "mib" in r else "-"
        lines.append(
            f"| {r['case']} | {r['provider']} | {r['us_per_call']:.1f} | {first} | {mib} | {r.get('captures') or '-'} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    title = f"64 x Linear(1024) fp16, {meta['device']}"
    harness.plot_grouped(rows, path, "case", "us_per_call", "us per call", title)


if __name__ == "__main__":
    main()
