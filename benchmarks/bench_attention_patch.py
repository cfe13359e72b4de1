"""The demo's model (HF Llama, 4 layers, bf16, 4 x 2048) patched with kp_norms, then with kp_attention.patch at its
default backend ("auto": torch's fused SDPA where it was measured faster for the call's signature) and with
backend="kp" (kp's kernel everywhere): ms per train step (forward, loss, backward), the three timed in rounds.

    python benchmarks/bench_attention_patch.py     # writes results/<device>/attention_patch.{json,md,png}
"""

from __future__ import annotations

import copy

import demo
import harness
import torch

import kp_attention
import kp_norms
from kp_attention import backend as backends

ROUNDS, ITERS = 3, 10


def main() -> None:
    harness.require_gpu()
    torch.manual_seed(0)
    cfg = dict(vocab=32000, dim=2048, layers=4, heads=16, kv_heads=4, hidden=5632, eps=1e-5)
    base, _ = demo.build(cfg)
    device = torch.device("cuda")
    patched = base.to(device, torch.bfloat16)
    kp_norms.patch(patched, mlp_classes=[demo.MLP])
    auto, kp_only = copy.deepcopy(patched), copy.deepcopy(patched)
    kp_attention.patch(auto)
    kp_attention.patch(kp_only, backend="kp")
    variants = {"kp-patched": patched, "kp-patched + kp attention (auto)": auto, "+ kp attention (kp)": kp_only}
    tokens = torch.randint(0, cfg["vocab"], (4, 2048), device=device)
    times = {name: [] for name in variants}
    for _ in range(ROUNDS):
        for name, model in variants.items():
            times[name].append(demo.timed(model, list(variants.values()), tokens, ITERS, device)[0])
    rows = [dict(provider=n, group="demo", ms=min(t), each=t) for n, t in times.items()]
    meta = {
        "kernel": "attention_patch",
        "decided": [f"{k[0]} {k[1]} training={k[-1]}: {v}" for k, v in backends.decided().items()],
    }
    harness.publish("attention_patch", meta, rows, render, plot)


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# kp_attention.patch on the demo model, {meta['device']}",
        "",
        f"torch {meta['torch']}; bf16, 4 x 2048,"
        f" best of {ROUNDS} rounds of {ITERS} steps (each round: every variant once).",
        "",
        "| variant | ms / train step | each round |",
        "|---|---|---|",
    ]
    lines += [f"| {r['provider']} | {r['ms']:.2f} | {', '.join(f'{t:.2f}' for t in r['each'])} |" for r in rows]
    lines += ["", 'backend="auto" decided:', ""] + [f"- {d}" for d in meta["decided"]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    harness.plot_grouped(rows, path, "group", "ms", "ms / train step", f"kp_attention.patch, {meta['device']}")


if __name__ == "__main__":
    main()
