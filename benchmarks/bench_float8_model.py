"""Float8 training at model level (kp_precision.convert_to_float8_training): kp vs bf16 and torchao in one run.

    python benchmarks/bench_float8_model.py            # GPU: writes results/<device>/float8_model.*
    python benchmarks/bench_float8_model.py --smoke    # CPU: a few steps of a tiny model, the mechanics only

Two measurements, every variant with the same bf16 weights and data:
- train step (forward + backward + AdamW) of one Llama-3-8B-shaped decoder block (4096 wide, MLP 14336, GQA 32/8
  heads, 2 x 4096 tokens) and of `nox -s demo`'s model (4 layers, 2048 wide, vocab 32000, 8 x 1024 tokens): ms
  per step and peak memory above the weights, each block compiled on its own (torchtitan's habit) and eager;
- the loss curve of the demo's model trained for --steps steps on fixed synthetic sequences over 2048 token ids
  (a random permutation followed with probability 0.9, so there is something to learn; a fresh batch every step,
  the same batches for every variant): the mean loss of the last 20 steps against bf16's, next to the spread of
  bf16 runs from other random weights, and the curves plotted.
Variants: bf16; kp tensorwise and rowwise (Float8Linear); torchao's convert_to_float8_training with the same
recipe (compiled only, as torchao is meant to run). lm_head stays bf16 in every float8 variant.
"""

from __future__ import annotations

import argparse
import copy
import math
import time

import demo
import harness
import torch
import torch.nn.functional as F
from torch import nn

import kp_precision

RECIPES = ("tensorwise", "rowwise")
ACTIVE = 2048  # token ids the loss run's data uses (of the model's 32000)
BLOCK = dict(dim=4096, heads=32, kv_heads=8, hidden=14336, eps=1e-5)
MODEL = dict(vocab=32000, dim=2048, layers=4, heads=16, kv_heads=4, hidden=5632, eps=1e-5)
PARTS = ("block", "model", "loss")  # the train step of the block, of the model; the loss curves
SMOKE = dict(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, hidden=176, eps=1e-5)


def keep_head(module: nn.Module, fqn: str) -> bool:
    return "lm_head" not in fqn


def variants(base: nn.Module, device: torch.device) -> dict:
    """{name: (model, compiled?)} with base's weights; torchao only where it imports and runs on this device."""
    out = {"bf16": base}
    for recipe in RECIPES:
        out[f"kp {recipe}"] = kp_precision.convert_to_float8_training(
            copy.deepcopy(base), recipe=recipe, module_filter_fn=keep_head
        )
        if device.type != "cuda":
            continue
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            out[f"torchao {recipe}"] = convert_to_float8_training(
                copy.deepcopy(base), config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep_head
            )
        except Exception as e:  # absent or incompatible: reported, not hidden
            print(f"torchao {recipe} unavailable: {type(e).__name__}: {str(e)[:200]}")
    return out


def compiled(model: nn.Module) -> nn.Module:
    """Each decoder block compiled on its own (a bare block: the block itself). Dynamo's caches are reset first:
    every variant compiles the same Block.forward, and past its recompile limit dynamo would silently run the
    later variants eagerly."""
    torch._dynamo.reset()
    if hasattr(model, "layers"):
        return demo.compile_layers(model)
    return torch.compile(model)


def train_step(model, opt, batch):
    x, target = batch
    if hasattr(model, "fused_loss"):  # a variant with a fused linear + cross-entropy (bench_e2e's): no logits
        loss = model.fused_loss(x, target)
    else:
        out = model(x)
        out = out if isinstance(out, torch.Tensor) else out.logits  # a Hugging Face model's output
        if target is None:  # a bare block: a stand-in loss over its output
            loss = out.float().square().mean()
        else:
            loss = F.cross_entropy(out.flatten(0, 1).float(), target.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def time_step(model, batch, iters: int, device) -> dict:
    """ms per train step, peak MiB above the model and optimiser state, and host CPU ms per step (the Python
    thread's CPU time), after 3 warm-up steps (compilation, autotuning, the optimiser's state)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device.type == "cuda"
    for _ in range(3):
        train_step(model, opt, batch)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    cpu, start = time.thread_time(), time.perf_counter()
    for _ in range(iters):
        train_step(model, opt, batch)
    if cuda:
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / iters * 1e3
    host = (time.thread_time() - cpu) / iters * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return dict(ms=ms, host_ms=host, peak_mib=peak)


def synthetic(cfg: dict, batches: int, batch: int, seq: int, device, active: int = ACTIVE) -> list:
    """`batches` fresh (tokens, next tokens) batches, the same ones on every call, over the first `active` token
    ids: each token is a fixed permutation of the previous one with probability 0.9, else random. Fresh random
    tokens every step keep the model from memorising the data, and the small active vocabulary lets every variant
    learn the permutation within a few hundred steps, so the loss settles near the data's entropy (floor()) and a
    relative comparison between runs measures the arithmetic, not how far along each run happens to be."""
    g = torch.Generator().manual_seed(0)
    active = min(active, cfg["vocab"])
    perm = torch.randperm(active, generator=g)
    t = torch.empty(batches * batch, seq + 1, dtype=torch.long)
    t[:, 0] = torch.randint(active, (batches * batch,), generator=g)
    for i in range(1, seq + 1):
        noise = torch.randint(active, (batches * batch,), generator=g)
        keep = torch.rand(batches * batch, generator=g) < 0.9
        t[:, i] = torch.where(keep, perm[t[:, i - 1]], noise)
    t = t.to(device).view(batches, batch, seq + 1)
    return [(b[:, :-1], b[:, 1:]) for b in t]


def floor(active: int) -> float:
    """The entropy of the next token (nats): the permutation's target with probability 0.9 + 0.1 / active."""
    p = 0.9 + 0.1 / active
    return -(p * math.log(p) + (active - 1) * (0.1 / active) * math.log(0.1 / active))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, few steps, nothing written")
    ap.add_argument(
        "--parts",
        nargs="+",
        choices=PARTS,
        default=list(PARTS),
        help="what to measure now; the other parts' rows are kept from the last run on this device",
    )
    args = ap.parse_args()
    if not args.smoke:
        harness.require_gpu()
    device = torch.device("cpu" if args.smoke else "cuda")
    cfg = SMOKE if args.smoke else MODEL
    steps, iters = (4, 1) if args.smoke else (args.steps, 10)
    rows = [] if args.smoke else [r for r in harness.last_rows("float8_model") if r["what"] not in args.parts]

    # train step time and memory
    torch.manual_seed(0)
    block = demo.Block(**(dict(dim=64, heads=4, kv_heads=2, hidden=176, eps=1e-5) if args.smoke else BLOCK))
    block_batch = (torch.randn(1 if args.smoke else 2, 32 if args.smoke else 4096, block.mlp.up_proj.in_features), None)
    model_batch = synthetic(cfg, 1, 2 if args.smoke else 8, 32 if args.smoke else 1024, device)[0]
    for what, base, batch in (("block", block, block_batch), ("model", demo.TinyLlama(**cfg), model_batch)):
        if what not in args.parts:
            continue
        base = base.to(device=device, dtype=torch.bfloat16)
        x, t = batch
        batch = (x.to(device=device, dtype=torch.bfloat16) if what == "block" else x, t)
        for name, model in variants(base, device).items():
            for mode in ("eager", "compile"):
                if mode == "eager" and name.startswith("torchao") or mode == "compile" and args.smoke:
                    continue
                m = copy.deepcopy(model)
                timing = time_step(compiled(m) if mode == "compile" else m, batch, iters, device)
                ms, peak = timing["ms"], timing["peak_mib"]
                rows.append(dict(what=what, provider=name, mode=mode, ms=ms, peak_mib=peak))
                print(f"{what:6s} {name:20s} {mode:8s} {ms:9.2f} ms  {peak:9.0f} MiB", flush=True)

    # loss curves; bf16 twice more from other initial weights: the spread between runs that differ only in their
    # random start, to read the float8 variants' gaps against
    curves = {r["provider"]: r["curve"] for r in rows if r["what"] == "loss"}
    if "loss" in args.parts:
        loss_rows(cfg, steps, args.smoke, device, rows, curves)
    if args.smoke:
        return
    rows.sort(key=lambda r: PARTS.index(r["what"]))  # kept rows and new ones in the table's order
    meta = {"kernel": "float8_model", "op": "float8_linear", "dtype": "bf16 weights, float8 linears"}
    meta.update(harness.versions())
    md = render(meta, rows, len(next(iter(curves.values()), [])))
    out = harness.write_results("float8_model", meta, rows, md, lambda p: plot(curves, meta, p))
    print(md)
    print(f"wrote {out}")


def loss_rows(cfg: dict, steps: int, smoke: bool, device, rows: list, curves: dict) -> None:
    """The loss curves' rows, appended to rows (and the curves to curves)."""
    data = synthetic(cfg, steps, 2 if smoke else 8, 32 if smoke else 1024, device)
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        base = demo.TinyLlama(**cfg).to(device=device, dtype=torch.bfloat16)
        runs = variants(base, device) if seed == 1 else {f"bf16 (seed {seed})": base}
        for name, model in runs.items():
            model = compiled(copy.deepcopy(model)) if not smoke else copy.deepcopy(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            curves[name] = [train_step(model, opt, data[i]).item() for i in range(steps)]
            print(f"loss {name:20s} first {curves[name][0]:.4f} last {curves[name][-1]:.4f}", flush=True)
    tail = {n: sum(c[-20:]) / len(c[-20:]) for n, c in curves.items()}
    for n, v in tail.items():
        rows.append(
            dict(what="loss", provider=n, mode="compile", final_loss=v, vs_bf16=v / tail["bf16"] - 1, curve=curves[n])
        )


def render(meta: dict, rows: list[dict], steps: int) -> str:
    lines = [
        f"# Float8 training at model level, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton "
        f"{meta['triton']}. Train step: forward + backward + AdamW, bf16 weights; peak: MiB above the model "
        "and optimiser state.",
        "",
        "| what | provider | mode | ms / step | peak MiB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["what"] != "loss":
            lines.append(f"| {r['what']} | {r['provider']} | {r['mode']} | {r['ms']:.2f} | {r['peak_mib']:.0f} |")
    lines += [
        "",
        f"Loss of the demo's model after {steps} steps on fixed synthetic data over {ACTIVE} token ids, a fresh "
        f"batch each step (mean of the last 20 steps; the data's entropy, the floor, is {floor(ACTIVE):.3f}). "
        "bf16 (seed 2, 3) start from other random weights: their gaps are the run-to-run spread.",
        "",
        "| provider | final loss | vs bf16 |",
        "|---|---|---|",
    ]
    for r in rows:
        if r["what"] == "loss":
            lines.append(f"| {r['provider']} | {r['final_loss']:.4f} | {100 * r['vs_bf16']:+.2f} % |")
    return "\n".join(lines) + "\n"


def plot(curves: dict, meta: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, c in curves.items():
        ax.plot(range(1, len(c) + 1), c, label=name, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(f"float8 training, demo model, {meta['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
