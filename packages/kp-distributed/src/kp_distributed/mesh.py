"""Device meshes for the three strategies, from the running process group.

- "full": one dimension, ("shard",): every rank holds 1/N of each parameter (FSDP2, ZeRO-3).
- "hybrid": two dimensions, ("replicate", "shard"): parameters sharded within a group of `shard` ranks and
  replicated across the `replicate` groups (HSDP). torchrun numbers the ranks of a node consecutively, so with
  shard = GPUs per node the shard groups are the nodes: all-gathers and reduce-scatters stay on NVLink, and only
  the gradient all-reduce between replicas crosses the network.
- "none": one dimension, ("replicate",): whole parameters on every rank (DDP).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

STRATEGIES = ("full", "hybrid", "none")
"""The strategies make_mesh and shard take: "full" (FSDP2), "hybrid" (HSDP), "none" (DDP)."""


def device_type() -> str:
    """The device the process group computes on: "cuda" where it runs NCCL, else "cpu" (gloo, GPUs or not)."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    return "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"


def make_mesh(strategy: str = "full", *, replicate: int | None = None) -> DeviceMesh:
    """The device mesh of `strategy` over all ranks of the default process group. For "hybrid", replicate is the
    number of shard groups (default: the number of nodes, world size / LOCAL_WORLD_SIZE, as torchrun sets it;
    2 on a single node). Raises ValueError on every rank alike when the sizes do not fit.

    The mesh's device type is "cuda" when the process group runs NCCL, else "cpu".

    Examples:
        In a script started with `torchrun --nproc-per-node 2 train.py` (here two CPU processes, gloo):

        >>> import kp_distributed
        >>> kp_distributed.init()
        >>> kp_distributed.make_mesh("full").mesh_dim_names
        ('shard',)
        >>> mesh = kp_distributed.make_mesh("hybrid", replicate=2)  # 2 replicas of 1 rank each
        >>> mesh.mesh_dim_names, tuple(mesh.shape)
        (('replicate', 'shard'), (2, 1))
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"make_mesh: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not dist.is_initialized():
        raise RuntimeError(
            "make_mesh: torch.distributed is not initialized; start with torchrun and call kp_distributed.init() "
            "(or torch.distributed.init_process_group) first"
        )
    world = dist.get_world_size()
    if strategy == "full":
        return init_device_mesh(device_type(), (world,), mesh_dim_names=("shard",))
    if strategy == "none":
        return init_device_mesh(device_type(), (world,), mesh_dim_names=("replicate",))
    if replicate is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        replicate = world // local if local < world else 2
    if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1 or world % replicate:
        raise ValueError(
            f"make_mesh: hybrid sharding needs replicate to divide the world size {world}, got replicate={replicate!r}"
        )
    return init_device_mesh(device_type(), (replicate, world // replicate), mesh_dim_names=("replicate", "shard"))


def init(backend: str | None = None, timeout: datetime.timedelta | None = None) -> None:
    """Join the process group torchrun describes (env:// rendezvous): by default NCCL with one GPU per local rank
    where there are GPUs, else gloo (backend="gloo" keeps a GPU machine's ranks on the CPU). timeout: how long a
    collective waits for the other ranks before it fails (torch's default: 10 minutes for NCCL, 30 for gloo).
    Idempotent.

    Examples:
        In a script started with `torchrun --nproc-per-node 2 train.py` (here two CPU processes, gloo):

        >>> import datetime
        >>> import torch.distributed as dist
        >>> import kp_distributed
        >>> kp_distributed.init(timeout=datetime.timedelta(minutes=5))
        >>> dist.get_world_size(), dist.get_backend()
        (2, 'gloo')
        >>> kp_distributed.init()  # again: nothing happens
    """
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, timeout=timeout)
        return
    # Under torchrun the ranks meet in the agent's store, which outlives a restart: the keys the failed attempt's
    # ranks left there (their gloo addresses, NCCL's unique id) would be read by the new ranks, which then connect
    # to processes that are gone (pytorch/pytorch#167288). Each attempt gets its own key space.
    kw = {} if timeout is None else {"timeout": timeout}
    store, rank, world = next(dist.rendezvous("env://", **kw))
    store = dist.PrefixStore(f"kp_distributed/attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, **kw)


def check_model(caller: str, model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}: model must be a torch.nn.Module, got {type(model).__name__}")
