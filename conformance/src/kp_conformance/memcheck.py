"""The specs under compute-sanitizer, on a CUDA machine. memcheck (the default): every out-of-bounds or
misaligned access of every kernel a spec launches, reads included (the canary guard sees writes only);
`--tool racecheck`: shared-memory data races (the reductions of the norms, quantize's amax, split partials);
`--tool initcheck`: reads of device memory nothing wrote (a workspace or partial buffer read before it is filled).

    python -m kp_conformance.memcheck                       # every spec that covers kernels, micro tier
    python -m kp_conformance.memcheck --tier small --specs norm glu --jobs 8
    python -m kp_conformance.memcheck --tier small --specs norm --shards 4 --only 0 1   # half of norm's shards
    python -m kp_conformance.memcheck --specs sparsity --list   # the processes it would run; runs nothing
    python -m kp_conformance.memcheck --tool racecheck --specs norm quantize decode flex_attention

The specs and their dtypes come from the spec registry (kp_conformance.registry): any declared spec can be named;
by default those whose ops are registered kp kernels run. Each spec runs as one pytest process per dtype (plus one
for its dtype-free tests), in parallel: memcheck does not follow pytest-xdist's workers. `--shards N` splits each
of those selections into N processes by test id (round robin over the collected ids), and `--only` runs some
shard numbers, so a long tier can be spread over several calls of a machine with a per-call time limit.

The processes run with KP_MEMCHECK=1 (the conftest then turns the canary guard off and keeps PyTorch's reference
SDPA off cuDNN, see specs/conftest.py) and without PyTorch's caching allocator, so each tensor is its own
allocation and an access past it is an error memcheck reports. Exit status 1 when any process reports an error
or a failed test.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from kp_conformance import registry
from kp_conformance.env import dtype_id

ERRORS = re.compile(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error")
TOOLS = ("memcheck", "racecheck", "initcheck")


def _tool_args(tool: str) -> list[str]:
    if tool == "memcheck":
        return ["--tool", "memcheck", "--leak-check", "no"]
    if tool == "racecheck":
        return ["--tool", "racecheck", "--racecheck-report", "hazard"]
    return ["--tool", "initcheck"]


def _selections(dtypes) -> list[tuple[str, str]]:
    """(label, -k expression): one per dtype, then the tests no dtype names ("float16" is inside "bfloat16")."""
    sel = [(d, f"{d} and not bfloat16" if d == "float16" else d) for d in dtypes]
    if dtypes:
        sel.append(("other", " and ".join(f"not {d}" for d in ("float16", "float32", "float64"))))
    else:
        sel.append(("all", ""))
    return sel


def _ids(root: Path, selection: list[str], env: dict) -> list[str]:
    """The test ids a selection collects (no sanitizer needed to collect)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
        "--collect-only",
        "-q",
        *selection,
    ]
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    # pytest prints ids relative to the directory of the ini file it found, so name the file ourselves
    return [f"{selection[0]}::{line.split('::', 1)[1]}" for line in out.stdout.splitlines() if "::" in line]


def _run(root: Path, spec: str, label: str, args: list[str], tier: str, timeout: int, logs: Path, tool: str) -> dict:
    env = dict(os.environ, KP_MEMCHECK="1", KP_GUARD="0", PYTORCH_NO_CUDA_MEMORY_CACHING="1", KP_TIER=tier)
    env["KP_REPORT_DIR"] = str(logs / f"report-{spec}-{label}")
    cmd = ["compute-sanitizer", *_tool_args(tool), "--report-api-errors", "no"]
    cmd += ["--print-limit", "20", sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += ["--rootdir", str(root), "-W", "ignore", *args]  # paths and ids relative to root, the working directory
    log = logs / f"{tool}-{spec}-{label}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        # its own process group: on a timeout the sanitizer and the pytest under it both go
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    text = log.read_text(errors="replace")
    errors = sum(int(a or b) for a, b in ERRORS.findall(text))
    tests = re.findall(r"^=+ (\d+ (?:passed|failed|skipped|error).*?) in [\d.]+s", text, re.M)
    if rc == "timeout":  # what finished before the limit, so the rest can be rerun by id
        tests = [f"{len(re.findall(r' PASSED', text))} passed before the timeout"]
    # pytest 5 = nothing selected (a spec whose tests all name a dtype)
    ok = errors == 0 and rc in (0, 5)
    return dict(
        spec=spec,
        sel=label,
        rc=rc,
        errors=errors,
        tests=tests[-1] if tests else "-",
        ok=ok,
        seconds=round(time.monotonic() - start),
        log=str(log),
    )


def jobs(args, specs: dict) -> list[tuple[str, str, list[str]]]:
    """(spec, label, pytest arguments) of each process: a spec's selections (one per dtype of its Spec, then the
    rest), each split into --shards processes by test id when asked."""
    out = []
    for name in args.specs:
        for label, expr in _selections([dtype_id(d) for d in specs[name].dtypes]):
            selection = [registry.spec_file(name)] + (["-k", expr] if expr else [])
            if args.shards == 1:
                out.append((name, label, selection))
                continue
            ids = _ids(args.root, selection, dict(os.environ, KP_TIER=args.tier))
            for n in args.only if args.only is not None else range(args.shards):
                if ids[n :: args.shards]:
                    out.append((name, f"{label}.{n}", ids[n :: args.shards]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path.cwd())
    ap.add_argument("--specs", nargs="+", help="spec names (default: every spec that covers kp kernels)")
    ap.add_argument("--tier", default="micro")
    ap.add_argument("--tool", choices=TOOLS, default="memcheck")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    ap.add_argument("--logs", type=Path, default=Path("memcheck-logs"))
    ap.add_argument("--shards", type=int, default=1, help="processes per spec and dtype")
    ap.add_argument("--only", type=int, nargs="+", help="run these shard numbers (0 .. shards-1)")
    ap.add_argument("--list", action="store_true", help="print the processes (spec, selection, pytest arguments)")
    args = ap.parse_args(argv)
    specs = registry.load_specs(args.root)
    args.specs = args.specs or registry.kernel_specs(specs)
    unknown = [name for name in args.specs if name not in specs]
    if unknown:
        ap.error(f"argument --specs: no such spec {unknown} (choose from {', '.join(sorted(specs))})")
    if args.list:
        for spec, label, selection in jobs(args, specs):
            print(f"{spec} [{label}]: pytest {shlex.join(selection)}")
        return 0
    if shutil.which("compute-sanitizer") is None:
        print("compute-sanitizer not on PATH (it ships with the CUDA toolkit, e.g. /usr/local/cuda/bin)")
        return 2
    args.logs.mkdir(parents=True, exist_ok=True)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        run = [(args.root, *j, args.tier, args.timeout, args.logs, args.tool) for j in jobs(args, specs)]
        futures = [pool.submit(_run, *r) for r in run]
        results = [f.result() for f in futures]
    print(f"{args.tool}, tier {args.tier}:")
    print(f"| spec | tests | {args.tool} errors | exit | seconds |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['spec']} [{r['sel']}] | {r['tests']} | {r['errors']} | {r['rc']} | {r['seconds']} |")
    bad = [r for r in results if not r["ok"]]
    for r in bad:
        print(f"not clean: {r['spec']} [{r['sel']}], see {r['log']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
