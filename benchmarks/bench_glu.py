"""SwiGLU: kp vs the anchors (eager F.silu(g) * u, torch.compile, Liger-Kernel) in one run.

    python benchmarks/bench_glu.py            # headline shapes + N sweep, writes results/<device>/glu.*
    python benchmarks/bench_glu.py --tune     # sweep kp's tile settings (kp_core.pin) on the headline shapes
    python benchmarks/bench_glu.py --tune --float8    # the same for glu_float8's two kernels
    python benchmarks/bench_glu.py --float8   # glu_float8: the output with its float8 copy, forward

gate and up are M x N each. GB/s counts the bytes the op must move: forward 3*M*N*elsize (read gate and up,
write y); forward+backward 8*M*N*elsize (adds read dy, gate, up; write dgate, dup): the bytes the op must move.
`kp packed` reads gate and up as the two halves of one M x 2N tensor (swiglu_packed) and writes one gradient.

--float8 counts 7*M*N bytes (read gate and up, write y in bf16 and its float8 copy) for kp_norms.glu_float8, against
kp's swiglu then kp's cast, torch.compile of swiglu and a float8 cast, and torchao's cast compiled with swiglu.

Each case is timed two ways, every provider alike: replayed from a CUDA graph (the kernels' own speed) and with
plain launches under do_bench (what a Python loop that does nothing else sees, CPU overhead included).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import harness
import torch
import torch.nn.functional as F

import kp_core
import kp_norms
from kp_norms.ops import glu as glu_mod

DTYPE = torch.bfloat16
HEADLINE = [(16384, 14336), (8192, 8192)]
SWEEP_N = [512, 1024, 2048, 4096, 8192, 11008, 14336, 16384, 28672]
SWEEP_ELEMENTS = 64 << 20


def eager(g, u):
    return F.silu(g) * u


torch._dynamo.config.cache_size_limit = 256  # one graph per (shape, grad mode)


def providers() -> dict:
    """name -> (fn, packed): a packed provider takes one M x 2N tensor instead of (gate, up)."""
    out = {
        "kp": (kp_norms.swiglu, False),
        "kp packed": (kp_norms.swiglu_packed, True),
        "eager": (eager, False),
        "compile": (torch.compile(eager, dynamic=False), False),
    }
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        out["liger"] = (LigerSiLUMulFunction.apply, False)
    except Exception as e:  # absent or incompatible: reported, not hidden
        print(f"Liger-Kernel unavailable: {type(e).__name__}: {e}")
    return out


def inputs(m: int, n: int, packed: bool, grad: bool) -> tuple[torch.Tensor, ...]:
    if packed:
        return (torch.randn(m, 2 * n, device="cuda", dtype=DTYPE, requires_grad=grad),)
    return tuple(torch.randn(m, n, device="cuda", dtype=DTYPE, requires_grad=grad) for _ in range(2))


def measure(provider, m: int, n: int, mode: str, graph: bool = False) -> float:
    fn, packed = provider
    bench = harness.bench_graph_ms if graph else harness.bench_ms
    args = inputs(m, n, packed, grad=mode == "fwd+bwd")
    if mode == "fwd":
        with torch.no_grad():
            return bench(lambda: fn(*args))
    dy = torch.randn(m, n, device="cuda", dtype=DTYPE)
    return bench(lambda: fn(*args).backward(dy), grad_to_none=list(args))


def gbps(m: int, n: int, mode: str, ms: float) -> float:
    factor = 3 if mode == "fwd" else 8
    return factor * m * n * DTYPE.itemsize / ms / 1e6


def check_correct(m: int, n: int) -> None:
    """Before timing: kp's output and gradients are within twice eager's error from a float64 reference."""
    g, u, dy = (torch.randn(m, n, device="cuda", dtype=DTYPE) for _ in range(3))
    results = {}
    for name, fn in (("kp", kp_norms.swiglu), ("eager", eager)):
        gg, ug = g.clone().requires_grad_(), u.clone().requires_grad_()
        y = fn(gg, ug)
        y.backward(dy)
        results[name] = (y.detach(), gg.grad, ug.grad)
    g64, u64 = g.double().requires_grad_(), u.double().requires_grad_()
    y64 = eager(g64, u64)
    y64.backward(dy.double())
    for what, ours, theirs, ref in zip(("y", "dgate", "dup"), *results.values(), (y64.detach(), g64.grad, u64.grad)):
        err, err_eager = ((t.double() - ref).abs().max().item() for t in (ours, theirs))
        bound = 2 * err_eager + torch.finfo(DTYPE).eps * max(1.0, ref.abs().max().item())
        assert err <= bound, f"kp swiglu {what} wrong at {m}x{n}: max err {err:.3e} > {bound:.3e}"
    del g64, u64, y64


def overhead_us(provider, n: int = 4096, rows: int = 8, iters: int = 200) -> dict:
    """Wall time per call on a tiny input, where only the CPU side (Python, dispatch, launches) counts."""

    fn, packed = provider
    args = inputs(rows, n, packed, grad=True)
    dy = torch.randn(rows, n, device="cuda", dtype=DTYPE)
    out = {}
    for mode in ("fwd", "fwd+bwd"):

        def call(mode=mode):
            if mode == "fwd":
                with torch.no_grad():
                    fn(*args)
            else:
                for a in args:
                    a.grad = None
                fn(*args).backward(dy)

        out[mode] = harness.wall_us_per_call(call, iters)
    return out


def tune() -> None:
    kp = providers()["kp"]
    for (m, n), mode in itertools.product(HEADLINE, ("fwd", "fwd+bwd")):
        results = []
        kernel = "_glu_fwd" if mode == "fwd" else "_glu_bwd"
        for elements, block_n, warps in itertools.product(
            (1024, 2048, 4096, 8192, 16384), (256, 512, 1024, 2048, 4096), (4, 8, 16)
        ):
            if elements < block_n:
                continue
            kp_core.pin(kernel, elements=elements, max_block_n=block_n, num_warps=warps)
            ms = measure(kp, m, n, mode, graph=True)
            results.append((gbps(m, n, mode, ms), elements // block_n, block_n, warps))
        kp_core.unpin(kernel)
        default = glu_mod.TILES[kernel]
        print(f"tune {m}x{n} {mode} (default {default}): best GB/s, block_m, block_n, num_warps")
        for r in sorted(results, reverse=True)[:6]:
            print(f"   {r[0]:7.0f}  {r[1]:2d}  {r[2]:4d}  {r[3]:2d}")


def tune_float8() -> None:
    """glu_float8's two kernels, one after the other: the forward's tiles (the cast at its default), then the
    cast's (the forward at its best), each granularity on the headline shapes."""
    for kernel in ("_glu_fwd_float8", "_glu_cast_float8"):
        for (m, n), granularity in itertools.product(HEADLINE, ("tensorwise", "rowwise")):
            g, u = inputs(m, n, False, False)
            results = []
            for elements, block_n, warps in [(1024, 1024, 8)] + list(
                itertools.product((2048, 4096, 8192, 16384), (1024, 2048, 4096), (4, 8, 16))
            ):
                if elements < block_n:
                    continue
                kp_core.pin(kernel, elements=elements, max_block_n=block_n, num_warps=warps)
                with torch.no_grad():
                    call = functools.partial(kp_norms.glu_float8, g, u, granularity=granularity)
                    ms = harness.bench_graph_ms(call)
                results.append((ms, elements // block_n, block_n, warps))
            kp_core.unpin(kernel)
            best = min(results)
            kp_core.pin(kernel, elements=best[1] * best[2], max_block_n=best[2], num_warps=best[3])
            print(f"tune {kernel} {m}x{n} {granularity} (default {glu_mod.TILES[kernel]}): ms, block_m, block_n, warps")
            for r in sorted(results)[:5]:
                print(f"   {r[0]:.4f}  {r[1]:2d}  {r[2]:4d}  {r[3]:2d}")
    kp_core.unpin()


def float8_providers(n: int, granularity: str) -> dict:
    """name -> fn(g, u): swiglu's output and its float8 copy ("kp": glu_float8)."""
    import kp_precision

    rowwise = granularity == "rowwise"
    compile_ = lambda f: torch.compile(f, dynamic=False)  # noqa: E731
    out = {
        "kp": lambda g, u: kp_norms.glu_float8(g, u, granularity=granularity),
        "kp swiglu + kp cast": lambda g, u: (
            y := kp_norms.swiglu(g, u),
            kp_precision.quantize(y, granularity=granularity),
        ),
        "compile(swiglu + cast)": compile_(lambda g, u: (y := eager(g, u), harness.torch_float8_cast(y, rowwise))),
    }
    torchao = harness.torchao_float8_cast()
    if torchao is not None:
        out["torchao cast, compiled"] = compile_(lambda g, u: (y := eager(g, u), torchao(y, rowwise)))
    return out


def float8_inputs(m: int, n: int):
    """gate and up, after checking that glu_float8 is kp's swiglu then kp's cast, bit for bit, at this size."""
    import kp_precision

    g, u = inputs(m, n, False, False)
    for granularity in ("tensorwise", "rowwise"):
        fused = kp_norms.glu_float8(g, u, granularity=granularity)
        y = kp_norms.swiglu(g, u)
        data = kp_precision.quantize(y, granularity=granularity).data
        same = torch.equal(fused.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(fused.output, y)
        assert same, f"glu_float8 differs from kp's swiglu then kp's cast at {m}x{n} {granularity}"
    return g, u


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--float8", action="store_true", help="glu_float8 against swiglu then a cast, instead")
    args = parser.parse_args()
    harness.require_gpu()
    if args.tune:
        tune_float8() if args.float8 else tune()
        return
    copy = harness.copy_bandwidth_gbps()
    print(f"device copy bandwidth this run: {copy:.0f} GB/s")
    if args.float8:
        harness.float8_output_run("swiglu+float8", HEADLINE, float8_providers, float8_inputs, 7, copy)
        return
    cases = [("headline", m, n, mode) for (m, n) in HEADLINE for mode in ("fwd", "fwd+bwd")]
    if not args.no_sweep:
        cases += [("sweep", SWEEP_ELEMENTS // n, n, mode) for n in SWEEP_N for mode in ("fwd", "fwd+bwd")]
    provs = providers()
    rows = []
    checked = set()
    for group, m, n, mode in harness.progress(cases, "glu"):
        if (m, n) not in checked:
            check_correct(m, n)
            checked.add((m, n))
        for name, provider in provs.items():
            row = dict(group=group, M=m, N=n, mode=mode, provider=name)
            for timing in ("graph", "eager"):
                try:
                    ms = measure(provider, m, n, mode, graph=timing == "graph")
                except Exception as e:  # e.g. an anchor that cannot handle a width: recorded as missing
                    print(f"{name} ({timing}) failed at {m}x{n} {mode}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                bw = gbps(m, n, mode, ms)
                row.update({f"ms_{timing}": ms, f"gbps_{timing}": bw, f"pct_copy_{timing}": 100 * bw / copy})
            rows.append(row)
    overhead = {name: overhead_us(p) for name, p in provs.items()}
    meta = {
        "kernel": "glu",
        "op": "swiglu",
        "dtype": "bfloat16",
        "copy_gbps": copy,
        "cpu_overhead_us_8x4096": overhead,
        **harness.versions(),
    }
    md = harness.render(harness.header("SwiGLU", meta, "; bytes: fwd 3*M*N*2, fwd+bwd 8*M*N*2"), meta, rows)
    out = harness.write_results(
        "glu",
        meta,
        rows,
        md,
        lambda path: harness.plot_modes(
            [r for r in rows if r["group"] == "sweep"], meta, path, "SwiGLU, bf16, 64M elements,", "N (gate / up width)"
        ),
    )
    print(md)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
