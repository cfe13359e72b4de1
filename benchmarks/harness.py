"""Shared benchmark plumbing: device ceilings, timing, progress, and the JSON/markdown/PNG outputs."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from pathlib import Path

import torch

# KP_RESULTS_DIR writes a run elsewhere (repeated runs for the regression check's noise, a run to compare)
RESULTS = Path(os.environ.get("KP_RESULTS_DIR") or Path(__file__).parent / "results")


def require_gpu() -> None:
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA/ROCm GPU; none found, nothing measured.")
        sys.exit(0)


def start(doc: str, smoke) -> float | None:
    """A benchmark's command line and start: with --smoke, run smoke() (the script's mechanics on the CPU, kp under
    Triton's interpreter) and return None; else, on a GPU, this run's copy bandwidth in GB/s."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny inputs, each provider once; nothing written")
    if parser.parse_args().smoke:
        smoke()
        return None
    require_gpu()
    copy = copy_bandwidth_gbps()
    print(f"device copy bandwidth this run: {copy:.0f} GB/s")
    return copy


def run_each(label: str, fns: dict) -> None:
    """A smoke run's calls: each provider once, saying so (an exception stops the run)."""
    for name, fn in fns.items():
        fn()
        print(f"smoke: {label}: {name} ran")


def device_slug() -> str:
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")


def bench_ms(fn, grad_to_none=None) -> float:
    """Median time of fn in ms (triton.testing.do_bench: warm-up, L2 flush between runs, CUDA events)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, grad_to_none=grad_to_none, return_mode="median")


def bench_graph_ms(fn, grad_to_none=None) -> float:
    """Median time of fn in ms replayed from a CUDA graph: the GPU's time alone, without the Python and
    launch overhead that makes a single ~100 us op CPU-bound under plain do_bench."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=100, grad_to_none=grad_to_none, return_mode="median")


def timed(row: dict, fn, nbytes: int = 0, flops: int = 0, copy_gbps: float = 0.0) -> dict:
    """row (a provider's case: provider, mode, M, N and maybe K) with fn's median ms under both timings, CUDA-graph
    replay and plain launches, as ms_<timing>; GB/s of nbytes (and % of copy_gbps) and TFLOP/s of flops where given.
    A timing that fails is printed and left out of the row, so the other providers still run."""
    shape = " x ".join(str(row[k]) for k in ("M", "K", "N") if k in row)
    for timing, bench in (("graph", bench_graph_ms), ("eager", bench_ms)):
        try:
            ms = bench(fn)
        except Exception as e:
            print(f"{row['provider']} ({timing}) failed at {shape} {row['mode']}: {type(e).__name__}: {str(e)[:200]}")
            continue
        row[f"ms_{timing}"] = ms
        if nbytes:
            row[f"gbps_{timing}"] = nbytes / ms / 1e6
            if copy_gbps:
                row[f"pct_copy_{timing}"] = 100 * row[f"gbps_{timing}"] / copy_gbps
        if flops:
            row[f"tflops_{timing}"] = flops / ms / 1e9
    return row


def copy_bandwidth_gbps(nbytes: int = 1 << 30, timer=None) -> float:
    """This run's device-to-device copy ceiling for an nbytes buffer, counting bytes read plus bytes written;
    timer: how to time it (bench_ms by default; bench_graph_ms to compare with a kernel timed by graph replay)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = (timer or bench_ms)(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def progress(items, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stdout, mininterval=2.0)
    except ImportError:
        return items


def installed(dist: str) -> str:
    """A distribution's installed version, or "absent"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def versions() -> dict[str, str]:
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name()}
    for name in ("liger_kernel",):
        try:
            from importlib.metadata import version

            out[name] = version(name.replace("_", "-"))
        except Exception:
            out[name] = "absent"
    return out


def write_results(kernel: str, meta: dict, rows: list[dict], markdown: str, plot) -> Path:
    out = RESULTS / device_slug()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{kernel}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    (out / f"{kernel}.md").write_text(markdown)
    try:
        import matplotlib

        matplotlib.use("Agg")
        plot(out / f"{kernel}.png")
    except ImportError:
        print("matplotlib not installed: no plot written")
    return out


def publish(kernel: str, meta: dict, rows: list[dict], render, plot, echo: bool = True) -> None:
    """The end of a benchmark: versions into meta, the markdown rendered, JSON + markdown + plot written, both
    printed (echo=False: written only, as the long benchmarks do after each part they measure)."""
    meta.update(versions())
    md = render(meta, rows)
    out = write_results(kernel, meta, rows, md, lambda p: plot(rows, meta, p))
    if echo:
        print(md)
        print(f"wrote {out}")


def last_rows(kernel: str) -> list[dict]:
    """The rows of the last run of `kernel` on this device ([] when there is none)."""
    path = RESULTS / device_slug() / f"{kernel}.json"
    return json.loads(path.read_text())["rows"] if path.exists() else []


def kept_rows(kernel: str, only, known=None) -> list[dict]:
    """With --only VARIANT..., the rows of the other variants (of `known` ones, when given) from the last run of
    `kernel` on this device, so that a long table can be measured in several calls; [] without --only."""
    if not only:
        return []
    return [r for r in last_rows(kernel) if r["variant"] not in only and (known is None or r["variant"] in known)]


def plot_grouped(rows: list[dict], path, group: str, value: str, ylabel: str, title: str) -> None:
    """One bar per provider within each group (rows' `group` values), heights from `value` (0 where missing)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    groups = list(dict.fromkeys(r[group] for r in rows))
    names = list(dict.fromkeys(r["provider"] for r in rows))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next((r.get(value, 0) for r in rows if r[group] == g and r["provider"] == name), 0) for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))], groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


TIMING_TITLES = {
    "graph": "Kernel throughput: CUDA graph replay (GPU time only)",
    "eager": "Plain launches: triton.testing.do_bench (includes CPU launch/autograd overhead when it dominates)",
}


def header(title: str, meta: dict, note: str = "") -> list[str]:
    """The results markdown's first lines: what was measured, on what software, against which copy ceiling."""
    return [
        f"# {title}, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, liger-kernel {meta['liger_kernel']}; "
        f"measured copy bandwidth {meta['copy_gbps']:.0f} GB/s. Cells: GB/s (% of copy){note}.",
    ]


def render(header: list[str], meta: dict, rows: list[dict]) -> str:
    """The results markdown: one table per timing method, then the CPU cost per call where measured. Providers
    whose name contains "kp" (kp's own variants and composites) are not anchors in the kp / best anchor column."""
    names = list(dict.fromkeys(r["provider"] for r in rows))
    lines = list(header)
    for timing, title in TIMING_TITLES.items():
        lines += ["", f"## {title}", "", "| M x N | mode | " + " | ".join(names) + " | kp / best anchor |"]
        lines.append("|---|---|" + "---|" * (len(names) + 1))
        for (m, n, mode), group in itertools.groupby(rows, key=lambda r: (r["M"], r["N"], r["mode"])):
            by = {r["provider"]: r for r in group if f"gbps_{timing}" in r}
            if not by:
                continue
            cells = [
                f"{by[p][f'gbps_{timing}']:.0f} ({by[p][f'pct_copy_{timing}']:.0f}%)" if p in by else "-" for p in names
            ]
            anchors = [r[f"gbps_{timing}"] for p, r in by.items() if "kp" not in p]
            ratio = f"{by['kp'][f'gbps_{timing}'] / max(anchors):.2f}x" if "kp" in by and anchors else "-"
            lines.append(f"| {m} x {n} | {mode} | " + " | ".join(cells) + f" | {ratio} |")
    cpu_us = meta.get("cpu_overhead_us_8x4096")
    if cpu_us:  # only the benchmarks that measure it (norms, GLU): no empty table for the others
        lines += ["", "## CPU cost per call (8 x 4096 input, wall time per call in microseconds)", ""]
        lines += ["| provider | fwd | fwd+bwd |", "|---|---|---|"]
        for name, us in cpu_us.items():
            lines.append(f"| {name} | {us['fwd']:.0f} | {us['fwd+bwd']:.0f} |")
    return "\n".join(lines) + "\n"


def plot_modes(rows: list[dict], meta: dict, path, title: str, xlabel: str) -> None:
    """GB/s (graph timing) against N, forward and forward+backward side by side, copy bandwidth dashed."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        mode_rows = [r for r in rows if r["mode"] == mode and "gbps_graph" in r]
        for name in dict.fromkeys(r["provider"] for r in mode_rows):
            pts = sorted({r["N"]: r["gbps_graph"] for r in mode_rows if r["provider"] == name}.items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name, lw=2.5 if name == "kp" else 1.2)
        ax.axhline(meta["copy_gbps"], color="grey", ls="--", lw=1, label="copy bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{title} {mode} (CUDA graph)")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[1].legend(fontsize=8)
    fig.suptitle(meta["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def wall_us_per_call(call, iters: int = 200, warmup: int = 20) -> float:
    """Wall time per call in microseconds, the GPU drained before and after: on a tiny input, the CPU's cost."""
    import time

    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def render_tflops(title: str, meta: dict, rows: list[dict], note: str, ratio) -> str:
    """A matmul benchmark's results markdown: per timing, a table of TFLOP/s per provider for each (M, K, N,
    mode), its last column ratio({provider: TFLOP/s}) (a string)."""
    lines = [f"# {title}, {meta['device']}", "", f"torch {meta['torch']}, triton {meta['triton']}. {note}"]
    names = list(dict.fromkeys(r["provider"] for r in rows))
    for timing, heading in (("graph", "CUDA graph replay"), ("eager", "plain launches")):
        lines += ["", f"## {heading}", "", "| M x K x N | mode | " + " | ".join(names) + " | ratio |"]
        lines.append("|---|---|" + "---|" * (len(names) + 1))
        for (m, k, n, mode), group in itertools.groupby(rows, key=lambda r: (r["M"], r["K"], r["N"], r["mode"])):
            by = {r["provider"]: r[f"tflops_{timing}"] for r in group if f"tflops_{timing}" in r}
            cells = [f"{by[p]:.0f}" if p in by else "-" for p in names]
            lines.append(f"| {m} x {k} x {n} | {mode} | " + " | ".join(cells) + f" | {ratio(by) if by else '-'} |")
    return "\n".join(lines) + "\n"


def plot_tflops(rows: list[dict], meta: dict, path, shapes: list, modes: list, title: str) -> None:
    """TFLOP/s (graph timing): one panel per (M, K, N) shape, bars per mode and provider."""
    plot_bars(rows, meta, path, shapes, modes, "tflops_graph", "TFLOP/s, CUDA graph", f"{title}, {meta['device']}")


def plot_bars(rows: list[dict], meta: dict, path, shapes: list, modes: list, value: str, ylabel: str, title: str):
    """`value` (a graph-timing column) as bars per mode and provider, one panel per shape ((M, N) or (M, K, N), as
    the rows have them); GB/s panels show the run's copy bandwidth dashed."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4.5), sharey=True, squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        sub = [r for r in rows if tuple(r[k] for k in ("M", "K", "N") if k in r) == tuple(shape) and value in r]
        names = list(dict.fromkeys(r["provider"] for r in sub))
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            vals = [next((r[value] for r in sub if r["provider"] == name and r["mode"] == md), 0) for md in modes]
            ax.bar([j + i * width for j in range(len(modes))], vals, width, label=name)
        if value.startswith("gbps"):
            ax.axhline(meta["copy_gbps"], color="grey", ls="--", lw=1)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], modes, rotation=30, fontsize=8)
        ax.set_title(" x ".join(map(str, shape)), fontsize=9)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- a kernel's output with its float8 copy (kp_norms.norm_float8, glu_float8) against the op then a cast ----

E4M3 = torch.float8_e4m3fn
FLOAT8_MODES = ("fwd tensorwise", "fwd rowwise")


def torch_float8_cast(y: torch.Tensor, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 data and scale of y as torchao's dynamic recipes compute them, in PyTorch ops (for compile)."""
    yf = y.float()
    amax = yf.abs().amax(dim=-1, keepdim=True) if rowwise else yf.abs().amax()
    q = torch.finfo(E4M3).max / amax.clamp(min=1e-12)
    return (yf * q).clamp(-448.0, 448.0).to(E4M3), q.reciprocal()


def torchao_float8_cast():
    """fn(y, rowwise) -> (data, scale) by torchao's own cast (torchao.float8), or None (absent or another API:
    printed, not hidden)."""
    try:
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig
    except Exception as e:
        print(f"torchao float8 cast unavailable: {type(e).__name__}: {e}")
        return None

    def cast(y, rowwise):
        kind = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
        t = hp_tensor_to_float8_dynamic(
            y, E4M3, LinearMMConfig(), scaling_granularity=kind, axiswise_dim=-1 if rowwise else None
        )
        return t._data, t._scale

    return cast


def float8_output_run(kernel: str, shapes, providers_for, inputs_for, bytes_per_element: int, copy: float) -> None:
    """Time providers_for(n, granularity) (name -> fn(*inputs_for(m, n)), "kp" the fused op) on each shape and
    granularity, forward, both timings; GB/s of bytes_per_element * M * N; results as <kernel>.json / .md / .png."""
    rows = []
    for (m, n), granularity in progress(list(itertools.product(shapes, ("tensorwise", "rowwise"))), kernel):
        args = inputs_for(m, n)
        for name, fn in providers_for(n, granularity).items():
            row = dict(group="headline", M=m, N=n, mode=f"fwd {granularity}", provider=name)
            with torch.no_grad():
                call = lambda fn=fn, args=args: fn(*args)  # noqa: E731
                rows.append(timed(row, call, nbytes=bytes_per_element * m * n, copy_gbps=copy))
    meta = {"kernel": kernel, "dtype": "bfloat16", "copy_gbps": copy, **versions()}
    md = render(header(kernel, meta, "; forward, the output and its float8 copy"), meta, rows)
    slug = re.sub(r"[^a-z0-9]+", "_", kernel)
    out = write_results(
        slug,
        meta,
        rows,
        md,
        lambda path: plot_bars(rows, meta, path, shapes, FLOAT8_MODES, "gbps_graph", "GB/s", kernel),
    )
    print(md)
    print(f"wrote {out}/{slug}.*")
