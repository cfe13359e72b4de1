"""RMSNorm: kp vs the anchors (eager formula, F.rms_norm, torch.compile, Liger-Kernel) in one run.

    python benchmarks/bench_rms_norm.py            # headline shapes + N sweep, writes results/<device>/
    python benchmarks/bench_rms_norm.py --tune     # sweep kp's launch settings on the headline shapes

GB/s counts the bytes the op must move: forward 2*M*N*elsize (read x, write y); forward+backward
5*M*N*elsize (adds read x, read dy, write dx), the convention of DESIGN.md's anchors.

Each case is timed two ways, every provider alike: replayed from a CUDA graph (the kernels' own speed)
and with plain launches under do_bench (what a Python loop that does nothing else sees; a ~100 us op is
then bound by the CPU's launch and autograd overhead, and the figure is noisy).
"""

from __future__ import annotations

import argparse
import itertools

import harness
import torch
import torch.nn.functional as F

import kp_norms
from kp_norms.ops import rms_norm as rms_mod

DTYPE = torch.bfloat16
EPS = 1e-6
HEADLINE = [(16384, 4096), (8192, 8192)]
SWEEP_N = [512, 1024, 2048, 3072, 4096, 5120, 8192, 12288, 16384, 32768, 65536]
SWEEP_ELEMENTS = 64 << 20


def eager(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


# One compiled function per (width, grad mode): more than dynamo's default cache of 8 graphs per function.
torch._dynamo.config.cache_size_limit = 256


def providers(n: int) -> dict:
    out = {
        "kp": lambda x, w: kp_norms.rms_norm(x, (n,), w, EPS),
        "F.rms_norm": lambda x, w: F.rms_norm(x, (n,), w, EPS),
        "eager": eager,
        "compile": torch.compile(lambda x, w: F.rms_norm(x, (n,), w, EPS), dynamic=False),
    }
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm

        liger = LigerRMSNorm(n, eps=EPS).to("cuda", DTYPE)
        out["liger"] = lambda x, w: liger(x)
    except Exception as e:  # absent or incompatible: reported, not hidden
        print(f"Liger-Kernel unavailable: {type(e).__name__}: {e}")
    return out


def measure(fn, m: int, n: int, mode: str, graph: bool = False) -> float:
    bench = harness.bench_graph_ms if graph else harness.bench_ms
    x = torch.randn(m, n, device="cuda", dtype=DTYPE, requires_grad=mode == "fwd+bwd")
    w = torch.randn(n, device="cuda", dtype=DTYPE, requires_grad=mode == "fwd+bwd")
    if mode == "fwd":
        with torch.no_grad():
            return bench(lambda: fn(x, w))
    dy = torch.randn(m, n, device="cuda", dtype=DTYPE)
    return bench(lambda: fn(x, w).backward(dy), grad_to_none=[x, w])


def gbps(m: int, n: int, mode: str, ms: float) -> float:
    factor = 2 if mode == "fwd" else 5
    return factor * m * n * DTYPE.itemsize / ms / 1e6


def check_correct(m: int, n: int) -> None:
    """Poison-free sanity check before timing: kp equals F.rms_norm to bf16 rounding on fresh data."""
    x, w = torch.randn(m, n, device="cuda", dtype=DTYPE), torch.randn(n, device="cuda", dtype=DTYPE)
    ours, ref = kp_norms.rms_norm(x, (n,), w, EPS).float(), F.rms_norm(x.double(), (n,), w.double(), EPS)
    err = (ours - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item(), f"kp rms_norm wrong at {m}x{n}: max err {err}"


def overhead_us(fn, n: int = 4096, rows: int = 8, iters: int = 200) -> dict:
    """Wall time per call on a tiny input, where only the CPU side (Python, dispatch, launches) counts."""
    import time

    x = torch.randn(rows, n, device="cuda", dtype=DTYPE, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=DTYPE, requires_grad=True)
    dy = torch.randn(rows, n, device="cuda", dtype=DTYPE)
    out = {}
    for mode in ("fwd", "fwd+bwd"):

        def call(mode=mode):
            if mode == "fwd":
                with torch.no_grad():
                    fn(x, w)
            else:
                x.grad = w.grad = None
                fn(x, w).backward(dy)

        for _ in range(20):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
        out[mode] = (time.perf_counter() - start) / iters * 1e6
    return out


def tune() -> None:
    default_per_sm = rms_mod.PROGRAMS_PER_SM
    for (m, n), mode in itertools.product(HEADLINE, ("fwd", "fwd+bwd")):
        results = []
        for rows, warps, per_sm in itertools.product((1, 2, 4), (4, 8, 16), (1, 2, 4, 8) if mode != "fwd" else (4,)):
            if rows * n > 32768:
                continue
            rms_mod.CONFIG_OVERRIDE.clear()
            rms_mod.CONFIG_OVERRIDE[rms_mod.OP if mode == "fwd" else rms_mod.OP_BWD] = (rows, warps)
            rms_mod.PROGRAMS_PER_SM = per_sm
            ms = measure(providers(n)["kp"], m, n, mode, graph=True)
            results.append((gbps(m, n, mode, ms), rows, warps, per_sm))
        rms_mod.CONFIG_OVERRIDE.clear()
        rms_mod.PROGRAMS_PER_SM = default_per_sm
        print(f"tune {m}x{n} {mode}: best GB/s, block_rows, num_warps, programs/SM")
        for r in sorted(results, reverse=True)[:5]:
            print(f"   {r[0]:7.0f}  {r[1]}  {r[2]:2d}  {r[3]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    harness.require_gpu()
    if args.tune:
        tune()
        return
    copy = harness.copy_bandwidth_gbps()
    print(f"device copy bandwidth this run: {copy:.0f} GB/s")
    cases = [("headline", m, n, mode) for (m, n) in HEADLINE for mode in ("fwd", "fwd+bwd")]
    if not args.no_sweep:
        cases += [("sweep", SWEEP_ELEMENTS // n, n, mode) for n in SWEEP_N for mode in ("fwd", "fwd+bwd")]
    rows = []
    by_width = {}  # one set of providers (one torch.compile) per row width
    for group, m, n, mode in harness.progress(cases, "rms_norm"):
        check_correct(m, n)
        if n not in by_width:
            by_width[n] = providers(n)
        for name, fn in by_width[n].items():
            row = dict(group=group, M=m, N=n, mode=mode, provider=name)
            for timing in ("graph", "eager"):
                try:
                    ms = measure(fn, m, n, mode, graph=timing == "graph")
                except Exception as e:  # e.g. an anchor that cannot handle a width: recorded as missing
                    print(f"{name} ({timing}) failed at {m}x{n} {mode}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                bw = gbps(m, n, mode, ms)
                row.update({f"ms_{timing}": ms, f"gbps_{timing}": bw, f"pct_copy_{timing}": 100 * bw / copy})
            rows.append(row)
    overhead = {name: overhead_us(fn) for name, fn in providers(4096).items()}
    meta = {
        "kernel": "rms_norm",
        "dtype": "bfloat16",
        "copy_gbps": copy,
        "cpu_overhead_us_8x4096": overhead,
        **harness.versions(),
    }
    md = render(meta, rows)
    out = harness.write_results("rms_norm", meta, rows, md, lambda path: plot(rows, meta, path))
    print(md)
    print(f"wrote {out}")


def render(meta: dict, rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["provider"] for r in rows))
    lines = [
        f"# RMSNorm, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, liger-kernel {meta['liger_kernel']}; "
        f"measured copy bandwidth {meta['copy_gbps']:.0f} GB/s. Cells: GB/s (% of copy).",
    ]
    titles = {
        "graph": "Kernel throughput: CUDA graph replay (GPU time only)",
        "eager": "Plain launches: triton.testing.do_bench (includes CPU launch/autograd overhead when it dominates)",
    }
    for timing, title in titles.items():
        lines += ["", f"## {title}", "", "| M x N | mode | " + " | ".join(names) + " | kp / best anchor |"]
        lines.append("|---|---|" + "---|" * (len(names) + 1))
        for (m, n, mode), group in itertools.groupby(rows, key=lambda r: (r["M"], r["N"], r["mode"])):
            by = {r["provider"]: r for r in group if f"gbps_{timing}" in r}
            cells = [
                f"{by[p][f'gbps_{timing}']:.0f} ({by[p][f'pct_copy_{timing}']:.0f}%)" if p in by else "-" for p in names
            ]
            anchors = [r[f"gbps_{timing}"] for p, r in by.items() if p != "kp"]
            ratio = f"{by['kp'][f'gbps_{timing}'] / max(anchors):.2f}x" if "kp" in by and anchors else "-"
            lines.append(f"| {m} x {n} | {mode} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "## CPU cost per call (8 x 4096 input, wall time per call in microseconds)", ""]
    lines += ["| provider | fwd | fwd+bwd |", "|---|---|---|"]
    for name, us in meta.get("cpu_overhead_us_8x4096", {}).items():
        lines.append(f"| {name} | {us['fwd']:.0f} | {us['fwd+bwd']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        sweep = [r for r in rows if r["group"] == "sweep" and r["mode"] == mode]
        for name in dict.fromkeys(r["provider"] for r in sweep):
            pts = sorted((r["N"], r["gbps_graph"]) for r in sweep if r["provider"] == name and "gbps_graph" in r)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, lw=2.5 if name == "kp" else 1.2)
        ax.axhline(meta["copy_gbps"], color="grey", ls="--", lw=1, label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"RMSNorm {mode}, bf16, {SWEEP_ELEMENTS >> 20}M elements (CUDA graph)")
        ax.set_xlabel("N (row width)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=8)
    fig.suptitle(meta["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
