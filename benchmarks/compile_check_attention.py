"""Compile kp-attention's kernels for a GPU on a machine without one (Triton's frontend, ptxas and cuobjdump, all
shipped with Triton), so errors the CPU interpreter cannot see show up before a GPU session, and a change to the
kernels' source can be checked for what it does to the machine code.

    python benchmarks/compile_check_attention.py [--arch 90] [--all]
    python benchmarks/compile_check_attention.py --base 3074327      # SASS of each variant, this tree vs a revision

Each variant is compiled with the launchers' own tile settings (kp_attention.ops.attention) and a dense
(4, 4096, 16, D) layout (unit last stride, the others multiples of 16, as Triton specialises them at launch).
Printed per variant: SASS instruction count, registers, stack bytes (spills included), shared memory. With --base
the same variants are compiled from the revision's kernels (found by name, whichever module holds them) in a
subprocess, and each is reported as the same SASS or as the difference in instruction counts. --all sweeps every
switch combination (minutes).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("_attn_fwd", "_attn_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")
# modules that hold the kernels, newest layout first (a --base revision may predate the split)
MODULES = ("kp_attention.ops.attention_fwd_kernels", "kp_attention.ops.attention_bwd_kernels")
OLD_MODULES = ("kp_attention.ops.attention_kernels",)
TRITON = tuple(int(x) for x in triton.__version__.split(".")[:2])
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
B, S, H = 4, 4096, 16
# (dtype, head dim, varlen, bottom_right, window left, window right (causal), softcap, mask kind)
FEATURES = [
    ("bf16", 128, False, False, False, False, False, 0),  # non-causal
    ("bf16", 128, False, False, False, True, False, 0),  # causal (SDPA's top-left)
    ("bf16", 128, False, True, True, True, False, 0),  # sliding window
    ("bf16", 128, True, True, False, True, False, 0),  # varlen causal
    ("fp16", 64, False, True, False, True, True, 0),  # softcap
    ("bf16", 128, False, False, False, False, False, 1),  # boolean mask
    ("fp16", 96, False, False, False, False, False, 2),  # float mask, padded head dim
    ("fp32", 64, False, True, False, True, False, 0),  # the fp32 path
    ("fp32", 128, True, True, True, True, True, 2),
    ("bf16", 256, False, True, False, True, False, 0),
]


def kernel(name: str):
    for module in MODULES + OLD_MODULES:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise LookupError(f"no kp-attention kernel named {name}")


def arguments(dt: str, d: int, varlen: bool, br: bool, left: bool, right: bool, softcap: bool, mask: int) -> dict:
    """Every kernel argument by name: ("ptr", type), an int (1 is specialised to a constant), a float, or the value
    of a constexpr."""
    ieee = dt == "fp32"
    bd = max(16, 1 << (d - 1).bit_length())
    st = {"b": 0 if varlen else S * H * d, "s": H * d, "h": d, "d": 1}
    args = dict(
        MASK=("ptr", {0: "fp32", 1: "u8", 2: dt}[mask]),
        CU_Q=("ptr", "i32" if varlen else "fp32"),
        CU_K=("ptr", "i32" if varlen else "fp32"),
        LSE=("ptr", "fp32"),
        DLSE=("ptr", "fp32"),
        DELTA=("ptr", "fp64" if ieee else "fp32"),
        LSE_FIX=("ptr", "fp64"),
        slb=0 if varlen else H * S,
        slh=B * S if varlen else S,
        smb=H * S * S if mask else 0,
        smh=S * S if mask else 0,
        smq=S if mask else 0,
        smk=1 if mask else 0,
        seqlen_q=S,
        seqlen_k=S,
        group=2,
        scale=0.088,
        qk_scale=0.127,
        sc_in=1.0,
        sc_out=1.0,
        window_left=255 if left else -1,
        window_right=0 if right else -1,
        HEAD_DIM=d,
        BLOCK_D=bd,
        PAD_D=d != bd,
        VARLEN=varlen,
        BOTTOM_RIGHT=br,
        HAS_LEFT=left,
        HAS_RIGHT=right,
        SOFTCAP=softcap,
        MASK_KIND=mask,
        IEEE=ieee,
        HAS_DLSE=False,
        ROWSUM=not ieee,
        # switches off in every variant here: dropout, paged k/v, TMA loads, the exact delta
        SEED=("ptr", "i64"),
        BT=("ptr", "fp32"),
        drop_threshold=0,
        drop_scale=1.0,
        sbt=0,
        num_blocks=1,
        DROPOUT=False,
        PAGED=False,
        PAGE=1,
        TMA=False,
        EXACT_DELTA=False,
    )
    for ptr, prefix in (
        ("Q", "sq"),
        ("K", "sk"),
        ("V", "sv"),
        ("Out", "so"),
        ("DO", "sd"),
        ("DQ", "sdq"),
        ("DK", "sdk"),
        ("DV", "sdv"),
    ):
        args[ptr] = ("ptr", dt)
        args.update({prefix + axis: value for axis, value in st.items()})
    return args


def source(fn, args: dict):
    """The ASTSource a launch with these arguments compiles (Triton's specialisation: 1 becomes a constant,
    pointers and multiples of 16 get the divisibility hint)."""
    constexpr = {p.num for p in fn.params if p.is_constexpr}
    sig, consts, hints = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = args[name]
        if i in constexpr or (isinstance(value, int) and value == 1):
            consts[name] = value
            sig[name] = "constexpr"
        elif isinstance(value, tuple):
            sig[name], hints[i] = "*" + value[1], 16
        elif isinstance(value, int):
            sig[name] = "i32"
            if value % 16 == 0:
                hints[i] = 16
        else:
            sig[name] = "fp32"
    if TRITON >= (3, 3):
        return ASTSource(fn, sig, consts, {(i,): [["tt.divisibility", 16]] for i in hints})
    from triton.backends.compiler import AttrsDescriptor  # Triton 3.2: signature without constexprs

    hints.update({i: 1 for i, n in enumerate(fn.arg_names) if sig[n] == "constexpr" and i not in constexpr})
    sig = {n: t for n, t in sig.items() if t != "constexpr"}
    return ASTSource(fn, sig, consts, AttrsDescriptor.from_hints(hints))


def sass(cubin: bytes) -> tuple[list[str], dict]:
    """(instructions, resource usage) of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([BIN / "cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    code = [re.sub(r"\s+", " ", m[1]) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", text)]
    usage = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", res)}
    return code, usage


def compile_all(arch: int, variants) -> dict:
    from kp_attention.ops.attention import _tiles_for  # the launchers' tile settings

    target = GPUTarget("cuda", arch, 32)
    out = {}
    for variant in variants:
        args = arguments(*variant)
        bd, size = args["BLOCK_D"], 4 if variant[0] == "fp32" else 2
        for name in KERNELS:
            tiles = _tiles_for(name, bd, size, "cuda", 0)
            args.update(BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"])
            options = {"num_warps": tiles["num_warps"], "num_stages": tiles["num_stages"]}
            compiled = triton.compile(source(kernel(name), args), target=target, options=options)
            code, usage = sass(compiled.asm["cubin"])
            out[f"{name} {variant}"] = dict(
                sha=hashlib.sha1("\n".join(code).encode()).hexdigest(),
                n=len(code),
                ops=collections.Counter(c.split(" ")[0] for c in code),
                regs=usage.get("REG"),
                stack=usage.get("STACK"),
                smem=compiled.metadata.shared,
            )
    return out


def at_revision(rev: str, argv: list[str]) -> dict:
    """compile_all over a revision's kp-attention and kp-core sources, in a subprocess (its own imports)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = ["packages/kp-attention/src", "packages/kp-core/src"]
        archive = subprocess.run(["git", "-C", ROOT, "archive", rev, *paths], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        # the revision's kp-attention and kp-core first; the rest (this Triton) as in this process
        rev_paths = [str(Path(tmp) / p) for p in paths]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*rev_paths, os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, __file__, "--json", str(Path(tmp) / "out.json"), *argv]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "out.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--all", action="store_true")
    parser.add_argument("--base", help="a git revision to compare the SASS of every variant against")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # where at_revision's subprocess writes its results
    args = parser.parse_args()
    if args.all:
        variants = [
            (dt, d, varlen, True, left, right, softcap, mask)
            for dt, d, varlen, left, right, softcap, mask in itertools.product(
                ("fp16", "bf16", "fp32"),
                (128, 59),
                (False, True),
                (False, True),
                (False, True),
                (False, True),
                (0, 1, 2),
            )
            if not (mask and varlen) and not (mask == 1 and dt == "fp32")  # as the launchers never pass
        ]
    else:
        variants = FEATURES
    results = compile_all(args.arch, variants)
    if args.json:
        Path(args.json).write_text(json.dumps(results))
        return
    base = at_revision(args.base, [a for a in sys.argv[1:] if a not in ("--base", args.base)]) if args.base else {}
    same = 0
    print(
        f"triton {triton.__version__}, sm_{args.arch}: {len(results)} kernels"
        + (f", against {args.base}" if base else "")
    )
    for key, r in results.items():
        line = f"{key:72s} instr {r['n']:5d} regs {r['regs']} stack {r['stack']} smem {r['smem']}"
        if key in base:
            b = base[key]
            same += b["sha"] == r["sha"]
            ops = {op: r["ops"].get(op, 0) - b["ops"].get(op, 0) for op in set(r["ops"]) | set(b["ops"])}
            diff = ", ".join(f"{op} {n:+d}" for op, n in sorted(ops.items()) if n)
            line += "  same SASS" if b["sha"] == r["sha"] else f"  base instr {b['n']} stack {b['stack']} {diff}"
        print(line, flush=True)
    if base:
        print(f"{same} of {len(results)} kernels compile to the same SASS as {args.base}")


if __name__ == "__main__":
    main()
