"""Compile kp-attention's kernels for a GPU on a machine without one (Triton's frontend and ptxas), so errors
that the CPU interpreter cannot see show up before a GPU session.

    python benchmarks/compile_check_attention.py [--arch 90] [--all]

Prints registers' spills and shared memory per variant. --all sweeps every switch combination (minutes).
"""

from __future__ import annotations

import argparse
import itertools
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kp_attention.ops import attention_kernels as fk

PTRS = {"Q", "K", "V", "Out", "DO", "DK", "DV", "DQ"}
F32_PTRS = {"LSE", "DELTA", "DLSE"}
FLOATS = {"qk_scale", "sc_in", "sc_out", "scale"}
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel: large tiles for fp16/bf16 at D <= 128, small otherwise.
TILES = {
    "_attn_fwd": ((128, 64, 8, 3), (64, 32, 4, 2)),
    "_attn_bwd_dkdv": ((32, 128, 8, 3), (16, 32, 4, 1)),
    "_attn_bwd_dq": ((128, 32, 8, 3), (32, 16, 4, 1)),
}


def signature(fn, dtype: str, consts: dict, mask_ty: str) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in PTRS:
            sig[name] = "*" + dtype
        elif name in F32_PTRS:
            sig[name] = "*fp32"
        elif name == "MASK":
            sig[name] = mask_ty
        elif name.startswith("CU"):
            sig[name] = "*i32"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--all", action="store_true")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    if args.all:
        variants = itertools.product(
            ("fp16", "bf16", "fp32"),
            ((128, 128), (59, 64)),
            (False, True),
            (False, True),
            (False, True),
            (False, True),
            (0, 1, 2),
        )
    else:  # one variant per feature, every dtype
        variants = [(dt, (128, 128), False, False, False, False, 0) for dt in ("fp16", "bf16", "fp32")] + [
            ("bf16", (59, 64), True, True, True, True, 0),
            ("fp16", (128, 128), False, False, True, False, 1),
            ("fp16", (256, 256), False, False, False, False, 2),
        ]
    count = 0
    for dtype, (d, bd), varlen, left, right, softcap, mask_kind in variants:
        if mask_kind and varlen:
            continue
        mask_ty = "*u8" if mask_kind == 1 else "*fp32"
        base = dict(
            HEAD_DIM=d,
            BLOCK_D=bd,
            PAD_D=d != bd,
            VARLEN=varlen,
            BOTTOM_RIGHT=True,
            HAS_LEFT=left,
            HAS_RIGHT=right,
            SOFTCAP=softcap,
            MASK_KIND=mask_kind,
            IEEE=dtype == "fp32",
        )
        small = bd > 128 or dtype == "fp32"
        for name, tiles in TILES.items():
            bm, bn, warps, stages = tiles[1] if small else tiles[0]
            fn = getattr(fk, name)
            consts = dict(base, BLOCK_M=bm, BLOCK_N=bn)
            start = time.time()
            src = ASTSource(fn, signature(fn, dtype, consts, mask_ty), consts)
            kernel = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
            count += 1
            print(
                f"ok {name} {dtype} d={d} varlen={varlen} left={left} right={right} softcap={softcap} "
                f"mask={mask_kind} {time.time() - start:.1f}s shared={kernel.metadata.shared}",
                flush=True,
            )
    print(f"compiled {count} kernels for sm_{args.arch}")


if __name__ == "__main__":
    main()
