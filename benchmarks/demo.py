"""kp's main job: a small Llama-style model, eager vs patched with kp (RMSNorm, SwiGLU, attention), checked and
timed.

The model is Hugging Face's LlamaForCausalLM from a random LlamaConfig when transformers is installed, else a
hand-written one of the same shape. `kp_norms.patch` swaps its RMSNorms and gated MLPs in place, and (with
transformers) `kp_attention.patch` routes its attention through kp; each patched model's logits and every
parameter gradient must be within the conformance rule of a float64 copy.

On a GPU it runs bf16 and adds torch.compile variants: the whole model, and each decoder layer compiled on its own
(torchtitan's habit). Whole-model compile makes transformers build an explicit causal mask on torch < 2.14 (it
cannot tell tracing for export from compiling), which sends SDPA to a slower masked path; per-layer compile keeps
`is_causal`. On a CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1), so its times say nothing
about speed.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import kp
import kp_attention
import kp_core
import kp_norms

try:
    import transformers
except ImportError:
    transformers = None


# ---- the fallback model: the same structure, written by hand ----


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.kv_proj = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    """Hugging Face's LlamaMLP: kp_norms.patch swaps it when named in mlp_classes."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, eps: float):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(dim, eps=eps)
        self.self_attn = Attention(dim, heads, kv_heads)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=eps)
        self.mlp = MLP(dim, hidden)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int, hidden: int, eps: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def compile_layers(model: nn.Module) -> nn.Module:
    """Compile each decoder layer on its own (nn.Module.compile, in place); the rest of the model stays eager."""
    layers = model.model.layers if hasattr(model, "model") else model.layers
    for layer in layers:
        layer.compile()
    return model


def build(cfg: dict) -> tuple[nn.Module, str]:
    if transformers is None:
        return TinyLlama(**cfg), "hand-written Llama (transformers is not installed)"
    config = transformers.LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["dim"],
        intermediate_size=cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        rms_norm_eps=cfg["eps"],
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config), f"transformers {transformers.__version__} LlamaForCausalLM"


def float64_reference(model: nn.Module) -> nn.Module:
    """A float64 copy whose RMSNorms really compute in float64: LlamaRMSNorm normalises in fp32 whatever the
    input's dtype, so each becomes torch.nn.RMSNorm (x * rsqrt(mean(x^2) + eps) * w in the input's dtype)."""
    ref = copy.deepcopy(model).to(torch.float64)
    for name, module in list(ref.named_modules()):
        if type(module).__name__ == "LlamaRMSNorm":
            norm = nn.RMSNorm(module.weight.shape, eps=module.variance_epsilon, device="meta")
            norm.weight = module.weight
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, norm)
    return ref


# ---- one train step, the check, the timing ----


def step(model, tokens):
    """One forward + backward; returns logits and the gradients of every parameter."""
    model.zero_grad(set_to_none=True)
    out = model(tokens)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss_dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 loss, fp64 for the reference
    F.cross_entropy(logits.flatten(0, 1).to(loss_dtype), tokens.flatten()).backward()
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


def check_grads(grads, grads_eager, grads64, dtype) -> tuple[float, str]:
    """Every parameter gradient by the rule; returns the tightest (fraction of its bound, name)."""
    ratios = []
    for n in grads64:
        err, bound = check(f"grad {n}", grads[n], grads_eager[n], grads64[n], dtype)
        ratios.append((err / bound, n))
    return max(ratios)


def timed(model, models, tokens, iters, device):
    """ms per train step, the step's peak memory above what the models' weights hold, kp launches per step."""
    cuda = device.type == "cuda"
    for m in models:
        m.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for _ in range(2):  # warm-up: compile, autotune, allocator
        step(model, tokens)
    if cuda:
        torch.cuda.synchronize()
    with kp_core.record_launches() as rec:
        start = time.perf_counter()
        for _ in range(iters):
            step(model, tokens)
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / iters * 1e3
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else float("nan")
    return ms, peak, rec.count() // iters


def profile(name, model, tokens, folder) -> None:
    """One profiled train step: the ops that cost the most GPU time, and the CPU time around them."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(model, tokens)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / "demo-profiles.txt", "a") as f:
        f.write(f"\n==== {name}\n{table}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--profile", default=None, help="folder: write each variant's torch.profiler table there")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu:
        cfg = dict(vocab=32000, dim=2048, layers=4, heads=16, kv_heads=4, hidden=5632, eps=1e-5)
        batch, seq, iters = 4, 2048, args.iters or 10
        print(f"GPU run: {torch.cuda.get_device_name()}, bf16")
    else:
        cfg = dict(vocab=512, dim=128, layers=2, heads=4, kv_heads=2, hidden=352, eps=1e-5)
        batch, seq, iters = 2, 64, args.iters or 2
        path = "Triton interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "PyTorch reference path"
        print(f"CPU run: kp's kernels run on the {path}; times below are not a speed measurement.")

    torch.manual_seed(0)
    base, what = build(cfg)
    print(f"model: {what}, {sum(p.numel() for p in base.parameters()) / 1e6:.1f}M parameters")
    tokens = torch.randint(0, cfg["vocab"], (batch, seq), device=device)
    eager = copy.deepcopy(base).to(device, dtype)
    ref64 = float64_reference(eager)  # the eager model's own weights, in float64
    patched = copy.deepcopy(eager)
    changed = kp_norms.patch(patched, mlp_classes=[MLP])
    kinds = collections.Counter(type(patched.get_submodule(n)).__name__ for n in changed)
    print(f"kp_norms.patch replaced {', '.join(f'{n} {k}' for k, n in kinds.most_common())} modules")

    logits64, grads64 = step(ref64, tokens)
    logits_e, grads_e = step(eager, tokens)
    logits_k, grads_k = step(patched, tokens)
    err, bound = check("logits", logits_k, logits_e, logits64, dtype)
    print(f"logits: max err vs float64 {err:.3e} (bound {bound:.3e}, eager {max_err(logits_e, logits64):.3e})")
    worst = check_grads(grads_k, grads_e, grads64, dtype)
    print(f"gradients of all {len(grads64)} parameters within the rule (tightest: {worst[1]}, {worst[0]:.2f} of bound)")
    variants = {"eager": eager, "kp-patched": patched}
    if transformers is not None:  # attention too, through transformers' attention registry
        full = copy.deepcopy(patched)
        print(f"kp_attention.patch replaced the {kp_attention.patch(full)!r} attention implementation")
        logits_a, grads_a = step(full, tokens)
        err, bound = check("logits (kp attention)", logits_a, logits_e, logits64, dtype)
        print(f"with kp attention: logits max err vs float64 {err:.3e} (bound {bound:.3e})")
        worst = check_grads(grads_a, grads_e, grads64, dtype)
        print(f"with kp attention: all gradients within the rule (tightest: {worst[1]}, {worst[0]:.2f} of bound)")
        variants["kp-patched + kp attention"] = full
        del logits_a, grads_a
    # kp.optimize: each layer checked against float64 and timed against PyTorch's, the whole step never slower
    optimized = copy.deepcopy(eager)
    # On a CPU, float8 and 2:4 matmuls run in Triton's interpreter for minutes per layer: left out there.
    deny = None if gpu else ["float8", "sparsity"]
    report = kp.optimize(optimized, (tokens,), mode="train", deny=deny, report=False)
    print(report.text())
    logits_o, _ = step(optimized, tokens)
    print(
        f"kp.optimize: logits max err vs float64 {max_err(logits_o, logits64):.3e} "
        f"(eager {max_err(logits_e, logits64):.3e}; float8 layers, where chosen, have their own budget)"
    )
    variants["kp.optimize"] = optimized
    del ref64, logits64, grads64, logits_e, grads_e, logits_k, grads_k, logits_o

    if gpu:
        variants["torch.compile"] = torch.compile(copy.deepcopy(eager))
        variants["kp-patched + compile"] = torch.compile(copy.deepcopy(patched))
        variants["torch.compile per layer"] = compile_layers(copy.deepcopy(eager))
        variants["kp-patched + compile per layer"] = compile_layers(copy.deepcopy(patched))
        # compiled afterwards: the same choices without the whole-model CUDA graph (times cached: quick)
        for_compile = copy.deepcopy(eager)
        kp.optimize(for_compile, (tokens,), mode="train", deny=["graphs"], report=False)
        variants["kp.optimize + compile per layer"] = compile_layers(for_compile)
    rows = []
    for name, model in variants.items():
        ms, peak, launches = timed(model, list(variants.values()), tokens, iters, device)
        rows.append((name, ms, peak, batch * seq / ms * 1e3, launches))
        if args.profile:
            profile(name, model, tokens, args.profile)
    print()
    print(f"{device.type}, {dtype}, batch {batch}, seq {seq}, {iters} timed steps (forward + backward)")
    print("| variant | ms / train step | peak step memory MiB | tokens/s | kp kernels / step |")
    print("|---|---|---|---|---|")
    for name, ms, peak, tps, launches in rows:
        print(f"| {name} | {ms:.1f} | {'-' if peak != peak else f'{peak:.0f}'} | {tps:.0f} | {launches} |")
    if gpu:
        print("peak step memory: torch.cuda.max_memory_allocated during the steps, less the resident weights")
    else:
        print("torch.compile variants run on a GPU only")


if __name__ == "__main__":
    main()
