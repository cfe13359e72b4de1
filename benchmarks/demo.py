"""kp's main job: a small Llama-style model run eager and patched with kp, checked and timed.

On a GPU it runs bf16 and adds a torch.compile variant; on a CPU the kernels run under Triton's
interpreter (TRITON_INTERPRET=1), so its times say nothing about speed.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import kp_norms


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, hidden: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def step(model, tokens):
    """One forward + backward; returns logits and the gradients of every parameter."""
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()).backward()
    return logits.detach(), {n: p.grad.detach() for n, p in model.named_parameters()}


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


def check(name, ours, eager, ref64, dtype):
    """Conformance rule at model level: kp's error vs fp64 <= 2x eager's error + one ulp at scale."""
    atol = torch.finfo(dtype).eps * max(1.0, ref64.abs().max().item())
    bound = 2 * max_err(eager, ref64) + atol
    err = max_err(ours, ref64)
    if err > bound:
        raise SystemExit(f"demo: {name} differs from the float64 model: {err:.3e} > {bound:.3e}")
    return err, bound


def timed(model, tokens, iters, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # warm-up: compile, autotune, allocator
        step(model, tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step(model, tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / iters * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    return ms, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu:
        cfg = dict(vocab=32000, dim=2048, layers=4, heads=16, hidden=5632)
        batch, seq, iters = 4, 2048, args.iters or 10
        print(f"GPU run: {torch.cuda.get_device_name()}, bf16")
    else:
        cfg = dict(vocab=512, dim=128, layers=2, heads=4, hidden=352)
        batch, seq, iters = 2, 64, args.iters or 2
        path = "Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "PyTorch reference path"
        print(f"CPU run: kp's kernels run on the {path}; times below are not a speed measurement.")

    torch.manual_seed(0)
    base = TinyLlama(**cfg)
    tokens = torch.randint(0, cfg["vocab"], (batch, seq), device=device)
    ref64 = copy.deepcopy(base).to(device, torch.float64)
    eager = copy.deepcopy(base).to(device, dtype)
    patched = copy.deepcopy(base).to(device, dtype)
    changed = kp_norms.patch(patched)
    print(f"kp_norms.patch replaced {len(changed)} RMSNorm modules: {', '.join(changed)}")

    logits64, grads64 = step(ref64, tokens)
    logits_e, grads_e = step(eager, tokens)
    logits_k, grads_k = step(patched, tokens)
    err, bound = check("logits", logits_k, logits_e, logits64, dtype)
    print(f"logits: max err vs float64 {err:.3e} (bound {bound:.3e}, eager {max_err(logits_e, logits64):.3e})")
    ratios = []
    for n in grads64:
        err, bound = check(f"grad {n}", grads_k[n], grads_e[n], grads64[n], dtype)
        ratios.append((err / bound, n))
    worst = max(ratios)
    print(f"gradients of all {len(grads64)} parameters within the rule (tightest: {worst[1]}, {worst[0]:.2f} of bound)")

    variants = {"eager": eager, "kp-patched": patched}
    if gpu:
        variants["torch.compile"] = torch.compile(copy.deepcopy(eager))
        variants["kp-patched + compile"] = torch.compile(patched)
    rows = []
    for name, model in variants.items():
        ms, peak = timed(model, tokens, iters, device)
        rows.append((name, ms, peak, batch * seq / ms * 1e3))
    print()
    print(f"{device.type}, {dtype}, batch {batch}, seq {seq}, {iters} timed steps")
    print("| variant | ms / train step | peak memory MiB | tokens/s |")
    print("|---|---|---|---|")
    for name, ms, peak, tps in rows:
        print(f"| {name} | {ms:.1f} | {'-' if peak != peak else f'{peak:.0f}'} | {tps:.0f} |")


if __name__ == "__main__":
    main()
