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
- kp.optimize + compile reduce-overhead: its choices timed by kp.graph_timer (the GPU's time alone, as the decode
  steps will run from CUDA graphs), then the static-cache compiled recipe.
Decode tokens/s = batch x (N - 1) / (t(N) - t(1)), t(n) the least time of --repeats calls of `generate` of n new
tokens from the same prompt: the prefill and the first token cancel. "same tokens" is the share of generated tokens
equal to eager's (greedy; float8 layers may change some). Cells whose KV cache would pass --max-tokens (batch x context)
are skipped and listed. The grid is walked cell by cell, each cell's variants back to back. Results are written
after every cell (a run cut short keeps what it measured); with --only, the other variants' rows of the last run
on this device are kept, each with its time of measurement.
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


def timed(model, prompt, n: int, compiled: bool, cache_len: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Least seconds of generate(n new tokens) after one warm-up call (compilation, graph capture). The least, not
    the median: a call can pay one-off host work that is not the decoder's steady state (cuDNN's SDPA builds an
    execution plan for each new KV length it meets: on an H200 a decode step of the demo's model took 42 ms at a
    new length, 4 ms at one seen before)."""
    out = generate(model, prompt, n, compiled, cache_len)
    times = []
    for _ in range(repeats):
        if prompt.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = generate(model, prompt, n, compiled, cache_len)
        if prompt.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times), out


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
    rows = [] if args.smoke else harness.kept_rows(meta["kernel"], args.only)
    skipped = [(b, c) for b in batches for c in contexts if b * c > args.max_tokens]
    cells = [(b, c) for b in batches for c in contexts if b * c <= args.max_tokens]
    eager_tokens = {}
    chosen = [v for v in VARIANTS if not args.only or v in args.only or v == "eager"]
    models = {v: copy.deepcopy(base) for v in chosen}
    # cell by cell, every variant back to back: an eager decode step is host-bound and moved by up to 30 % between
    # passes over the grid (the same unchanged model, measured a few minutes apart); side by side, a cell's
    # variants see the same state of the machine
    for batch, context in cells if args.smoke else harness.progress(cells, "cells"):
        g = torch.Generator().manual_seed(batch * 100003 + context)
        prompt = torch.randint(cfg["vocab"], (batch, context), generator=g).to(device)
        for variant in chosen:
            model = models[variant]
            compiled = variant.endswith("reduce-overhead") and not args.smoke  # no CUDA graphs on the CPU
            report = None
            if variant.startswith("kp.optimize"):
                kp.restore(model)
                deny = ["attention"] + (["float8", "sparsity"] if args.smoke else [])
                timer = kp.graph_timer if compiled else None  # graphed decode steps: the GPU's time alone
                report = kp.optimize(model, (prompt[:, -1:],), mode="infer", deny=deny, timer=timer, report=False)
            torch._dynamo.reset()  # the last compiled cell's graphs and their memory go
            t1, _ = timed(model, prompt, 1, compiled, context + new, repeats)
            tn, out = timed(model, prompt, new, compiled, context + new, repeats)
            generated = out[:, context:]
            if variant == "eager":
                eager_tokens[batch, context] = generated
            same = (generated == eager_tokens[batch, context]).float().mean().item()
            row = dict(model=args.model, variant=variant, batch=batch, context=context, new_tokens=new)
            row.update(
                decode_tokens_per_s=batch * (new - 1) / max(tn - t1, 1e-9),
                ms_per_token=(tn - t1) / (new - 1) * 1e3,
                prefill_ms=t1 * 1e3,
                same_tokens=same,
                measured=time.strftime("%Y-%m-%d %H:%M"),
            )
            if report is not None:
                row.update(optimize_s=report.seconds, chosen=report.chosen)
            print(
                f"{variant:38s} batch {batch:3d} context {context:6d}: {row['decode_tokens_per_s']:9.0f} tok/s "
                f"({row['ms_per_token']:.2f} ms/step), same tokens {same:.0%}",
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
    if skipped:
        lines += ["", "Skipped (KV cache above --max-tokens): " + ", ".join(f"{b} x {c}" for b, c in skipped) + "."]
    seen = set()  # each distinct set of choices once, at the first cell that made it
    for r in rows:
        key = json.dumps(r.get("chosen"), sort_keys=True)
        if "chosen" in r and key not in seen:
            seen.add(key)
            lines += [
                "",
                f"kp.optimize at batch {r['batch']}, context {r['context']} ({r['optimize_s']:.1f} s): "
                + (", ".join(f"{k}: {v}" for k, v in r["chosen"].items()) or "nothing changed")
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
