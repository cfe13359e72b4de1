"""Eager cost: CPU microseconds per call beside torch's own op, and plain-launch throughput, in one run (GPU).

    python benchmarks/cpu_overhead.py            # writes results/<device>/cpu_overhead.{json,md,png}

Part 1, CPU cost per call. On tiny inputs the GPU work takes a few microseconds, so the wall time of a call
(GPU drained before and after a loop of calls) is what the CPU spends: Python, checks, allocation, autograd,
Triton's launcher. Each op is timed beside torch's own: norms and SwiGLU on 8 x 4096, attention on
B1 S128 H8 D64 (causal), decode on B1 L1024 Hq32 Hkv8 D128 (q length 1), kp_precision.Float8Linear
(tensorwise and rowwise) beside a bf16 nn.Linear on 16 x 4096 -> 4096; bf16. Columns: forward under
no_grad (inference), forward in grad mode, forward + backward. Providers alternate over several rounds and
the median round is reported, so drift on a shared machine hits every provider alike.

Part 2, plain launches: do_bench (no CUDA graph) forward + backward GB/s at 16384 x 4096 and 8192 x 8192 for
rms_norm, layer_norm and add_rms_norm, kp vs F, with graph replay beside it (the kernels' own speed). Bytes:
norm fwd+bwd 5*M*N*2, add + norm fwd+bwd 8*M*N*2 (benchmarks/bench_norm.py's conventions).

Part 3, where kp's microseconds go: the pieces a call is made of, each timed alone.

    python benchmarks/cpu_overhead.py --profile   # cProfile of kp's eager calls, forward and backward threads
"""

import argparse
import contextlib
import json
import os
import statistics
from typing import Optional

import harness
import torch
import torch.nn.functional as F
import triton

import kp_attention
import kp_norms
from kp_attention.ops import decode as decode_mod

DTYPE = torch.bfloat16
ROWS, N = 8, 4096
ROUNDS = 5


def _t(*shape, grad=False, dtype=DTYPE):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)


# ---- part 1: CPU cost per call ----


def norm_cases(n: int = N):
    """(op -> {provider: fn(inputs) -> output(s)}, inputs factory) for rows of n columns."""
    s = (n,)

    def inputs():
        return dict(x=_t(ROWS, N, grad=True), r=_t(ROWS, N, grad=True), w=_t(N, grad=True), b=_t(N, grad=True))

    return {
        "rms_norm": {
            "kp": lambda i: kp_norms.rms_norm(i["x"], s, i["w"], 1e-6),
            "torch": lambda i: F.rms_norm(i["x"], s, i["w"], 1e-6),
        },
        "layer_norm": {
            "kp": lambda i: kp_norms.layer_norm(i["x"], s, i["w"], i["b"], 1e-6),
            "torch": lambda i: F.layer_norm(i["x"], s, i["w"], i["b"], 1e-6),
        },
        "add_rms_norm": {
            "kp": lambda i: kp_norms.add_rms_norm(i["x"], i["r"], i["w"], 1e-6),
            "torch": lambda i: (F.rms_norm(h := i["x"] + i["r"], s, i["w"], 1e-6), h),
        },
        "swiglu": {
            "kp": lambda i: kp_norms.swiglu(i["x"], i["r"]),
            "torch": lambda i: F.silu(i["x"]) * i["r"],
        },
    }, inputs


def attention_cases():
    def inputs():
        q, k, v = (_t(1, 128, 8, 64, grad=True) for _ in range(3))
        return dict(
            q=q,
            k=k,
            v=v,
            qt=q.detach().transpose(1, 2).contiguous().requires_grad_(),
            kt=k.detach().transpose(1, 2).contiguous().requires_grad_(),
            vt=v.detach().transpose(1, 2).contiguous().requires_grad_(),
        )

    return {
        "attention": {
            "kp": lambda i: kp_attention.flash_attention(i["q"], i["k"], i["v"], causal=True, backend="kp"),
            "torch": lambda i: F.scaled_dot_product_attention(i["qt"], i["kt"], i["vt"], is_causal=True),
        }
    }, inputs


def decode_cases():
    length, cap = 1024, 2048

    def unchecked(i):  # what a serving loop that guarantees cache_seqlens runs: no value check (no device sync)
        decode_mod.VALIDATE_VALUES = False
        try:
            return kp_attention.flash_attention_with_kvcache(i["q"], i["k_cache"], i["v_cache"], i["seqlens"])
        finally:
            decode_mod.VALIDATE_VALUES = True

    def inputs():
        k_cache, v_cache = _t(1, cap, 8, 128), _t(1, cap, 8, 128)
        return dict(
            q=_t(1, 1, 32, 128),
            k_cache=k_cache,
            v_cache=v_cache,
            seqlens=torch.full((1,), length, dtype=torch.int32, device="cuda"),
            qt=_t(1, 32, 1, 128),
            kt=k_cache[:, :length].transpose(1, 2).contiguous(),
            vt=v_cache[:, :length].transpose(1, 2).contiguous(),
        )

    sdpa = lambda i: F.scaled_dot_product_attention(i["qt"], i["kt"], i["vt"], enable_gqa=True)  # noqa: E731
    return {
        "decode": {
            "kp": lambda i: kp_attention.flash_attention_with_kvcache(i["q"], i["k_cache"], i["v_cache"], i["seqlens"]),
            "torch": sdpa,
        },
        "decode (no value check)": {"kp": unchecked, "torch": sdpa},
    }, inputs


def linear_cases():
    """Float8Linear (dynamic scaling) beside a bf16 nn.Linear, 16 x 4096 -> 4096: a float8 linear's forward and
    backward are a dozen kp ops (casts, transposes, scaled matmuls), each launched from Python."""
    import kp_precision

    base = torch.nn.Linear(N, N, bias=False, device="cuda", dtype=DTYPE)
    float8 = {
        f"float8_linear {recipe}": kp_precision.Float8Linear.from_linear(
            base, config=kp_precision.Float8Config(recipe=recipe)
        )
        for recipe in ("tensorwise", "rowwise")
    }

    def inputs():
        return dict(x=_t(16, N, grad=True))

    cases = {name: {"kp": lambda i, m=m: m(i["x"]), "torch": lambda i: base(i["x"])} for name, m in float8.items()}
    return cases, inputs


def _backward(out):
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


def _calls(fn, inputs, trainable: bool) -> dict:
    """mode -> a no-argument call of fn on fixed inputs."""
    grads = [t for t in inputs.values() if t.requires_grad]
    ones = {}

    def fwd_bwd():
        for t in grads:
            t.grad = None
        out = fn(inputs)
        outs = out if isinstance(out, tuple) else (out,)
        if "g" not in ones:  # one cotangent per output, made once
            ones["g"] = [torch.ones_like(o) for o in outs]
        torch.autograd.backward(outs, ones["g"])

    def fwd_no_grad():
        with torch.no_grad():
            fn(inputs)

    calls = {"fwd": fwd_no_grad}
    if trainable:
        calls["fwd (grad mode)"] = lambda: fn(inputs)
        calls["fwd+bwd"] = fwd_bwd
    return calls


def cpu_cost(iters: int) -> list[dict]:
    rows = []
    for cases, make, trainable in (
        (*norm_cases(), True),
        (*attention_cases(), True),
        (*decode_cases(), False),
        (*linear_cases(), True),
    ):
        for op, provs in cases.items():
            calls = {name: _calls(fn, make(), trainable) for name, fn in provs.items()}
            for mode in next(iter(calls.values())):
                samples = {name: [] for name in calls}
                for _ in range(ROUNDS):
                    for name in calls:
                        samples[name].append(harness.wall_us_per_call(calls[name][mode], iters))
                us = {name: statistics.median(v) for name, v in samples.items()}
                rows.append(
                    dict(op=op, mode=mode, **{f"us_{k}": v for k, v in us.items()}, ratio=us["kp"] / us["torch"])
                )
                print(
                    f"{op:12s} {mode:16s} kp {us['kp']:7.1f} us   torch {us['torch']:7.1f} us   "
                    f"ratio {us['kp'] / us['torch']:.2f}",
                    flush=True,
                )
    return rows


# ---- part 2: plain-launch throughput ----

SHAPES = [(16384, 4096), (8192, 8192)]


def plain_launch(copy: float) -> list[dict]:
    rows = []
    for op, (m, n) in [(op, s) for op in ("rms_norm", "layer_norm", "add_rms_norm") for s in SHAPES]:
        cases, _ = norm_cases(n)
        x, r, w, b = _t(m, n, grad=True), _t(m, n, grad=True), _t(n, grad=True), _t(n, grad=True)
        inputs = dict(x=x, r=r, w=w, b=b)
        factor = 8 if op.startswith("add") else 5
        for name, fn in cases[op].items():
            with torch.no_grad():  # output shapes only: no autograd graph may outlive this line
                outs = fn(inputs)
            dys = [torch.randn_like(o) for o in (outs if isinstance(outs, tuple) else (outs,))]

            def step(fn=fn, dys=dys, inputs=inputs):
                o = fn(inputs)
                torch.autograd.backward(o if isinstance(o, tuple) else (o,), dys)

            row = dict(op=op, M=m, N=n, provider=name)
            for timing, bench in (("plain", harness.bench_ms), ("graph", harness.bench_graph_ms)):
                ms = bench(step, grad_to_none=[x, r, w, b])
                gbps = factor * m * n * DTYPE.itemsize / ms / 1e6
                row.update({f"gbps_{timing}": gbps, f"pct_copy_{timing}": 100 * gbps / copy})
            rows.append(row)
            print(
                f"{op:12s} {m}x{n} {name:6s} plain {row['gbps_plain']:6.0f} GB/s   graph {row['gbps_graph']:6.0f}",
                flush=True,
            )
    return rows


# ---- part 3: where the microseconds go ----


@triton.jit
def _empty_kernel(X, N):
    pass


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


def _bare_forward(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x), x.new_empty((0,)), x.new_empty((0,))


def _bare_backward(
    dy: Optional[torch.Tensor], ds: Optional[torch.Tensor], x: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def pieces(iters: int) -> dict[str, float]:
    """The parts of one kp_norms.rms_norm call (8 x 4096 bf16, weight), each timed alone."""
    import kp_core
    from kp_core import launches
    from kp_norms import functional
    from kp_norms.ops import norm

    x = _t(ROWS, N, grad=True)
    w = _t(N, grad=True)
    xd, wd = x.detach(), w.detach()
    dy = torch.ones(ROWS, N, device="cuda", dtype=DTYPE)
    _, _, _, rstd = norm.forward(xd, None, wd, None, 1e-6, True, 0.0, False, 0, True)

    def fwd_bwd(fn):
        def step():
            x.grad = w.grad = None
            fn().backward(dy)

        return step

    def jit(fn):  # the same call with Triton's own dispatcher instead of kp's direct call
        def call():
            launches._FAST = False
            try:
                fn()
            finally:
                launches._FAST = True

        return call

    # kp_core.op's own cost: an op whose launchers only allocate (kp::norm's four outputs and three gradients).
    bare = kp_core.op(
        "kp_bench::bare",
        _bare_forward,
        lambda x, w: (torch.empty_like(x), torch.empty_like(x), x.new_empty((0,)), x.new_empty((0,))),
        backward=_bare_backward,
        backward_fake=lambda dy, ds, x, w: (torch.empty_like(x), torch.empty_like(w)),
        save=lambda args, outputs: (args[0], args[1]),
        grad_inputs=("x", "w"),
        differentiable_outputs=2,
        package="benchmarks",
        spec="none",
        dtypes=(DTYPE,),
    )
    launcher = lambda: norm.forward(xd, None, wd, None, 1e-6, True, 0.0, False, 0, False)  # noqa: E731
    backward = lambda: norm.backward(dy, None, xd, wd, None, rstd, rstd, 1e-6, True, 0.0, False, 0, True)  # noqa: E731
    parts = {
        "torch.empty (8 x 4096 bf16)": lambda: torch.empty((ROWS, N), device="cuda", dtype=DTYPE),
        "Triton JIT launch, empty kernel (2 args)": lambda: _empty_kernel[(1,)](dy, 1),
        "x * 1 fwd+bwd (builtin op, autograd)": fwd_bwd(lambda: x * 1),
        "autograd.Function identity fwd+bwd": fwd_bwd(lambda: _Identity.apply(x)),
        "kp_core.op with allocating launchers (4 outputs) fwd+bwd": fwd_bwd(lambda: bare(x, w)[0]),
        "kp: argument checks of rms_norm": lambda: functional._check("op", xd, (N,), wd, None, 1e-6),
        "kp: choose_backend": lambda: kp_core.choose_backend("op", xd),
        "kp: forward launcher (alloc + launch), direct call": launcher,
        "kp: forward launcher, Triton's JIT dispatcher": jit(launcher),
        "kp: backward launcher (2 launches), direct call": backward,
        "kp: backward launcher, Triton's JIT dispatcher": jit(backward),
        "kp: rms_norm fwd, no grad": lambda: kp_norms.rms_norm(xd, (N,), wd, 1e-6),
        "kp: rms_norm fwd+bwd": fwd_bwd(lambda: kp_norms.rms_norm(x, (N,), w, 1e-6)),
    }
    parts["torch: F.rms_norm fwd+bwd"] = fwd_bwd(lambda: F.rms_norm(x, (N,), w, 1e-6))
    out = {}
    # CUDA backward runs on autograd's device thread: Python work there (kp's backward) pays for the hand-off
    # between cores; the same calls without that thread, and with every thread on one core, show how much.
    for where, context in (
        ("", contextlib.nullcontext),
        (", autograd device thread off", lambda: torch.autograd.set_multithreading_enabled(False)),
        (", every thread on one core", _one_core),
    ):
        for name, fn in parts.items():
            if where and "fwd+bwd" not in name:
                continue
            with context():
                out[name + where] = statistics.median(harness.wall_us_per_call(fn, iters) for _ in range(3))
            print(f"{name + where:80s} {out[name + where]:7.1f} us", flush=True)
    return out


@contextlib.contextmanager
def _one_core():
    """Every thread of this process (autograd's device thread included) on the main thread's first core."""
    threads = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
    core = min(os.sched_getaffinity(0))
    for t in threads:
        os.sched_setaffinity(t, {core})
    try:
        yield
    finally:
        for t, cpus in threads.items():
            try:
                os.sched_setaffinity(t, cpus)
            except OSError:  # the thread has ended
                pass


def profile(iters: int, top: int = 30) -> None:
    """cProfile of kp's calls per mode. On Python 3.12+ one profiler sees every thread (autograd runs CUDA
    backward on its own device thread). Times are inflated by the profiler; the shares are what to read."""
    import cProfile

    norms, make_norm = norm_cases()
    linears, make_linear = linear_cases()
    picked = [(norms[op], make_norm, op) for op in ("rms_norm", "layer_norm")]
    picked += [(linears[op], make_linear, op) for op in linears]
    for provs, make, op in picked:
        for mode, call in _calls(provs["kp"], make(), True).items():
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            plain = harness.wall_us_per_call(call, iters)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(iters):
                call()
            torch.cuda.synchronize()
            prof.disable()
            prof.create_stats()
            print(f"\n===== {op} {mode}: {plain:.1f} us per call unprofiled; us per call: tottime cumtime ncalls")
            for (file, line, fn), (_cc, nc, tt, ct, _callers) in sorted(prof.stats.items(), key=lambda kv: -kv[1][2])[
                :top
            ]:
                print(
                    f"{1e6 * tt / iters:8.2f} {1e6 * ct / iters:8.2f} {nc / iters:5.1f}  "
                    f"{file.rsplit('/', 1)[-1]}:{line}({fn})"
                )


# ---- output ----


def render(meta: dict, cost: list[dict], plain: list[dict], parts: dict) -> str:
    lines = [
        f"# Eager cost: kp vs torch, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}; measured copy bandwidth {meta['copy_gbps']:.0f} GB/s.",
        "",
        "## CPU cost per call (µs, median of rounds)",
        "",
        "norms and swiglu 8 x 4096; attention B1 S128 H8 D64 causal; decode B1 L1024 Hq32 Hkv8 D128, q length 1.",
        "",
        "| op | mode | kp | torch | kp / torch |",
        "|---|---|---|---|---|",
    ]
    for r in cost:
        lines.append(f"| {r['op']} | {r['mode']} | {r['us_kp']:.1f} | {r['us_torch']:.1f} | {r['ratio']:.2f} |")
    lines += [
        "",
        "## Plain launches: forward + backward GB/s (% of copy)",
        "",
        "| op | M x N | provider | do_bench (plain) | CUDA graph replay |",
        "|---|---|---|---|---|",
    ]
    for r in plain:
        lines.append(
            f"| {r['op']} | {r['M']} x {r['N']} | {r['provider']} | {r['gbps_plain']:.0f} ({r['pct_copy_plain']:.0f}%) "
            f"| {r['gbps_graph']:.0f} ({r['pct_copy_graph']:.0f}%) |"
        )
    lines += ["", "## Where the microseconds go", "", "| piece | µs |", "|---|---|"]
    lines += [f"| {name} | {us:.1f} |" for name, us in parts.items()]
    return "\n".join(lines) + "\n"


def plot(cost: list[dict], meta: dict, path) -> None:
    import matplotlib.pyplot as plt

    labels = [f"{r['op']}\n{r['mode']}" for r in cost]
    xs = range(len(cost))
    fig, ax = plt.subplots(figsize=(max(8, len(cost) * 0.7), 4.5))
    ax.bar([x - 0.2 for x in xs], [r["us_kp"] for r in cost], 0.4, label="kp")
    ax.bar([x + 0.2 for x in xs], [r["us_torch"] for r in cost], 0.4, label="torch")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("CPU µs per call")
    ax.set_title(f"Eager cost per call, bf16, {meta['device']}")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--tag", default="", help="suffix for the result files (e.g. -before)")
    parser.add_argument("--skip-plain", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print cProfile tables of kp's calls; write nothing")
    args = parser.parse_args()
    harness.require_gpu()
    if args.profile:
        profile(args.iters)
        return
    copy = harness.copy_bandwidth_gbps()
    cost = cpu_cost(args.iters)
    plain = [] if args.skip_plain else plain_launch(copy)
    parts = pieces(args.iters)
    meta = {"copy_gbps": copy, "iters": args.iters, "rounds": ROUNDS, **harness.versions()}
    md = render(meta, cost, plain, parts)
    name = f"cpu_overhead{args.tag}"
    out = harness.write_results(name, meta, cost + plain, md, lambda p: plot(cost, meta, p))
    (out / f"{name}.json").write_text(
        json.dumps({**meta, "cpu_cost": cost, "plain_launch": plain, "pieces_us": parts}, indent=1) + "\n"
    )
    print(md)


if __name__ == "__main__":
    main()
