"""End to end, decoding: bench_e2e.py's Hugging Face Llama generating greedily, kp.optimize(mode="infer") against
eager and torch.compile's reduce-overhead, in one run.

    python benchmarks/bench_e2e_decode.py --model demo          # GPU: batch 1 / 16 / 64, context 1k-32k
    python benchmarks/bench_e2e_decode.py --model demo --batches 1 --contexts 1024 4096
    python benchmarks/bench_e2e_decode.py --smoke               # CPU: a tiny model, the mechanics only

Variants, each from the same bf16 weights and the same random prompts:
- eager: `generate` as it comes (a dynamic KV cache);
- compile reduce-overhead: Hugging Face's own recipe, a static KV cache with which `generate` compiles the decode
  step (`CompileConfig(mode="reduce-overhead", fullgraph=True)`: CUDA graphs through inductor); the cache holds
  context + N positions in both timed calls of a cell, so the step compiles once per cell;
- kp.optimize: `kp.optimize(model, (one token per sequence,), mode="infer")`, so its choices are timed at the
  decode step's shapes, then eager `generate`; kp's attention is left out (`deny=["attention"]`: its HF drop-in
  serves training and prefill shapes, not a cache the model updates);
- kp.optimize + compile reduce-overhead: its choices timed by kp.compiled_timer(mode="reduce-overhead") (layers
  by kp.graph_timer, the GPU's time alone, as the decode steps will run from CUDA graphs; the never-slower check on
  the whole step compiled so, host time included: kp's layers are weighed against what inductor makes of PyTorch's
  and against the guards they add), then the static-cache compiled recipe.
Decode tokens/s = batch x (N - 1) / (t(N) - t(1)), t(n) the least time of --repeats calls of `generate` of n new
tokens from the same prompt: the prefill and the first token cancel. A cell's variants are timed round by round
(every variant once per round): a batch-1 step is host-bound and drifts by 30 % and more within a minute, and
interleaved rounds expose every variant to the same drift. "GPU ms per step" is the GPU's busy time per decode step
(the profiler's kernel time of N tokens minus that of 1, over N - 1): what kernels can save at most. "same
tokens" is the share of generated tokens equal to eager's (greedy; float8 layers may change some). Cells whose KV
cache would pass --max-tokens (batch x context) are skipped and listed. Results are written after every cell (a
run cut short keeps what it measured); the last run's rows on this device of cells not measured now (and with
--only, of the other variants) are kept, each with its time of measurement: a grid can be measured in several
calls.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import time

import demo
import harness
import torch
from bench_e2e import MODELS, SMOKE

import kp

VARIANTS = ("eager", "compile reduce-overhead", "kp.optimize", "kp.optimize + compile reduce-overhead")


def generate(model, prompt, n: int, compiled: bool, cache_len: int) -> torch.Tensor:
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if compiled:
        from transformers import CompileConfig, StaticCache

        # one cache length for every call of a cell, so that its decode step compiles once
        kwargs.update(
            past_key_values=StaticCache(config=model.config, max_cache_len=cache_len),
            compile_config=CompileConfig(mode="reduce-overhead", fullgraph=True),
        )
    with torch.no_grad():
        return model.generate(prompt, **kwargs)


def seconds(model, prompt, n: int, compiled: bool, cache_len: int) -> tuple[float, torch.Tensor]:
    if prompt.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = generate(model, prompt, n, compiled, cache_len)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def gpu_ms_per_step(model, prompt, n: int, compiled: bool, cache_len: int) -> float | None:
    """The GPU's busy time per decode step: the profiler's kernel time for n new tokens minus that for 1."""
    if not prompt.is_cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    busy = {}
    for k in (1, n):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(model, prompt, k, compiled, cache_len)
            torch.cuda.synchronize()
        busy[k] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    return (busy[n] - busy[1]) / (n - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="demo")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--new", type=int, default=64, help="tokens generated per timed call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=2**20, help="skip cells with batch x context above this")
    ap.add_argument("--only", nargs="+", choices=VARIANTS, help="run these variants only")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, nothing written")
    args = ap.parse_args()
    if not args.smoke:
        harness.require_gpu()
    device = torch.device("cpu" if args.smoke else "cuda")
    cfg = SMOKE if args.smoke else MODELS[args.model]
    batches, contexts, new = ([2], [16], 4) if args.smoke else (args.batches, args.contexts, args.new)
    repeats = 1 if args.smoke else args.repeats
    torch.manual_seed(0)
    base, what = demo.build({k: v for k, v in cfg.items() if k not in ("batch", "seq")})
    base.config.max_position_embeddings = max(contexts) + new
    base = base.to(device=device, dtype=torch.float32 if args.smoke else torch.bfloat16).eval()
    meta = {"kernel": f"e2e_decode_{args.model}", "model": what, "dtype": "bf16", "new_tokens": new}
    skipped = [(b, c) for b in batches for c in contexts if b * c > args.max_tokens]
    cells = [(b, c) for b in batches for c in contexts if b * c <= args.max_tokens]
    # the last run's rows of cells (and, with --only, variants) not measured now stay: a grid in several calls
    rows = [
        r
        for r in ([] if args.smoke else harness.last_rows(meta["kernel"]))
        if (r["batch"], r["context"]) not in cells or (args.only and r["variant"] not in args.only)
    ]
    eager_tokens = {}
    chosen = [v for v in VARIANTS if not args.only or v in args.only or v == "eager"]
    models = {v: copy.deepcopy(base) for v in chosen}
    compiled = {v: v.endswith("reduce-overhead") and not args.smoke for v in chosen}  # no CUDA graphs on the CPU
    # every variant's compiled decode step stays cached through a cell (the variants' models share forward's code)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 8 * len(chosen))
    for batch, context in cells if args.smoke else harness.progress(cells, "cells"):
        g = torch.Generator().manual_seed(batch * 100003 + context)
        prompt = torch.randint(cfg["vocab"], (batch, context), generator=g).to(device)
        torch._dynamo.reset()  # the last cell's compiled steps, graphs and their memory go
        reports, outs = {}, {}
        times = {(v, n): [] for v in chosen for n in (1, new)}
        for variant in chosen:
            model = models[variant]
            if variant.startswith("kp.optimize"):
                kp.restore(model)
                deny = ["attention"] + (["float8", "sparsity"] if args.smoke else [])
                # decode steps graphed: layers by the GPU's time alone, the whole step compiled as generate will
                timer = kp.compiled_timer(mode="reduce-overhead") if compiled[variant] else None
                reports[variant] = kp.optimize(
                    model, (prompt[:, -1:],), mode="infer", deny=deny, timer=timer, report=False
                )
            for n in (1, new):  # warm-up: compilation, graph capture, cuDNN's plan for each KV length
                generate(model, prompt, n, compiled[variant], context + new)
        for _ in range(repeats):  # round by round: every variant meets the same drift of the machine
            for variant in chosen:
                for n in (1, new):
                    t, outs[variant] = seconds(models[variant], prompt, n, compiled[variant], context + new)
                    times[variant, n].append(t)
        for variant in chosen:
            model, report = models[variant], reports.get(variant)
            t1, tn = min(times[variant, 1]), min(times[variant, new])
            gpu_ms = gpu_ms_per_step(model, prompt, new, compiled[variant], context + new)
            generated = outs[variant][:, context:]
            if variant == "eager":
                eager_tokens[batch, context] = generated
            same = (generated == eager_tokens[batch, context]).float().mean().item()
            row = dict(model=args.model, variant=variant, batch=batch, context=context, new_tokens=new)
            row.update(
                decode_tokens_per_s=batch * (new - 1) / max(tn - t1, 1e-9),
                ms_per_token=(tn - t1) / (new - 1) * 1e3,
                prefill_ms=t1 * 1e3,
                gpu_ms_per_step=gpu_ms,
                same_tokens=same,
                measured=time.strftime("%Y-%m-%d %H:%M"),
            )
            if report is not None:
                row.update(optimize_s=report.seconds, chosen=report.chosen, step=report.step)
            print(
                f"{variant:38s} batch {batch:3d} context {context:6d}: {row['decode_tokens_per_s']:9.0f} tok/s "
                f"({row['ms_per_token']:.2f} ms/step"
                + (f", GPU {gpu_ms:.2f}" if gpu_ms else "")
                + f"), same tokens {same:.0%}",
                flush=True,
            )
            if args.smoke or variant != "eager" or not args.only or "eager" in args.only:
                rows = [r for r in rows if (r["variant"], r["batch"], r["context"]) != (variant, batch, context)]
                rows.append(row)
            if not args.smoke:
                publish(meta, rows, skipped, echo=False)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del models
    if args.smoke:
        import triton

        print(render({**meta, "device": "cpu", "torch": torch.__version__, "triton": triton.__version__}, rows, []))
    else:
        publish(meta, rows, skipped, echo=True)


def publish(meta: dict, rows: list[dict], skipped: list, echo: bool) -> None:
    harness.publish(meta["kernel"], meta, rows, lambda m, r: render(m, r, skipped), plot, echo=echo)


def render(meta: dict, rows: list[dict], skipped: list) -> str:
    cells = sorted({(r["batch"], r["context"]) for r in rows})
    names = [v for v in VARIANTS if any(r["variant"] == v for r in rows)]
    by = {(r["variant"], r["batch"], r["context"]): r for r in rows}
    lines = [
        f"# End to end, decoding, {meta['model']}, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}; bf16; greedy, {meta['new_tokens']} new tokens per timed "
        "call. Cells: decode tokens/s (batch x tokens per second, prefill excluded); in brackets the share of "
        "tokens equal to eager's.",
        "",
        "| batch | context | " + " | ".join(names) + " | kp / reduce-overhead |",
        "|---|---|" + "---|" * (len(names) + 1),
    ]
    for batch, context in cells:
        cols = []
        for v in names:
            r = by.get((v, batch, context))
            cols.append("-" if r is None else f"{r['decode_tokens_per_s']:.0f} ({r['same_tokens']:.0%})")
        best_kp = max(
            (
                by[v, batch, context]["decode_tokens_per_s"]
                for v in names
                if v.startswith("kp") and (v, batch, context) in by
            ),
            default=None,
        )
        ro = by.get(("compile reduce-overhead", batch, context))
        ratio = f"{best_kp / ro['decode_tokens_per_s']:.2f}x" if best_kp and ro else "-"
        lines.append(f"| {batch} | {context} | " + " | ".join(cols) + f" | {ratio} |")
    lines += [
        "",
        "Wall time and GPU busy time per decode step, ms (the difference is host time kernels cannot save):",
        "",
        "| batch | context | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for batch, context in cells:
        cols = []
        for v in names:
            r = by.get((v, batch, context))
            gpu = None if r is None else r.get("gpu_ms_per_step")
            cols.append(
                "-" if r is None else f"{r['ms_per_token']:.2f} / {gpu:.2f}" if gpu else f"{r['ms_per_token']:.2f}"
            )
        lines.append(f"| {batch} | {context} | " + " | ".join(cols) + " |")
    if skipped:
        lines += ["", "Skipped (KV cache above --max-tokens): " + ", ".join(f"{b} x {c}" for b, c in skipped) + "."]
    seen = set()  # each distinct set of choices once, at the first cell that made it
    for r in rows:
        key = json.dumps([r.get("chosen"), r.get("step", {}).get("reverted")], sort_keys=True)
        if "chosen" in r and key not in seen:
            seen.add(key)
            step = r.get("step") or {}
            checked = ""
            if step:
                checked = f"; whole step torch {step['torch_ms']:.3f} ms, kp {step['kp_ms']:.3f} ms"
                checked += f", reverted {', '.join(step['reverted'])}" if step.get("reverted") else ""
            lines += [
                "",
                f"{r['variant']} at batch {r['batch']}, context {r['context']} ({r['optimize_s']:.1f} s): "
                + (", ".join(f"{k}: {v}" for k, v in r["chosen"].items()) or "nothing changed")
                + checked
                + ".",
            ]
    lines += ["", "Measured (UTC): " + ", ".join(sorted({r["measured"] for r in rows})) + "."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for v in VARIANTS:
            pts = sorted(
                (r["context"], r["decode_tokens_per_s"]) for r in rows if r["variant"] == v and r["batch"] == batch
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {batch}", fontsize=9)
        ax.set_xlabel("context")
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{meta['model']}, {meta['device']}, bf16", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
