"""2:4 sparsity at model level, one run: a Llama MLP block and the demo's Llama, inference and training, dense
against torchao's 2:4 and kp's; then accuracy of sparse fine-tuning on a small model trained here.

    python benchmarks/bench_sparsity_model.py    # writes results/<device>/sparsity_model.{json,md,png}

Models in bf16 (weights too: torchao's runtime 2:4 training takes 16-bit weights), 8192 tokens a call (the MLP
block's input (4, 2048, 4096), needing its gradient in training, as inside a model).
- Inference (no grad), ms a forward: dense; torchao `sparsify_(semi_sparse_weight())` on the magnitude-pruned
  model (cuSPARSELt); kp `sparsify(route="auto")` (kp prunes and packs, the router keeps dense where 2:4 is not
  faster, and picks cuSPARSELt's algorithm per shape). Plain launches and CUDA-graph replay.
- Training, ms a forward + backward (no optimizer): dense; torchao's `SemiSparseLinear` (runtime 2:4 of the weight
  each step by torch's greedy tile packer, straight-through gradient); kp `sparsify_for_training` with the mask
  every step (SR-STE), every 100 steps, or fixed, each with the sparse route forced and with route="auto"; and
  2:4 activations (`SparseActivationLinear`) into the MLPs' down projections (also timed in inference).
- Accuracy: the test suite's teacher-student task at a larger size: a dense MLP trained, then pruned one shot,
  fine-tuned 2:4 (fixed mask) for as many steps as dense training continues, and trained 2:4 from scratch (SR-STE).
The MLP block is Llama-3-8B's (dim 4096, hidden 14336); the demo's Llama: dim 2048, 4 layers, hidden 5632, its
decoder layers' linears made 2:4 (not the embedding or the head).
"""

from __future__ import annotations

import copy

import bench_sparsity
import demo
import harness
import torch
import torch.nn.functional as F
from torch import nn

import kp_sparsity

TOKENS = 8192


def magnitude_prune_(model: nn.Module, names) -> None:
    """The named layers pruned 2:4 in plain PyTorch (bench_sparsity's), for torchao, which takes 2:4 weights."""
    with torch.no_grad():
        for name in names:
            w = model.get_submodule(name).weight
            w.copy_(bench_sparsity.torch_prune(w))


def linears(model: nn.Module, skip=("lm_head",)) -> list[str]:
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and n and n.split(".")[-1] not in skip]


def inference(model, x, names) -> dict:
    """ms a forward, eager and graph, per provider."""
    out = {}
    providers = {
        "dense": lambda m, _names: m,
        "torchao 2:4": torchao_inference,
        "kp 2:4 (router)": kp_inference,
        "kp 2:4 activations into down_proj": lambda m, _names: kp_activations(m, "sparse"),
    }
    for name, make in providers.items():
        try:
            m = make(copy.deepcopy(model), names)
            with torch.no_grad():
                out[name] = {
                    "eager": harness.bench_ms(lambda m=m: m(x)),
                    "graph": harness.bench_graph_ms(lambda m=m: m(x)),
                }
        except Exception as err:  # an anchor this build lacks is reported, not dropped
            out[name] = {"failed": f"{type(err).__name__}: {err}"[:200]}
        print(f"  inference {name:22s} {out[name]}", flush=True)
    return out


def torchao_inference(model, names):
    from torchao.sparsity import semi_sparse_weight, sparsify_

    magnitude_prune_(model, names)
    sparsify_(model, semi_sparse_weight(), filter_fn=lambda _m, fqn: fqn in names)
    return model


def kp_inference(model, names):
    decisions = kp_sparsity.sparsify(model, module_filter_fn=lambda _m, fqn: fqn in names, tokens=TOKENS)
    routes = {d.shape: (d.route, d.alg_id) for d in decisions}
    print(f"  kp router: {routes}", flush=True)
    return model


def training(model, x, names) -> dict:
    """ms a forward + backward per provider (plain launches: the host work of repacking each step counts)."""
    out = {}
    with torch.no_grad():
        shape = model(x).shape
    # from the CPU generator: a failed CUDA-graph capture above may have left the CUDA one in capture mode
    dy = torch.randn(shape).to(x.device, torch.bfloat16)
    providers = {
        "dense": lambda m: m,
        "torchao SemiSparseLinear": lambda m: torchao_training(m, names),
        "kp mask every step, sparse": lambda m: kp_training(m, names, 1, "sparse"),
        "kp mask every 100, sparse": lambda m: kp_training(m, names, 100, "sparse"),
        "kp fixed mask, sparse": lambda m: kp_training(m, names, None, "sparse"),
        "kp fixed mask, router": lambda m: kp_training(m, names, None, "auto"),
        "kp 2:4 activations into down_proj, sparse": lambda m: kp_activations(m, "sparse"),
    }
    # the block's input needs its gradient, as inside a model (token ids do not)
    xg = x.clone().requires_grad_() if x.is_floating_point() else x
    for name, make in providers.items():
        try:
            m = make(copy.deepcopy(model))
            params = list(m.parameters()) + ([xg] if xg.requires_grad else [])

            def step(m=m):
                m(xg).backward(dy)

            out[name] = {"eager": harness.bench_ms(step, grad_to_none=params)}
        except Exception as err:
            out[name] = {"failed": f"{type(err).__name__}: {err}"[:200]}
        print(f"  training  {name:30s} {out[name]}", flush=True)
    return out


def torchao_training(model, names):
    from torchao.sparsity.training import SemiSparseLinear, swap_linear_with_semi_sparse_linear

    swap_linear_with_semi_sparse_linear(model, {n: SemiSparseLinear for n in names})
    return model


def kp_training(model, names, mask_every, route):
    decisions = kp_sparsity.sparsify_for_training(
        model, module_filter_fn=lambda _m, fqn: fqn in names, mask_every=mask_every, route=route, tokens=TOKENS
    )
    if route == "auto":
        print(f"  kp training router: { {d.shape: d.route for d in decisions} }", flush=True)
    return model


def kp_activations(model, route):
    """The MLPs' down projections take 2:4 inputs (their SiLU-gated activations), dense weights."""
    down = lambda _m, fqn: fqn.endswith("down_proj")  # noqa: E731
    kp_sparsity.sparsify_for_training(model, module_filter_fn=down, activation_filter_fn=down, route=route)
    return model


class LlamaMLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def accuracy() -> list[dict]:
    """Losses (MSE to a teacher) of a dense student, pruned one shot, fine-tuned 2:4, trained 2:4 from scratch."""
    g = torch.Generator().manual_seed(0)
    dim, hidden, out = 256, 1024, 64
    teacher = [torch.randn(hidden, dim, generator=g) / dim**0.5, torch.randn(out, hidden, generator=g) / hidden**0.5]
    x = torch.randn(65536, dim, generator=g).cuda()
    y = torch.tanh(x @ teacher[0].cuda().t()) @ teacher[1].cuda().t()

    def student():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, out)
        ).cuda()

    def train(model, steps):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for i in range(steps):
            rows = slice((i * 1024) % 65536, (i * 1024) % 65536 + 1024)
            F.mse_loss(model(x[rows]), y[rows]).backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            return F.mse_loss(model(x), y).item()

    dense = student()
    pre, post = 2000, 1000
    rows = [dict(section="accuracy", provider="dense", steps=pre, loss=train(dense, pre))]
    one_shot = copy.deepcopy(dense)
    kp_sparsity.sparsify(one_shot, route="dense")
    with torch.no_grad():
        rows.append(
            dict(
                section="accuracy", provider="one-shot magnitude 2:4", steps=pre, loss=F.mse_loss(one_shot(x), y).item()
            )
        )
    tuned = copy.deepcopy(dense)
    kp_sparsity.sparsify_for_training(tuned, mask_every=None, route="dense")
    rows.append(
        dict(section="accuracy", provider="2:4 fine-tuned (fixed mask)", steps=pre + post, loss=train(tuned, post))
    )
    rows.append(dict(section="accuracy", provider="dense, trained on", steps=pre + post, loss=train(dense, post)))
    scratch = student()
    kp_sparsity.sparsify_for_training(scratch, mask_every=1, route="dense")
    rows.append(
        dict(
            section="accuracy", provider="2:4 from scratch (SR-STE)", steps=pre + post, loss=train(scratch, pre + post)
        )
    )
    for r in rows:
        print(f"  accuracy {r['provider']:32s} {r['steps']:5d} steps: loss {r['loss']:.5f}", flush=True)
    return rows


def main() -> None:
    harness.require_gpu()
    torch.manual_seed(0)
    rows = []
    models = {
        "Llama-3-8B MLP block": (LlamaMLP(4096, 14336), torch.randn(4, TOKENS // 4, 4096)),
        "demo Llama (4 x 2048 tokens)": (
            demo.TinyLlama(vocab=32000, dim=2048, layers=4, heads=16, kv_heads=4, hidden=5632, eps=1e-5),
            torch.randint(0, 32000, (4, 2048)),
        ),
    }
    for label, (model, x) in models.items():
        model, x = model.cuda().to(torch.bfloat16), x.cuda()
        x = x.to(torch.bfloat16) if x.is_floating_point() else x
        names = linears(model)
        print(f"{label}: {len(names)} linears made 2:4", flush=True)
        for provider, t in inference(model, x, names).items():
            rows.append(dict(section="inference", model=label, provider=provider, **t))
        for provider, t in training(model, x, names).items():
            rows.append(dict(section="training", model=label, provider=provider, **t))
        del model
        torch.cuda.empty_cache()
    rows += accuracy()
    harness.publish(
        "sparsity_model", {"kernel": "sparsity_model", "dtype": "bfloat16", "tokens": TOKENS}, rows, render, plot
    )


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# 2:4 sparsity at model level, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}; {meta['tokens']} tokens a call. ms: triton's do_bench "
        "median (plain launches) and CUDA-graph replay; x dense: dense ms / provider ms.",
    ]
    for section in ("inference", "training"):
        lines += [
            "",
            f"## {section}",
            "",
            "| model | provider | ms | x dense | graph ms | x dense |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["section"] != section:
                continue
            if "failed" in r:
                lines.append(f"| {r['model']} | {r['provider']} | failed: {r['failed']} | | | |")
                continue
            base = next(
                d for d in rows if d["section"] == section and d["model"] == r["model"] and d["provider"] == "dense"
            )
            cells = []
            for key in ("eager", "graph"):
                cells += [f"{r[key]:.3f}", f"{base[key] / r[key]:.2f}x"] if key in r else ["", ""]
            lines.append(f"| {r['model']} | {r['provider']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## accuracy (MSE to the teacher, all 65536 samples)",
        "",
        "| student | steps | loss |",
        "|---|---|---|",
    ]
    lines += [f"| {r['provider']} | {r['steps']} | {r['loss']:.5f} |" for r in rows if r["section"] == "accuracy"]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    timed = [
        dict(
            group=f"{r['section']}: {r['model'].split(' (')[0]}",
            provider=r["provider"],
            speedup=next(
                d["eager"]
                for d in rows
                if d.get("model") == r["model"] and d["section"] == r["section"] and d["provider"] == "dense"
            )
            / r["eager"],
        )
        for r in rows
        if r["section"] != "accuracy" and "eager" in r
    ]
    harness.plot_grouped(
        timed, path, "group", "speedup", "x dense (plain launches)", f"2:4 at model level, {meta['device']}"
    )


if __name__ == "__main__":
    main()
