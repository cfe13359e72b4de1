"""2:4 prune + pack (kp_sparsity.pack_2_4) against PyTorch's own conversions and the copy bandwidth, one run.

    python benchmarks/bench_sparsity.py          # writes results/<device>/sparsity.{json,md,png}
    python benchmarks/bench_sparsity.py --tune   # sweep kp's tile (BLOCK_M, BLOCK_K, num_warps) with kp_core.pin

Weights of the Llama MLP shapes in bf16, magnitude selection. GB/s count the bytes the fused pass must move:
the weight read (2 bytes an entry) and the packed values (1) and metadata (1/8) written. Providers:
- kp pack_2_4: choose, prune and pack in one kernel;
- torch prune + pack: the plain-PyTorch 2:4 choice (topk of |w| per group), then torch's CUTLASS converter
  (sparse_semi_structured_from_dense_cutlass, what to_sparse_semi_structured runs for CUTLASS);
- torch._sparse_semi_structured_tile: PyTorch's fused prune + pack kernel (it also packs the transpose, so it
  writes twice the output: its GB/s count the same bytes as kp's, and it is the anchor to beat).
Then F.linear at Llama MLP shapes, dense bf16 against kp's 2:4 weight, and the router's choice there.
Times are CUDA-graph replays (GPU time only), median.
"""

from __future__ import annotations

import argparse
import itertools

import harness
import torch
from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

import kp_core
import kp_sparsity

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (8192, 8192)]


def torch_prune(w):
    """2:4 magnitude pruning in plain PyTorch: per group of 4, the topk 2 of |w| kept."""
    groups = w.view(w.shape[0], -1, 4)
    top = groups.abs().topk(2, dim=-1).indices
    return torch.zeros_like(groups).scatter_(-1, top, groups.gather(-1, top)).view_as(w)


def torch_prune_pack(w):
    return sparse_semi_structured_from_dense_cutlass(torch_prune(w))


def main() -> None:
    harness.require_gpu()
    copy = harness.copy_bandwidth_gbps()
    rows = []
    for m, k in SHAPES:
        w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nbytes = m * k * 2 + m * k + m * k // 8
        # the ceiling at this size: a copy moving the same bytes (half read, half written), timed as kp's kernel is
        same = harness.copy_bandwidth_gbps(nbytes // 2, timer=harness.bench_graph_ms)
        providers = {
            "kp pack_2_4": lambda w=w: kp_sparsity.pack_2_4(w),
            "torch prune + CUTLASS converter": lambda w=w: torch_prune_pack(w),
            "torch._sparse_semi_structured_tile": lambda w=w: torch._sparse_semi_structured_tile(w, "", True),
        }
        for name, fn in providers.items():
            try:
                ms = harness.bench_graph_ms(fn)
            except Exception as err:  # an anchor this build lacks is reported, not dropped
                rows.append(dict(shape=f"{m}x{k}", provider=name, failed=f"{type(err).__name__}: {err}"[:160]))
                print(f"{m}x{k} {name}: failed: {rows[-1]['failed']}", flush=True)
                continue
            gbps = nbytes / ms / 1e6
            pct, pct_same = 100 * gbps / copy, 100 * gbps / same
            rows.append(dict(shape=f"{m}x{k}", provider=name, ms=ms, gbps=gbps, pct_copy=pct, pct_same=pct_same))
            print(f"{m}x{k:<6} {name:36s} {ms * 1e3:8.1f} us {gbps:7.0f} GB/s ({pct:5.1f} %, {pct_same:5.1f} %)")
    rows += linear_rows()
    meta = {"kernel": "sparsity", "op": "pack_2_4", "dtype": "bfloat16", "copy_gbps": copy}
    harness.publish("sparsity", meta, rows, render, plot)


LINEAR = [(8192, 8192, 8192), (8192, 11008, 4096), (8192, 4096, 11008), (8192, 14336, 4096), (8192, 4096, 14336)]


def linear_rows() -> list[dict]:
    """F.linear at Llama MLP shapes (tokens M, out N, in K): dense bf16 against kp's 2:4 weight (kp prunes,
    cuSPARSELt or CUTLASS multiplies, as to_sparse_2_4 picks) with torch's default cuSPARSELt algorithm and with
    the one sparsify's router picks, and what the router decides; then fp8 (e4m3, per-tensor scales): dense
    torch._scaled_mm against its 2:4 form on cuSPARSELt."""
    import torch.nn.functional as F

    rows = []
    for m, n, k in LINEAR:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        pruned, sparse = kp_sparsity.prune_2_4(w), kp_sparsity.to_sparse_2_4(w)
        dense_r, sparse_r, alg = kp_sparsity.linear.measure(n, k, torch.bfloat16, m, x.device)
        tuned = kp_sparsity.to_sparse_2_4(w)
        if alg is not None:
            tuned.alg_id_cusparselt = alg
        try:
            timing = "graph"
            dense_ms, sparse_ms, tuned_ms = (
                harness.bench_graph_ms(lambda x=x, p=p: F.linear(x, p)) for p in (pruned, sparse, tuned)
            )
        except Exception as err:  # a 2:4 matmul that cannot be captured: all timed with plain launches
            print(f"linear {m}x{n}x{k}: CUDA-graph timing failed ({type(err).__name__}); plain launches", flush=True)
            timing = "eager"
            dense_ms, sparse_ms, tuned_ms = (
                harness.bench_ms(lambda x=x, p=p: F.linear(x, p)) for p in (pruned, sparse, tuned)
            )
        tflops = 2 * m * n * k / 1e9
        row = dict(
            shape=f"{m}x{n}x{k}",
            dense_ms=dense_ms,
            sparse_ms=sparse_ms,
            speedup=dense_ms / sparse_ms,
            tuned_ms=tuned_ms,
            tuned_speedup=dense_ms / tuned_ms,
            alg_id=alg,
            dense_tflops=tflops / dense_ms,
            router="sparse" if sparse_r < dense_r else "dense",
            router_ms=(dense_r, sparse_r),
            backend=type(sparse).__name__,
            timing=timing,
            **fp8_times(pruned, x),
        )
        rows.append(row)
        print(
            f"linear {row['shape']:18s} dense {dense_ms * 1e3:7.1f} us, 2:4 {sparse_ms * 1e3:7.1f} us: "
            f"{row['speedup']:.2f}x, with alg {alg} {tuned_ms * 1e3:7.1f} us: {row['tuned_speedup']:.2f}x; "
            f"router: {row['router']} (measured {dense_r:.3f} / {sparse_r:.3f} ms) ({row['backend']}); "
            f"fp8 dense {row.get('fp8_dense_ms', 0) * 1e3:.1f} us, fp8 2:4 {row.get('fp8_sparse_ms', 0) * 1e3:.1f} us",
            flush=True,
        )
    return rows


def fp8_times(pruned, x) -> dict:
    """ms of x W^T in e4m3 with unit per-tensor scales, dense (torch._scaled_mm) and with W 2:4 on cuSPARSELt
    (torch's semi-structured _scaled_mm, sparse operand first: (W x^T)^T); plain launches (a failed CUDA-graph
    capture of the sparse one left the generator in capture mode)."""
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT

    f8, one = torch.float8_e4m3fn, torch.ones((), device=x.device)
    w8, x8 = pruned.to(f8), x.to(f8)
    try:
        w8s = SparseSemiStructuredTensorCUSPARSELT.from_dense(w8)
        dense = harness.bench_ms(lambda: torch._scaled_mm(x8, w8.t(), one, one, out_dtype=torch.bfloat16))
        sparse = harness.bench_ms(lambda: torch._scaled_mm(w8s, x8.t(), one, one, out_dtype=torch.bfloat16))
    except Exception as err:
        return {"fp8_failed": f"{type(err).__name__}: {err}"[:160]}
    return {"fp8_dense_ms": dense, "fp8_sparse_ms": sparse}


def tune() -> None:
    harness.require_gpu()
    for m, k in [(4096, 4096), (14336, 4096), (8192, 8192)]:
        w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        nbytes = m * k * 2 + m * k + m * k // 8
        results = []
        for bm, bk, warps in itertools.product((32, 64, 128), (64, 128, 256, 512), (2, 4, 8)):  # packing: bm % 32 == 0
            if bm * bk > 65536:
                continue
            with kp_core.pinned("_prune_2_4", block_m=bm, block_k=bk, num_warps=warps):
                ms = harness.bench_graph_ms(lambda w=w: kp_sparsity.pack_2_4(w))
            results.append((nbytes / ms / 1e6, bm, bk, warps))
        results.sort(reverse=True)
        best = [tuple(round(v) for v in r) for r in results[:5]]
        print(f"tune {m}x{k}: best GB/s, BLOCK_M, BLOCK_K, num_warps: {best}", flush=True)


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# 2:4 prune + pack, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}; copy bandwidth {meta['copy_gbps']:.0f} GB/s. GB/s count "
        "the weight read and the packed values and metadata written (3.125 bytes an entry); CUDA-graph replay. "
        "% of copy: of that 1 GiB copy's bandwidth; % of same-size copy: of a copy moving the same bytes, timed the "
        "same way.",
        "",
        "| shape | provider | us | GB/s | % of copy | % of same-size copy |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "speedup" in r:
            continue
        if "failed" in r:
            lines.append(f"| {r['shape']} | {r['provider']} | failed: {r['failed']} | | | |")
        else:
            lines.append(
                f"| {r['shape']} | {r['provider']} | {r['ms'] * 1e3:.1f} | {r['gbps']:.0f} | {r['pct_copy']:.1f} "
                f"| {r['pct_same']:.1f} |"
            )
    lines += [
        "",
        "## F.linear, dense bf16 against kp's 2:4 weight (tokens x out x in), CUDA-graph replay",
        "",
        "| shape | dense us | dense TFLOP/s | 2:4 us | speed-up | 2:4 us, router's cuSPARSELt alg | speed-up "
        "| router (sparsify, auto) | fp8 dense us (eager) | fp8 2:4 us (eager) | fp8 2:4 vs fp8 dense "
        "| 2:4 backend | timing |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "speedup" in r:
            fp8 = (
                [
                    f"{r['fp8_dense_ms'] * 1e3:.1f}",
                    f"{r['fp8_sparse_ms'] * 1e3:.1f}",
                    f"{r['fp8_dense_ms'] / r['fp8_sparse_ms']:.2f}x",
                ]
                if "fp8_dense_ms" in r
                else [f"failed: {r.get('fp8_failed', '')}", "", ""]
            )
            lines.append(
                f"| {r['shape']} | {r['dense_ms'] * 1e3:.1f} | {r['dense_tflops']:.0f} | {r['sparse_ms'] * 1e3:.1f} | "
                f"{r['speedup']:.2f}x | {r['tuned_ms'] * 1e3:.1f} (alg {r['alg_id']}) | {r['tuned_speedup']:.2f}x | "
                f"{r['router']} | " + " | ".join(fp8) + f" | {r['backend']} | {r['timing']} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    pack = [r for r in rows if "speedup" not in r]
    harness.plot_grouped(pack, path, "shape", "gbps", "GB/s", f"2:4 prune + pack, bf16, {meta['device']}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--tune", action="store_true")
    tune() if parser.parse_args().tune else main()
