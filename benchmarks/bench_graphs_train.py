"""Small-batch training steps through kp_graphs.graphed against eager and torch.compile, in one run.

    python benchmarks/bench_graphs_train.py     # writes results/<device>/graphs_train.*

The model is the demo's hand-written Llama at its GPU size (dim 2048, 4 layers, 16 / 4 heads, hidden 5632,
vocab 32000), fp32 weights under bf16 autocast, fused AdamW; sequences of 128 tokens, batches drawn from 1..4
every step (the same 60 steps for every provider). Providers:
- eager;
- torch.compile(model, mode="reduce-overhead") inside the same step (the optimizer step eager);
- kp graphed model: forward and backward graphs per bucket (1, 2, 4), the optimizer step eager;
- kp graphed whole step (training_step=True): forward, backward and a capturable fused AdamW in one graph per
  bucket, the padded labels ignored by the loss;
- the same over torch.compile(model) (default mode, Inductor's fused kernels captured into kp's graphs).
Wall ms per step over the second pass, the first pass (captures, compiles) on its own, memory above the model.
"""

from __future__ import annotations

import copy
import gc
import random
import time

import demo
import harness
import torch
import torch.nn.functional as F

import kp_graphs

CFG = dict(vocab=32000, dim=2048, layers=4, heads=16, kv_heads=4, hidden=5632, eps=1e-5)
SEQ, STEPS, BUCKETS = 128, 60, [1, 2, 4]


def make_step(model, opt, forward):
    def step(tokens, labels):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16, cache_enabled=False):
            logits = forward(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def providers(base):
    """name -> a function making (model copy, step) for that provider."""

    def fresh(capturable):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=capturable)
        return model, opt

    def eager():
        model, opt = fresh(False)
        return model, make_step(model, opt, model)

    def compiled():
        model, opt = fresh(False)
        return model, make_step(model, opt, torch.compile(model, mode="reduce-overhead"))

    def graphed_model():
        model, opt = fresh(False)
        return model, make_step(model, opt, kp_graphs.graphed(model, buckets=BUCKETS, name="train: model"))

    def graphed_step():
        model, opt = fresh(True)
        step = make_step(model, opt, model)
        return model, kp_graphs.graphed(step, buckets=BUCKETS, pad=(0, -100), training_step=True, name="train: step")

    def graphed_step_compiled():
        model, opt = fresh(True)
        step = make_step(model, opt, torch.compile(model, dynamic=False))
        return model, kp_graphs.graphed(step, buckets=BUCKETS, pad=(0, -100), training_step=True, name="train: step+c")

    return {
        "eager": eager,
        "torch.compile reduce-overhead (model)": compiled,
        "kp graphed model (fwd + bwd graphs)": graphed_model,
        "kp graphed whole step": graphed_step,
        "kp graphed whole step, torch.compile'd model": graphed_step_compiled,
    }


def main() -> None:
    harness.require_gpu()
    torch.manual_seed(0)
    base = demo.TinyLlama(**CFG).cuda()
    rng = random.Random(0)
    sizes = [rng.randint(1, 4) for _ in range(STEPS)]
    data = [
        (
            torch.randint(0, CFG["vocab"], (n, SEQ), device="cuda"),
            torch.randint(0, CFG["vocab"], (n, SEQ), device="cuda"),
        )
        for n in sizes
    ]
    rows = []
    for name, make in providers(base).items():
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        model, step = make()
        times, losses = [], []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for tokens, labels in data:
                losses.append(step(tokens, labels))
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        held = (torch.cuda.memory_allocated() - before) / 2**20
        rows.append(
            dict(
                provider=name,
                ms_per_step=times[1] / STEPS * 1e3,
                first_pass_s=times[0],
                mib=held,
                tokens_per_s=sum(sizes) * SEQ / times[1],
                last_loss=float(losses[-1]),
            )
        )
        r = rows[-1]
        print(
            f"{name:40s} {r['ms_per_step']:7.3f} ms/step first {r['first_pass_s']:6.2f} s {held:8.1f} MiB "
            f"loss {r['last_loss']:.4f}",
            flush=True,
        )
        del model, step
    print(kp_graphs.report())
    meta = {"kernel": "graphs_train", "op": "graphed", "dtype": "fp32 weights, bf16 autocast", "seq": SEQ}
    harness.publish("graphs_train", meta, rows, render, plot)


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Small-batch training steps (batch 1..4 x {meta['seq']} tokens) through CUDA graphs, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}. The demo's Llama (dim 2048, 4 layers), fp32 weights, bf16 "
        "autocast, fused AdamW; the same steps for every provider. ms / step over the second pass; MiB held by the "
        "provider's model copy, gradients, optimizer state and graphs. "
        "Losses differ by padding (a batch of 3 runs at 4) and fusion.",
        "",
        "| provider | ms / step | tokens/s | first pass s | MiB held | last loss |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['provider']} | {r['ms_per_step']:.3f} | {r['tokens_per_s']:.0f} | {r['first_pass_s']:.2f} | "
            f"{r['mib']:.1f} | {r['last_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh([r["provider"] for r in rows], [r["ms_per_step"] for r in rows])
    ax.set_xlabel("ms per step")
    ax.set_title(f"training step, batch 1..4 x {meta['seq']}, {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
