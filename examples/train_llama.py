"""Train a small Llama-style model with FSDP2 through kp_distributed, on synthetic data.

    torchrun --nproc-per-node 2 examples/train_llama.py --steps 100 --ckpt /tmp/ckpt
    torchrun --nproc-per-node 2 --max-restarts 3 examples/train_llama.py --steps 100 --ckpt /tmp/ckpt --resume

Each step's global batch (sequences that repeat a random 32-token block, so there is something to learn) is drawn
from a generator seeded with the step number and split across the data-parallel ranks, so a run resumed from a
checkpoint sees the same data as an uninterrupted one. Rank 0 prints a line per
--log-every steps (loss, tokens/s over all ranks, peak memory) and appends it as JSON to --log-file. With --resume the
run starts from --ckpt's latest complete checkpoint, which is what torchrun's restarts after a failure need.
--die-at STEP makes rank 1 kill itself (SIGKILL) before that step on the first attempt: fault injection for tests.
--kernels computes the norms, attention and SwiGLU with kp-norms' and kp-attention's kernels; --fp8 RECIPE runs
the block's linears in float8 (kp-precision's, or torchao's with --fp8-impl torchao), and --fp8-all-gather
all-gathers their weights in float8 too. --optimize runs kp.optimize on the model before it is sharded.
--baseline torchtitan --compile --fp8 tensorwise --fp8-impl torchao --fp8-all-gather is torchtitan's recipe.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kp_distributed

PERIOD = 32  # tokens in the repeated block of the synthetic data


def rms_norm(dim, kernels):
    if kernels:
        import kp_norms

        return kp_norms.RMSNorm(dim)
    return nn.RMSNorm(dim)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads, kernels=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.kernels = heads, kv_heads, dim // heads, kernels
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split([d, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], -1)
        if self.kernels:  # (batch, seq, heads, head_dim) as it comes; grouped-query attention in the kernel
            import kp_attention

            q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k, v))
            return self.out(kp_attention.flash_attention(q, k, v, causal=True, backend="kp").reshape(b, s, d))
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.kv_heads != self.heads:  # grouped-query attention
            k, v = (t.repeat_interleave(self.heads // self.kv_heads, 1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, hidden, kernels=False):
        super().__init__()
        self.attn_norm, self.mlp_norm = rms_norm(dim, kernels), rms_norm(dim, kernels)
        self.attn = Attention(dim, heads, kv_heads, kernels)
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.kernels = kernels

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, -1)
        if self.kernels:
            import kp_norms

            return x + self.down(kp_norms.swiglu(gate, up))
        return x + self.down(F.silu(gate) * up)


class Llama(nn.Module):
    def __init__(self, vocab, dim, layers, heads, kv_heads, hidden, kernels=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, hidden, kernels) for _ in range(layers))
        self.norm = rms_norm(dim, kernels)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2816)
    p.add_argument("--strategy", default="full", choices=kp_distributed.STRATEGIES)
    p.add_argument("--mp", default="bf16,fp32", help="param,reduce dtypes (bf16, fp16, fp32) or none")
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--ac", default="none", help="activation checkpointing: none, full or k (every k-th block)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt", default=None, help="checkpoint folder")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--export", default=None, help="write the whole model here at the end (.safetensors or .pt)")
    p.add_argument("--log-file", default=None, help="append one JSON line per logged step")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument(
        "--baseline",
        nargs="?",
        const="plain",
        choices=("plain", "torchtitan"),
        help="shard by hand instead of with kp_distributed.shard: a plain fully_shard loop, or torchtitan's recipe",
    )
    p.add_argument("--kernels", action="store_true", help="kp-norms' and kp-attention's kernels in the blocks")
    p.add_argument("--fp8", default="none", choices=("none", "tensorwise", "rowwise", "blockwise"))
    p.add_argument("--fp8-all-gather", action="store_true", help="all-gather the float8 weights in float8")
    p.add_argument(
        "--fp8-impl",
        default="kp",
        choices=("kp", "torchao"),
        help="whose float8 linears --fp8 / --fp8-all-gather use: kp-precision's or torchao's (torchtitan's choice)",
    )
    p.add_argument(
        "--optimize",
        nargs="?",
        const="events",
        choices=("events", "graph"),
        help="kp.optimize the model before sharding (every rank takes rank 0's timings: kp.rank0_timer); 'graph': "
        "time the GPU's work alone (kp.graph_timer), for compiled blocks",
    )
    p.add_argument("--profile", type=int, default=0, help="profile the last N steps: the overlap report")
    return p.parse_args(argv)


def batch(step, args, rank, world, device):
    """This rank's rows of step's global batch (the same for any restart)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    # a random block of PERIOD tokens repeated: learnable (each token after the first block is a copy), so the loss
    # falls, from about ln(vocab) toward ln(vocab) * PERIOD / seq, and runs can be compared by their curves
    block = torch.randint(0, args.vocab, (args.batch * world, PERIOD), generator=g)
    tokens = block.repeat(1, -(-(args.seq + 1) // PERIOD))[:, : args.seq + 1]
    return tokens.chunk(world)[rank].to(device)


def memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # peak RSS (KiB on Linux)


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def hand_sharded(model, mp, recipe, compile_blocks=False):
    """The comparisons, written out by hand. plain: each block, then the root. torchtitan: its Llama recipe (as of
    2026): the embedding, each block, the final norm with the head (not resharded after the forward), the root; no
    explicit prefetch. compile_blocks: each block compiled before it is sharded, as torchtitan does."""
    from torch.distributed.fsdp import fully_shard

    from kp_distributed.shard import mp_policy

    policy = mp_policy(mp)  # the same dtypes as kp's run
    if recipe == "torchtitan":
        fully_shard(model.embed, mp_policy=policy, reshard_after_forward=True)
    for block in model.layers:
        if compile_blocks:
            block.compile()
        fully_shard(block, mp_policy=policy, reshard_after_forward=True)
    if recipe == "torchtitan":
        fully_shard([model.norm, model.head], mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=policy)
    return model


def build(args, device) -> nn.Module:
    """The model on `device`, with kp's kernels and float8 linears as asked (not sharded yet)."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank, before sharding
    model = Llama(args.vocab, args.dim, args.layers, args.heads, args.kv_heads, args.hidden, args.kernels).to(device)
    if args.fp8 != "none" or args.fp8_all_gather:
        recipe = "tensorwise" if args.fp8 == "none" else args.fp8
        keep = lambda m, fqn: fqn != "head"  # noqa: E731 (the head stays in the parameter dtype, as torchtitan's)
        if getattr(args, "fp8_impl", "kp") == "torchao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = Float8LinearConfig.from_recipe_name(recipe)
            if args.fp8_all_gather:
                config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
            convert_to_float8_training(model, config=config, module_filter_fn=keep)
        else:
            import kp_precision

            config = kp_precision.Float8Config(recipe=recipe, fsdp_float8_all_gather=args.fp8_all_gather)
            kp_precision.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return model


def optimized(model, args, rank, world, device, mp):
    """kp.optimize on the whole (not yet sharded) model, at the dtype the blocks will compute in (the mixed
    precision policy's), then its float32 weights back as they were. Every rank decides with rank 0's timings, so
    every rank keeps the same modules."""
    import kp
    from kp_distributed.shard import mp_policy

    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to(mp_policy(mp).param_dtype or torch.float32)
    timer = kp.rank0_timer(kp.graph_timer if args.optimize == "graph" else None)
    deny = None if device.type == "cuda" else ["float8", "sparsity"]  # interpreted float8 matmuls take minutes
    example = batch(0, args, rank, world, device)[:, :-1]
    report = kp.optimize(model, (example,), mode="train", deny=deny, cache=False, timer=timer, report=rank == 0)
    model.to(torch.float32)
    model.load_state_dict(weights)
    return report


def main(argv=None) -> None:
    args = parse(argv)
    kp_distributed.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = build(args, device)
    precompute = None
    if args.fp8_all_gather and args.fp8_impl == "torchao":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as precompute
    elif args.fp8_all_gather:
        import kp_precision

        precompute = kp_precision.precompute_float8_scales
    ac = None if args.ac == "none" else ("full" if args.ac == "full" else int(args.ac))
    mp = None if args.mp == "none" else tuple(args.mp.split(","))
    if args.optimize:
        optimized(model, args, rank, world, device, mp)
    if args.baseline:
        model = hand_sharded(model, mp, args.baseline, args.compile)
    else:
        model = kp_distributed.shard(
            model,
            strategy=args.strategy,
            mixed_precision=mp,
            prefetch=args.prefetch,
            activation_checkpointing=ac,
            compile_blocks=args.compile,
        )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    ckpt = kp_distributed.Checkpointer(args.ckpt, async_save=args.async_save) if args.ckpt else None
    start = 0
    if args.resume and ckpt is not None:
        start, _ = ckpt.load(model, opt)
        if rank == 0:
            print(f"resumed from step {start}" if start else "no checkpoint: starting at step 0", flush=True)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    tokens_per_step = args.batch * args.seq * world
    t0, done = time.perf_counter(), 0
    prof = None
    for step in range(start, args.steps):
        if args.die_at == step and rank == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if args.profile and step == max(start, args.steps - args.profile):
            prof = torch.profiler.profile()  # CPU, and the GPU's kernels where there is one
            prof.__enter__()
        rows = batch(step, args, rank, world, device)
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precompute is not None:  # the next all-gathers' float8 scales, in one all-reduce
            precompute(model)
        done += 1
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
            record = {
                "step": step + 1,
                "loss": mean.item() / world,
                "tokens_per_s": tokens_per_step * done / elapsed,
                "memory_gib": memory_gib(device),
                "world": world,
                "attempt": attempt,
            }
            if rank == 0:
                print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
                if args.log_file:
                    with open(args.log_file, "a") as f:
                        f.write(json.dumps(record) + "\n")
            t0, done = time.perf_counter(), 0
        if ckpt is not None and args.save_every and (step + 1) % args.save_every == 0:
            paused = time.perf_counter()
            ckpt.save(step + 1, model, opt)
            t0 += time.perf_counter() - paused  # tokens/s counts training time only
    if ckpt is not None:
        ckpt.wait()
    if prof is not None:
        prof.__exit__(None, None, None)
        # GPU kernels: NCCL's against the rest (none on CPU processes)
        hidden = kp_distributed.overlap(kp_distributed.kernel_intervals(prof))
        if rank == 0:
            print("overlap " + " ".join(f"{k} {v:.4g}" for k, v in hidden.items()), flush=True)
            if args.log_file:
                with open(args.log_file, "a") as f:
                    f.write(json.dumps({"overlap": hidden, "steps": args.profile}) + "\n")
    if rank == 0 and args.log_file:  # this rank's parameters and AdamW state (gradients: as many as parameters)
        state = sum(local_bytes(p) for p in model.parameters())
        state += sum(local_bytes(t) for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
        with open(args.log_file, "a") as f:
            f.write(json.dumps({"state_gib": state / 2**30, "world": world}) + "\n")
    if args.export:
        kp_distributed.export(model, args.export)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
