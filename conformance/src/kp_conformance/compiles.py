"""KP_COMPILES=FILE: one line per Triton compile request (test, kernel, disk-cache hit or miss, seconds).

A cold GPU tier is bound by Triton's compiles (each dtype, block size, constexpr switch and divisibility class a
spec draws is its own kernel variant), and a warm one should compile next to nothing: this log shows which tests
and kernels pay, and whether a warm run misses the on-disk cache (a kernel's cache key moving between processes).
Every process (the xdist controller and each worker) appends its own lines to FILE; the controller sums them in
its terminal summary. Columns: unix time, pid, test node id, kernel, `miss` / `hit`, seconds, the variant's cache
key (two misses with one key: two processes compiled the same variant at once).
"""

from __future__ import annotations

import collections
import functools
import os
import time

_TEST = ["<collection>"]  # the running test's node id (a worker runs one test at a time)


def path() -> str | None:
    """The log's path (KP_COMPILES), or None when a run does not log its compiles."""
    return os.environ.get("KP_COMPILES") or None


def install() -> bool:
    """Wrap Triton's `compile` (a kernel binds it at its first launch, after this) and the front end a disk-cache
    miss runs (`ASTSource.make_ir`), so each request is timed and marked hit or miss. False without Triton."""
    if path() is None:
        return False
    try:
        import triton.compiler as front
        import triton.compiler.compiler as compiler
    except ImportError:
        return False
    if getattr(compiler.compile, "_kp_logged", False):
        return True
    missed = [False]  # one compile at a time per process (Triton's async compile mode, unused here, would blur it)
    make_ir = compiler.ASTSource.make_ir

    @functools.wraps(make_ir)
    def make_ir_logged(self, *args, **kwargs):
        missed[0] = True
        return make_ir(self, *args, **kwargs)

    compile_ = compiler.compile

    @functools.wraps(compile_)
    def compile_logged(src, *args, **kwargs):
        missed[0] = False
        start = time.perf_counter()
        kernel = compile_(src, *args, **kwargs)
        seconds = time.perf_counter() - start
        name = getattr(src, "name", None) or type(src).__name__
        key = getattr(kernel, "hash", None) or getattr(getattr(kernel, "metadata", None), "hash", "?")
        _write(name, "miss" if missed[0] else "hit", seconds, key)
        return kernel

    compile_logged._kp_logged = True
    compiler.ASTSource.make_ir = make_ir_logged
    compiler.compile = front.compile = compile_logged
    return True


def running(nodeid: str) -> None:
    """The test whose compiles the next lines are (from the plugin, as a test starts)."""
    _TEST[0] = nodeid


def _write(kernel: str, outcome: str, seconds: float, key: str) -> None:
    with open(path(), "a") as f:  # opened per line: a killed run keeps every line written
        f.write(f"{time.time():.2f}\t{os.getpid()}\t{_TEST[0]}\t{kernel}\t{outcome}\t{seconds:.3f}\t{key}\n")


def summary(log: str, top: int = 5) -> list[str]:
    """The log's totals: misses and hits with their seconds, misses of a variant already compiled (by another
    process at the same time), and the kernels that missed most."""
    if not os.path.exists(log):
        return [f"kp compiles: {log} has no compiles"]
    count = collections.Counter()
    seconds = collections.Counter()
    kernels = collections.Counter()
    keys = collections.Counter()
    again = 0.0  # seconds of the misses after a variant's first
    with open(log) as f:
        for line in f:
            _, _, _, kernel, outcome, s, key = line.rstrip("\n").split("\t")
            count[outcome] += 1
            seconds[outcome] += float(s)
            if outcome == "miss":
                kernels[kernel] += 1
                keys[key] += 1
                again += float(s) if keys[key] > 1 else 0.0
    twice = count["miss"] - len(keys)
    lines = [
        f"kp compiles ({log}): {count['miss']} missed the disk cache ({seconds['miss']:.0f} s), "
        f"{twice} of them a variant compiled already ({again:.0f} s), {count['hit']} loaded from it "
        f"({seconds['hit']:.0f} s)"
    ]
    if kernels:
        lines.append("kp compiles, most missed: " + ", ".join(f"{k} {n}" for k, n in kernels.most_common(top)))
    return lines
