"""What each rank runs in kp-distributed's tests: real processes (torch.multiprocessing) on gloo, or on NCCL with a
GPU each where a test asks for it, no mocks. spawn(world, fn, *args) runs fn(rank, world, *args) in `world`
processes and returns their results by rank.

The ranks start from a fork server that has imported torch once (each spawned rank imported it afresh: ~8 of
the ~10 s a small test took on 2 cores). A forked rank gets the server's environment, not the test's, so each
rank is handed the test's environment and imports fn only after taking it: TRITON_INTERPRET is read when the kp
packages import. Nothing that reads the environment at import time is preloaded, and CUDA is not initialised
in the server."""

from __future__ import annotations

import datetime
import importlib
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import kp_distributed

TIMEOUT = datetime.timedelta(seconds=60)
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "torch.multiprocessing"])


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    """A transformer-shaped model: embedding, a ModuleList of blocks, final norm, head."""

    def __init__(self, dim=16, layers=3, vocab=32, tied=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        if tied:  # the head's weight is the embedding's, as in GPT-2
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def batch(step: int, rows: int = 8, seq: int = 6, vocab: int = 32):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (rows, seq + 1), generator=g)


def loss_of(model, tokens):
    tokens = tokens.to(device())
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def device() -> torch.device:
    """This rank's device: its GPU when the group runs NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def train(model, optimizer, steps, rank=0, world=1, first=0):
    """Steps on the global batch of each step, this rank's rows of it; the global mean loss per step."""
    losses = []
    for step in range(first, first + steps):
        rows = batch(step).chunk(world)[rank]
        loss = loss_of(model, rows)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered whole (DTensors), by its plain name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[kp_distributed.checkpoint._clean(name)] = t.detach().to("cpu", copy=True)
    return out


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return Tiny(**kw)


def _entry(rank, world, out, target, args, backend, env):
    os.environ.clear()
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        module, name = target
        fn = getattr(importlib.import_module(module), name)
        # a file rendezvous (no port to collide with another test's), and a stuck collective fails in 60 s
        store = f"file://{Path(out) / 'store'}"
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=store, rank=rank, world_size=world, timeout=TIMEOUT)
        result = fn(rank, world, *args)
    except BaseException:
        result = {"error": traceback.format_exc()}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()
    # Skip the interpreter's teardown: gloo's worker threads can still hold work objects then, and freeing them
    # without the GIL aborts the process now and then (pytorch/pytorch#190489). The result is already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start(world: int, out: str, fn, args, backend: str):
    target = (fn.__module__, fn.__qualname__)
    entry_args = (world, out, target, args, backend, dict(os.environ))
    return mp.start_processes(_entry, entry_args, nprocs=world, start_method="forkserver", join=False)


def spawn(world: int, fn, *args, deadline: float = 180.0, backend: str = "gloo") -> list:
    with tempfile.TemporaryDirectory() as out:
        ctx = _start(world, out, fn, args, backend)
        start = time.monotonic()
        while not ctx.join(timeout=1):
            if time.monotonic() - start > deadline:
                for p in ctx.processes:
                    p.kill()
                raise AssertionError(f"{fn.__name__} on {world} ranks: no result after {deadline:.0f} s (a hang)")
        results = [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for r, res in enumerate(results):
        if isinstance(res, dict) and "error" in res and len(res) == 1:
            raise AssertionError(f"rank {r} failed:\n{res['error']}")
    return results


def spawn_killed(world: int, fn, *args, deadline: float = 180.0) -> int:
    """Run fn as spawn does, where one rank kills itself with SIGKILL mid-run: torch.multiprocessing then ends the
    other ranks (as torchrun does). Returns the signal the dead rank got."""
    with tempfile.TemporaryDirectory() as out:
        ctx = _start(world, out, fn, args, "gloo")
        start = time.monotonic()
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() - start > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise AssertionError(f"{fn.__name__}: no rank died within {deadline:.0f} s")
        except mp.ProcessExitedException as e:
            return e.signal_name if hasattr(e, "signal_name") else e.exit_code
    raise AssertionError(f"{fn.__name__}: every rank finished; none was killed")
