"""Device meshes for the three strategies, from the running process group.

- "full": one dimension, ("shard",): every rank holds 1/N of each parameter (FSDP2, ZeRO-3).
- "hybrid": two dimensions, ("replicate", "shard"): parameters sharded within a group of `shard` ranks and
  replicated across the `replicate` groups (HSDP). torchrun numbers the ranks of a node consecutively, so with
  shard = GPUs per node the shard groups are the nodes: all-gathers and reduce-scatters stay on NVLink, and only
  the gradient all-reduce between replicas crosses the network.
- "none": one dimension, ("replicate",): whole parameters on every rank (DDP).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

STRATEGIES = ("full", "hybrid", "none")


def device_type() -> str:
    """The device this process computes on: "cuda" where it has a GPU (NCCL), else "cpu" (gloo)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_mesh(strategy: str = "full", *, replicate: int | None = None) -> DeviceMesh:
    """The device mesh of `strategy` over all ranks of the default process group. For "hybrid", replicate is the
    number of shard groups (default: the number of nodes, world size / LOCAL_WORLD_SIZE, as torchrun sets it;
    2 on a single node). Raises ValueError on every rank alike when the sizes do not fit."""
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


def init(backend: str | None = None) -> None:
    """Join the process group torchrun describes (env:// rendezvous): NCCL with one GPU per local rank, or gloo
    without GPUs. Idempotent."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
