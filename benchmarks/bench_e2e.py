"""End to end: a Hugging Face Llama trained with kp.optimize against the stacks users assemble today, in one run.

    python benchmarks/bench_e2e.py --model demo           # GPU: nox -s demo's model, 4 x 2048 tokens
    python benchmarks/bench_e2e.py --model llama3-8b-2    # GPU: two blocks of Llama-3-8B's shape, 2 x 4096 tokens
    python benchmarks/bench_e2e.py --smoke                # CPU: a tiny model, the mechanics only, nothing written

Every variant starts from the same bf16 weights and sees the same batches:
- eager; torch.compile (each decoder layer compiled on its own: torchtitan's habit, and transformers keeps
  `is_causal` for SDPA that way); compile + torchao float8 (tensorwise and rowwise, torchao's own auto filter, the
  lm_head left out); the same with FlashAttention-4 as the model's attention (its public flash_attn_func
  registered with transformers' attention registry, the few lines a user writes; compile leaves it out of the graph
  as its own call); Liger-Kernel's patch (RoPE, RMSNorm, SwiGLU; eager and compiled; run last, since its RoPE
  patch is global to transformers' Llama module); kp.optimize (eager, where it may replay the whole model from
  CUDA graphs; compiled per layer, without that graph; compiled with its choices timed by kp.graph_timer, the
  GPU's time alone, as under compile the host's launch cost overlaps the GPU's work; and eager without its
  fusions across packages, to show what they add).
- With a fused linear + cross-entropy (the loss from the decoder's last hidden states and lm_head's weight, the
  logits never made whole): Liger-Kernel's patch + compile with its fused linear cross-entropy, compile + torchao
  float8 tensorwise with Cut Cross-Entropy (+ FlashAttention-4), and kp.optimize (eager, and + compile) trained
  through the model's own loss (labels passed), which kp.optimize's loss site fuses with kp-losses where it chose
  it.
- Per variant: ms per train step (forward, cross-entropy, backward, AdamW), tokens/s, peak memory above the weights
  and optimiser state, host CPU time per step (the Python thread's CPU time), and for the demo's model the mean
  loss of the last 20 of --steps steps on fixed synthetic data, against eager's. The variants without a fused loss
  compute it from the logits the same way (F.cross_entropy on their fp32 copy, as transformers does).
kp.optimize's own time and its report (what it chose per layer and why) go into the markdown.
Results are written after every variant, so a run cut short keeps what it measured. With --only, the rows of the
other variants from the last run on this device are kept (each row carries its time of measurement), so a long
table can be measured in several calls.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time

import demo
import harness
import torch
from bench_float8_model import synthetic, time_step, train_step
from torch import nn

import kp

MODELS = {
    "demo": dict(vocab=32000, dim=2048, layers=4, heads=16, kv_heads=4, hidden=5632, eps=1e-5, batch=4, seq=2048),
    "llama3-8b-2": dict(
        vocab=128256, dim=4096, layers=2, heads=32, kv_heads=8, hidden=14336, eps=1e-5, batch=2, seq=4096
    ),
}
SMOKE = dict(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, hidden=176, eps=1e-5, batch=2, seq=32)


def _torchao(recipe: str):
    def build(model: nn.Module) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, _auto_filter_for_recipe, convert_to_float8_training

        keep = _auto_filter_for_recipe(recipe, filter_fqns=["lm_head"])
        config = Float8LinearConfig.from_recipe_name(recipe)
        return demo.compile_layers(convert_to_float8_training(model, config=config, module_filter_fn=keep))

    return build


def _fa4_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature on FlashAttention-4's flash_attn_func (causal, no mask: the
    benchmark's batches are unpadded)."""
    from flash_attn.cute import flash_attn_func

    if attention_mask is not None or dropout:
        raise ValueError("the FlashAttention-4 anchor takes unpadded causal batches without dropout")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = torch.compiler.disable(flash_attn_func)(q, k, v, softmax_scale=scaling, causal=True)
    return (out[0] if isinstance(out, tuple) else out), None


def _fa4(build):
    """build, with FlashAttention-4 as the model's attention (registered as "fa4_anchor")."""

    def wrapped(model: nn.Module) -> nn.Module:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register("fa4_anchor", _fa4_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register("fa4_anchor", sdpa_mask)  # no mask built for a plain causal batch
        model.set_attn_implementation("fa4_anchor")
        return build(model)

    return wrapped


def _liger(compiled: bool):
    def build(model: nn.Module) -> nn.Module:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False, model=model
        )
        return demo.compile_layers(model) if compiled else model

    return build


def _liger_loss(hidden, weight, target):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, target)


def _cce_loss(hidden, weight, target):
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, target)


def _fused(build, loss):
    """build, then the train step's loss by `loss(hidden (tokens, H), lm_head.weight, target (tokens,))` from the
    decoder's last hidden states (a Hugging Face causal LM's `model.model`), the logits never made whole."""

    def wrapped(model: nn.Module) -> nn.Module:
        model = build(model)

        def fused_loss(x, target):
            hidden = model.model(x).last_hidden_state
            return loss(hidden.flatten(0, 1), model.lm_head.weight, target.flatten())

        model.fused_loss = fused_loss
        return model

    return wrapped


def _labelled(build):
    """build, then the train step's loss from the model's own forward given the labels (`shift_labels`: the
    batch's targets as they are, not shifted again): transformers' loss, or kp_losses' fused one where kp.optimize
    chose the model's loss site (kp_losses.patch)."""

    def wrapped(model: nn.Module) -> nn.Module:
        model = build(model)
        model.fused_loss = lambda x, target: model(x, labels=target, shift_labels=target).loss
        return model

    return wrapped


def variants(gpu: bool) -> dict:
    """name -> build(model copy) -> the model to train; kp.optimize's report is kept on the model."""
    out = {"eager": lambda m: m, "kp.optimize": lambda m: m}
    if gpu:
        out["kp.optimize, no fusion"] = lambda m: m  # what the fusions across packages add
        out["torch.compile"] = demo.compile_layers
        out["kp.optimize + compile"] = demo.compile_layers
        out["kp.optimize (graph_timer) + compile"] = demo.compile_layers  # choices by the GPU's time alone
        out["compile + torchao float8 tensorwise"] = _torchao("tensorwise")
        out["compile + torchao float8 rowwise"] = _torchao("rowwise")
        out["compile + FlashAttention-4"] = _fa4(demo.compile_layers)
        out["compile + torchao float8 tensorwise + FlashAttention-4"] = _fa4(_torchao("tensorwise"))
        out["kp.optimize + kp-losses"] = _labelled(lambda m: m)  # its loss site chosen or not
        out["kp.optimize + compile + kp-losses"] = _labelled(demo.compile_layers)
        out["compile + torchao float8 tensorwise + Cut Cross-Entropy"] = _fused(_torchao("tensorwise"), _cce_loss)
        out["compile + torchao float8 tensorwise + FlashAttention-4 + Cut Cross-Entropy"] = _fused(
            _fa4(_torchao("tensorwise")), _cce_loss
        )
        out["Liger"] = _liger(False)
        out["Liger + compile"] = _liger(True)
        out["Liger + compile + its fused linear cross-entropy"] = _fused(_liger(True), _liger_loss)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(MODELS), default="demo")
    ap.add_argument("--steps", type=int, default=None, help="loss-curve steps (default 300 for demo, 0 otherwise)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--only", nargs="+", help="run these variants only")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, few steps, nothing written")
    args = ap.parse_args()
    if not args.smoke:
        harness.require_gpu()
    device = torch.device("cpu" if args.smoke else "cuda")
    cfg = SMOKE if args.smoke else MODELS[args.model]
    steps = 3 if args.smoke else (args.steps if args.steps is not None else (300 if args.model == "demo" else 0))
    iters = 1 if args.smoke else args.iters
    torch.manual_seed(0)
    base, what = demo.build({k: v for k, v in cfg.items() if k not in ("batch", "seq")})  # the model's sizes
    base = base.to(device=device, dtype=torch.float32 if args.smoke else torch.bfloat16)
    batch = synthetic(cfg, 1, cfg["batch"], cfg["seq"], device)[0]
    data = synthetic(cfg, steps, cfg["batch"], cfg["seq"], device) if steps else []
    tokens = cfg["batch"] * cfg["seq"]
    print(f"{what}: {sum(p.numel() for p in base.parameters()) / 1e6:.0f}M parameters, {tokens} tokens per step")

    meta = {"kernel": f"e2e_{args.model}", "model": what, "dtype": "bf16", "tokens_per_step": tokens, "steps": steps}
    rows = [] if args.smoke else harness.kept_rows(meta["kernel"], args.only, list(variants(True)))
    deny = ["float8", "sparsity"] if args.smoke else None  # interpreted float8 matmuls take minutes
    for name, build in variants(not args.smoke).items():
        if args.only and name not in args.only:
            continue
        torch._dynamo.reset()  # every variant compiles the same layer code: a fresh cache each
        model = copy.deepcopy(base)
        skip = (deny or []) + (["fusion"] if name.endswith("no fusion") else [])
        skip += ["graphs"] if "compile" in name else []  # compiled afterwards: no whole-model CUDA graph
        report = None
        timer = kp.graph_timer if "graph_timer" in name else None
        if name.startswith("kp.optimize"):
            report = kp.optimize(model, (batch[0],), mode="train", deny=skip, timer=timer, report=False)
        try:
            model = build(model)
            row = dict(model=args.model, variant=name, **time_step(model, batch, iters, device))
        except Exception as e:  # an anchor that cannot run here: recorded as missing, not hidden
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        row["tokens_per_s"] = tokens / row["ms"] * 1e3
        row["measured"] = time.strftime("%Y-%m-%d %H:%M")
        if report is not None:
            row.update(optimize_s=report.seconds, chosen=report.chosen, report=report.text())
        if data:
            fresh = copy.deepcopy(base)
            if report is not None:
                kp.optimize(fresh, (batch[0],), mode="train", deny=skip, timer=timer, report=False)  # cached: quick
            fresh = build(fresh)
            opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
            curve = [train_step(fresh, opt, b).item() for b in data]
            row["final_loss"] = sum(curve[-20:]) / len(curve[-20:])
            row["loss_steps"] = len(curve)
            del fresh, opt
        rows = [r for r in rows if r["variant"] != name] + [row]
        print(
            f"{name:38s} {row['ms']:8.2f} ms  {row['tokens_per_s']:9.0f} tok/s  host {row['host_ms']:7.2f} ms  "
            f"peak {row['peak_mib']:7.0f} MiB" + (f"  loss {row['final_loss']:.4f}" if "final_loss" in row else ""),
            flush=True,
        )
        if report is not None:
            print(f"{name}: chose {report.chosen or 'nothing'} in {report.seconds:.1f} s")
        if not args.smoke:
            publish(meta, rows, echo=False)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.smoke:
        publish(meta, rows, echo=True)


def publish(meta: dict, rows: list[dict], echo: bool) -> None:
    order = list(variants(True))
    rows = sorted(rows, key=lambda r: order.index(r["variant"]))
    harness.publish(meta["kernel"], meta, rows, render, plot, echo=echo)


def render(meta: dict, rows: list[dict]) -> str:
    eager = next((r for r in rows if r["variant"] == "eager"), None)
    best_anchor = min((r["ms"] for r in rows if not r["variant"].startswith("kp")), default=None)
    lines = [
        f"# End to end, {meta['model']}, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}; bf16; {meta['tokens_per_step']} tokens per train step "
        "(forward, cross-entropy on the logits, backward, AdamW).",
        "",
        "| variant | ms / step | tokens/s | vs best anchor | host ms / step | peak MiB | loss (last 20) | vs eager |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{best_anchor / r['ms']:.2f}x" if best_anchor else "-"
        loss = f"{r['final_loss']:.4f}" if "final_loss" in r else "-"
        # (--steps 0: no loss curve; a row kept from a run of other --steps: not comparable)
        both = "final_loss" in r and eager and "final_loss" in eager and r.get("loss_steps") == eager.get("loss_steps")
        rel = f"{r['final_loss'] / eager['final_loss'] - 1:+.2%}" if both else "-"
        lines.append(
            f"| {r['variant']} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {ratio} | {r['host_ms']:.2f} "
            f"| {r['peak_mib']:.0f} | {loss} | {rel} |"
        )
    for r in rows:
        if "report" in r:
            lines += ["", f"## {r['variant']}: {r['optimize_s']:.1f} s, {len(r['chosen'])} layers changed", ""]
            lines += ["```", r["report"], "```"]
    lines += ["", "Measured (UTC): " + ", ".join(f"{r['variant']} {r['measured']}" for r in rows) + "."]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r["variant"] for r in rows]
    ax.barh(names, [r["tokens_per_s"] for r in rows])
    ax.set_xlabel("tokens/s (train step)")
    ax.set_title(f"{meta['model']}, {meta['device']}, bf16", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
