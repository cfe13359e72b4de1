"""A/B of two versions of the norm kernels in one process: the working tree's against another file of them.

    git show HEAD~1:packages/kp-norms/src/kp_norms/ops/norm_kernels.py > /tmp/old_norm_kernels.py
    python benchmarks/ab_norm_kernels.py /tmp/old_norm_kernels.py --out ab.json

bf16 forward + backward of kp's five norm kernels, replayed from a CUDA graph, each cell the median of runs
alternated between the two versions (a separate process per version would compare two GPU clock states).
Ratio: ms of the other version / ms of the working tree's; below 1 the working tree's is slower.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics

import bench_norm
import harness

import kp_norms.ops.norm as norm

SHAPES = [(16384, 4096), (8192, 8192), (65536, 1024), (2048, 32768)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("other", help="a norm_kernels.py to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="ab_norm_kernels.json")
    args = parser.parse_args()
    harness.require_gpu()
    spec = importlib.util.spec_from_file_location("other_norm_kernels", args.other)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    versions = {"other": other, "tree": norm.kernels}
    rows = []
    for kind in bench_norm.KERNELS:
        for m, n in SHAPES:
            fn = bench_norm.providers(kind, n)["kp"]
            ms = {name: [] for name in versions}
            for _ in range(args.rounds):
                for name, kernels in versions.items():
                    norm.kernels = kernels  # the launchers look their kernels up here on every call
                    ms[name].append(bench_norm.measure(fn, m, n, "fwd+bwd", graph=True))
            norm.kernels = versions["tree"]
            a, b = statistics.median(ms["other"]), statistics.median(ms["tree"])
            rows.append(dict(kernel=kind, M=m, N=n, ms_other=a, ms_tree=b, ratio=a / b, samples=ms))
            print(f"{kind:15s} {m} x {n}: other {a:.4f} ms, tree {b:.4f} ms, ratio {a / b:.3f}", flush=True)
    meta = dict(copy_gbps=harness.copy_bandwidth_gbps(), **harness.versions())
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
