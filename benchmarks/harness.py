"""Shared benchmark plumbing: device ceilings, timing, progress, and the JSON/markdown/PNG outputs."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def require_gpu() -> None:
    if not torch.cuda.is_available():
        print("benchmarks need a CUDA/ROCm GPU; none found, nothing measured.")
        sys.exit(0)


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


def copy_bandwidth_gbps(nbytes: int = 1 << 30) -> float:
    """This run's device-to-device copy ceiling, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / ms / 1e6


def progress(items, desc: str):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stdout, mininterval=2.0)
    except ImportError:
        return items


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
