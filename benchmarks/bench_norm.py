"""Row norms: kp vs the anchors (eager formula, native F.*, torch.compile, Liger-Kernel) in one run.

    python benchmarks/bench_norm.py                    # every kernel: headline shapes + N sweep
    python benchmarks/bench_norm.py --kernels layer_norm add_rms_norm --no-sweep
    python benchmarks/bench_norm.py --tune             # sweep kp's launch settings on the headline shapes
    python benchmarks/bench_norm.py --kernels rms_norm+float8   # the norm with its float8 copy (norm_float8)

GB/s counts the bytes the op must move (the Triton tutorials' convention), in bf16:
    norm forward 2*M*N*2 (read x, write y); forward+backward 5*M*N*2 (adds read x, read dy, write dx);
    add + norm forward 4*M*N*2 (read x, residual; write y, sum); forward+backward 8*M*N*2 (adds read dy,
    d(sum), sum; write one gradient, which is the input's and the residual's).
rms_norm+float8 (kp_norms.norm_float8: the output and its float8 copy, forward) counts 5*M*N bytes (read x, write
y in bf16 and its float8 copy), against kp's norm then kp's cast (once, and three times: a block's q, k and v
projections each casting the norm's output), torch.compile of the norm and a float8 cast, and torchao's cast
compiled with the norm.
Each case is timed two ways, every provider alike: replayed from a CUDA graph (the kernels' own speed)
and with plain launches under do_bench (what a Python loop that does nothing else sees: a ~100 us op is
then bound by the CPU's launch and autograd overhead, and the figure is noisy).
"""

from __future__ import annotations

import argparse
import itertools

import harness
import torch
import torch.nn.functional as F

import kp_core
import kp_norms

DTYPE = torch.bfloat16
EPS = 1e-6
HEADLINE = [(16384, 4096), (8192, 8192)]
SWEEP_N = [1024, 2048, 8192, 16384, 32768]
SWEEP_ELEMENTS = 64 << 20
KERNELS = ("rms_norm", "layer_norm", "add_rms_norm", "add_layer_norm", "rms_norm+silu", "rms_norm+float8")
BYTES = {"fwd": 2, "fwd+bwd": 5}  # per element per byte of dtype, for a plain norm
BYTES_ADD = {"fwd": 4, "fwd+bwd": 8}

# One compiled function per (kernel, width, grad mode): more than dynamo's default cache of 8 per function.
torch._dynamo.config.cache_size_limit = 256


def eager_rms(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


def eager_layer(x, w, b):
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    return ((xf - mu) * torch.rsqrt((xf - mu).pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w + b


def _liger(kind: str, n: int):
    """Liger-Kernel's module for this kernel, or None (absent or incompatible: printed, not hidden)."""
    try:
        if kind == "rms_norm":
            from liger_kernel.transformers.rms_norm import LigerRMSNorm

            return LigerRMSNorm(n, eps=EPS).to("cuda", DTYPE)
        if kind == "layer_norm":
            from liger_kernel.transformers.layer_norm import LigerLayerNorm

            return LigerLayerNorm(n, eps=EPS, bias=True).to("cuda", DTYPE)
        if kind == "add_rms_norm":
            from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm

            return LigerFusedAddRMSNorm(n, eps=EPS).to("cuda", DTYPE)
    except Exception as e:
        print(f"Liger-Kernel {kind} unavailable: {type(e).__name__}: {e}")
    return None


def providers(kind: str, n: int) -> dict:
    """name -> fn(x, r, w, b) returning a tensor or a tuple (for the add + norm ops)."""
    s = (n,)
    compile_ = lambda f: torch.compile(f, dynamic=False)  # noqa: E731
    if kind == "rms_norm":
        out = {
            "kp": lambda x, r, w, b: kp_norms.rms_norm(x, s, w, EPS),
            "F": lambda x, r, w, b: F.rms_norm(x, s, w, EPS),
            "eager": lambda x, r, w, b: eager_rms(x, w),
            "compile": compile_(lambda x, r, w, b: F.rms_norm(x, s, w, EPS)),
        }
    elif kind == "rms_norm+silu":
        out = {
            "kp": lambda x, r, w, b: kp_norms.rms_norm(x, s, w, EPS, activation="silu"),
            "F": lambda x, r, w, b: F.silu(F.rms_norm(x, s, w, EPS)),
            "kp then F.silu": lambda x, r, w, b: F.silu(kp_norms.rms_norm(x, s, w, EPS)),
            "compile": compile_(lambda x, r, w, b: F.silu(F.rms_norm(x, s, w, EPS))),
        }
    elif kind == "layer_norm":
        out = {
            "kp": lambda x, r, w, b: kp_norms.layer_norm(x, s, w, b, EPS),
            "F": lambda x, r, w, b: F.layer_norm(x, s, w, b, EPS),
            "eager": lambda x, r, w, b: eager_layer(x, w, b),
            "compile": compile_(lambda x, r, w, b: F.layer_norm(x, s, w, b, EPS)),
        }
    elif kind == "add_rms_norm":
        out = {
            "kp": lambda x, r, w, b: kp_norms.add_rms_norm(x, r, w, EPS),
            "add + F": lambda x, r, w, b: (F.rms_norm(x + r, s, w, EPS), x + r),
            "add + kp": lambda x, r, w, b: (kp_norms.rms_norm(h := x + r, s, w, EPS), h),
            "compile": compile_(lambda x, r, w, b: (F.rms_norm(h := x + r, s, w, EPS), h)),
        }
        liger_norm = _liger("rms_norm", n)
        if liger_norm is not None:
            out["add + liger"] = lambda x, r, w, b: (liger_norm(h := x + r), h)
    elif kind == "add_layer_norm":
        out = {
            "kp": lambda x, r, w, b: kp_norms.add_layer_norm(x, r, w, b, EPS),
            "add + F": lambda x, r, w, b: (F.layer_norm(h := x + r, s, w, b, EPS), h),
            "add + kp": lambda x, r, w, b: (kp_norms.layer_norm(h := x + r, s, w, b, EPS), h),
            "compile": compile_(lambda x, r, w, b: (F.layer_norm(h := x + r, s, w, b, EPS), h)),
        }
    else:
        raise ValueError(kind)
    liger = _liger(kind, n)
    if liger is not None:
        out["liger"] = (lambda x, r, w, b: liger(x, r)) if kind.startswith("add") else (lambda x, r, w, b: liger(x))
    return out


def _inputs(m, n, grad):
    def t(*shape):
        return torch.randn(*shape, device="cuda", dtype=DTYPE, requires_grad=grad)

    return t(m, n), t(m, n), t(n), t(n)


def _loss_fn(out, dys):
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, dys[: len(outs)])


def measure(fn, m: int, n: int, mode: str, graph: bool = False) -> float:
    bench = harness.bench_graph_ms if graph else harness.bench_ms
    x, r, w, b = _inputs(m, n, mode == "fwd+bwd")
    if mode == "fwd":
        with torch.no_grad():
            return bench(lambda: fn(x, r, w, b))
    dys = (torch.randn(m, n, device="cuda", dtype=DTYPE), torch.randn(m, n, device="cuda", dtype=DTYPE))
    return bench(lambda: _loss_fn(fn(x, r, w, b), dys), grad_to_none=[x, r, w, b])


def gbps(kind: str, m: int, n: int, mode: str, ms: float) -> float:
    factor = (BYTES_ADD if kind.startswith("add") else BYTES)[mode]
    return factor * m * n * DTYPE.itemsize / ms / 1e6


def check_correct(kind: str, m: int, n: int, fns: dict) -> None:
    """Sanity check before timing: kp agrees with PyTorch's own op (computed in fp64) at this size."""
    x, r, w, b = _inputs(m, n, False)
    ours = fns["kp"](x, r, w, b)
    ref_name = "F" if "F" in fns else "add + F"
    ref = fns[ref_name](*(t.double() for t in (x, r, w, b)))
    for a, e in zip(*(o if isinstance(o, tuple) else (o,) for o in (ours, ref))):
        err = (a.double() - e).abs().max().item()
        assert err < 0.05 * e.abs().max().item(), f"kp {kind} wrong at {m}x{n}: max err {err}"


def overhead_us(fn, n: int = 4096, rows: int = 8, iters: int = 200) -> dict:
    """Wall time per call on a tiny input, where only the CPU side (Python, dispatch, launches) counts."""
    x, r, w, b = _inputs(rows, n, True)
    dys = (torch.randn(rows, n, device="cuda", dtype=DTYPE),) * 2
    out = {}
    for mode in ("fwd", "fwd+bwd"):

        def call(mode=mode):
            if mode == "fwd":
                with torch.no_grad():
                    fn(x, r, w, b)
            else:
                x.grad = r.grad = w.grad = b.grad = None
                _loss_fn(fn(x, r, w, b), dys)

        out[mode] = harness.wall_us_per_call(call, iters)
    return out


def tune(kinds) -> None:
    """Sweep rows per program and warps of the fused kernels (and programs per SM of the backward) with
    kp_core.pin, on the headline shapes."""
    for kind, (m, n), mode in itertools.product(kinds, HEADLINE, ("fwd", "fwd+bwd")):
        kernel = "_norm_fwd" if mode == "fwd" else "_norm_bwd"
        results = []
        for rows, warps, per_sm in itertools.product((1, 2, 4), (4, 8, 16), (1, 2, 4) if mode != "fwd" else (1,)):
            if rows * n > 32768:
                continue
            kp_core.pin(kernel, block_rows=rows, num_warps=warps, programs_per_sm=per_sm)
            ms = measure(providers(kind, n)["kp"], m, n, mode, graph=True)
            results.append((gbps(kind, m, n, mode, ms), rows, warps, per_sm))
        kp_core.unpin(kernel)
        print(f"tune {kind} {m}x{n} {mode}: best GB/s, block_rows, num_warps, programs/SM")
        for r in sorted(results, reverse=True)[:4]:
            print(f"   {r[0]:7.0f}  {r[1]}  {r[2]:2d}  {r[3]}")


def run_kernel(kind: str, sweep: bool, copy: float) -> None:
    cases = [("headline", m, n, mode, ("graph", "eager")) for (m, n) in HEADLINE for mode in ("fwd", "fwd+bwd")]
    if sweep:
        cases += [("sweep", SWEEP_ELEMENTS // n, n, mode, ("graph",)) for n in SWEEP_N for mode in ("fwd", "fwd+bwd")]
    rows, by_width = [], {}
    for group, m, n, mode, timings in harness.progress(cases, kind):
        if n not in by_width:  # one set of providers (one torch.compile) per row width
            by_width[n] = providers(kind, n)
            check_correct(kind, m, n, by_width[n])
        for name, fn in by_width[n].items():
            row = dict(group=group, M=m, N=n, mode=mode, provider=name)
            for timing in timings:
                try:
                    ms = measure(fn, m, n, mode, graph=timing == "graph")
                except Exception as e:  # e.g. an anchor that cannot handle a width: recorded as missing
                    print(f"{name} ({timing}) failed at {m}x{n} {mode}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                bw = gbps(kind, m, n, mode, ms)
                row.update({f"ms_{timing}": ms, f"gbps_{timing}": bw, f"pct_copy_{timing}": 100 * bw / copy})
            rows.append(row)
    overhead = {name: overhead_us(fn) for name, fn in providers(kind, 4096).items()}
    meta = {"kernel": kind, "dtype": "bfloat16", "copy_gbps": copy, "cpu_overhead_us_8x4096": overhead}
    meta.update(harness.versions())
    md = harness.render(harness.header(meta["kernel"], meta), meta, rows)
    slug = kind.replace("+", "_")
    out = harness.write_results(
        slug,
        meta,
        rows,
        md,
        lambda path: harness.plot_modes(
            rows, meta, path, f"{meta['kernel']}, bf16,", "N (row width); 64M elements, or the headline shapes"
        ),
    )
    print(md)
    print(f"wrote {out}/{slug}.*")


def float8_providers(n: int, granularity: str) -> dict:
    """name -> fn(x, w): the norm's output and its float8 copy ("kp": norm_float8)."""
    import kp_precision

    rowwise = granularity == "rowwise"
    compile_ = lambda f: torch.compile(f, dynamic=False)  # noqa: E731

    def kp_then_casts(casts):
        def fn(x, w):
            y = kp_norms.rms_norm(x, (n,), w, EPS)
            return y, [kp_precision.quantize(y, granularity=granularity) for _ in range(casts)][0]

        return fn

    out = {
        "kp": lambda x, w: kp_norms.norm_float8(x, w, None, EPS, granularity=granularity),
        "kp norm + kp cast": kp_then_casts(1),
        "kp norm + 3 kp casts": kp_then_casts(3),
        "compile(norm + cast)": compile_(
            lambda x, w: (y := F.rms_norm(x, (n,), w, EPS), harness.torch_float8_cast(y, rowwise))
        ),
    }
    torchao = harness.torchao_float8_cast()
    if torchao is not None:
        out["torchao cast, compiled"] = compile_(lambda x, w: (y := F.rms_norm(x, (n,), w, EPS), torchao(y, rowwise)))
    return out


def float8_inputs(m: int, n: int):
    """x and w, after checking that norm_float8 is kp's norm then kp's cast, bit for bit, at this size."""
    import kp_precision

    x, _, w, _ = _inputs(m, n, False)
    for granularity in ("tensorwise", "rowwise"):
        fused = kp_norms.norm_float8(x, w, None, EPS, granularity=granularity)
        y = kp_norms.rms_norm(x, (n,), w, EPS)
        data = kp_precision.quantize(y, granularity=granularity).data
        same = torch.equal(fused.data.view(torch.uint8), data.view(torch.uint8)) and torch.equal(fused.output, y)
        assert same, f"norm_float8 differs from kp's norm then kp's cast at {m}x{n} {granularity}"
    return x, w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--no-sweep", action="store_true")
    args = parser.parse_args()
    harness.require_gpu()
    if args.tune:
        tune(args.kernels)
        return
    copy = harness.copy_bandwidth_gbps()
    print(f"device copy bandwidth this run: {copy:.0f} GB/s")
    for kind in args.kernels:
        if kind == "rms_norm+float8":  # read x, write y and its float8 copy
            harness.float8_output_run(kind, HEADLINE, float8_providers, float8_inputs, 5, copy)
        else:
            run_kernel(kind, not args.no_sweep, copy)


if __name__ == "__main__":
    main()
