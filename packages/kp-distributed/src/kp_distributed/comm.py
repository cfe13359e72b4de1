"""Gradient communication: compression hooks for DDP replicas (strategy="none"), and the profiler's account of how
much communication ran hidden behind compute.

FSDP2's own gradient reduction takes its dtype from shard()'s mixed_precision (the second name: "fp32" reduces in
float32, "bf16" halves the bytes); on a hybrid mesh it reduce-scatters within the shard group, then all-reduces
across replicas (the hierarchical reduction), so only 1/shard of the gradient crosses between nodes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

HOOKS = ("bf16", "fp16", "powersgd")


def compress(ddp_model: nn.Module, kind: str = "bf16", *, rank: int = 4, start_iter: int = 10):
    """Register a gradient compression hook on a DistributedDataParallel module: "bf16" (NCCL only) or "fp16"
    (gradients cast for the all-reduce, half the bytes), or "powersgd" (a rank-`rank` approximation of each
    gradient matrix after `start_iter` plain all-reduce steps, error feedback on). Returns the hook's state (None
    for the casts); PowerSGD's must be checkpointed with the run to resume it exactly.

    Examples:
        In a script started with `torchrun --nproc-per-node 2 train.py` (here two CPU processes, gloo):

        >>> import torch
        >>> from torch import nn
        >>> import kp_distributed
        >>> kp_distributed.init()
        >>> ddp = kp_distributed.shard(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), strategy="none")
        >>> state = kp_distributed.compress(ddp, "powersgd", rank=2, start_iter=2)
        >>> type(state).__name__
        'PowerSGDState'
        >>> ddp(torch.randn(8, 64)).sum().backward()
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"compress: ddp_model must be a DistributedDataParallel (shard(..., strategy='none')), got "
            f"{type(ddp_model).__name__}"
        )
    if kind not in HOOKS:
        raise ValueError(f"compress: kind must be one of {HOOKS}, got {kind!r}")
    group = ddp_model.process_group
    if kind == "bf16" and dist.get_backend(group) != "nccl":
        raise ValueError(f"compress: 'bf16' needs NCCL (torch's hook), the group runs {dist.get_backend(group)}")
    if kind == "powersgd" and torch.cuda.is_available() and any(not p.is_cuda for p in ddp_model.parameters()):
        # caught here: the hook itself fails in the backward, with an error about devices that names no cause
        raise ValueError(
            "compress: 'powersgd' needs the gradients on the GPU when CUDA is available (torch's hook calls "
            "torch.cuda.synchronize on the gradients' device); move the model to its GPU, or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES='') to train on CPU processes"
        )
    if kind == "bf16":
        ddp_model.register_comm_hook(group, default_hooks.bf16_compress_hook)
        return None
    if kind == "fp16":
        ddp_model.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return None
    state = powerSGD_hook.PowerSGDState(
        process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter
    )
    ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return state


def overlap(intervals) -> dict[str, float]:
    """How much communication ran while compute ran: intervals are (name, start, end) of GPU kernels (any time
    unit; kernel_intervals() reads them from a torch.profiler run), a kernel whose name holds "nccl" counted as
    communication. Returns comm and compute time (each the length of the union of its kernels), the overlapped
    time, and the share of communication hidden behind compute (1.0 when there is none).

    Examples:
        >>> import kp_distributed
        >>> kernels = [("ncclKernel_AllGather", 0, 10), ("gemm", 5, 20), ("ncclKernel_ReduceScatter", 30, 35)]
        >>> kp_distributed.overlap(kernels)
        {'comm': 15, 'compute': 15, 'overlapped': 5.0, 'hidden': 0.3333333333333333}
    """
    if not isinstance(intervals, (list, tuple)):
        raise TypeError(f"overlap: intervals must be a list of (name, start, end), got {type(intervals).__name__}")
    comm = _union([(s, e) for name, s, e in intervals if "nccl" in name.lower()])
    compute = _union([(s, e) for name, s, e in intervals if "nccl" not in name.lower()])
    both, i, j = 0.0, 0, 0
    while i < len(comm) and j < len(compute):
        lo, hi = max(comm[i][0], compute[j][0]), min(comm[i][1], compute[j][1])
        both += max(0.0, hi - lo)
        if comm[i][1] < compute[j][1]:
            i += 1
        else:
            j += 1
    comm_t, compute_t = sum(e - s for s, e in comm), sum(e - s for s, e in compute)
    return {"comm": comm_t, "compute": compute_t, "overlapped": both, "hidden": both / comm_t if comm_t else 1.0}


def _union(spans):
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def kernel_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel a finished torch.profiler.profile recorded.

    Examples:
        >>> import torch
        >>> import kp_distributed
        >>> with torch.profiler.profile() as prof:
        ...     y = torch.randn(256, 256) @ torch.randn(256, 256)
        >>> kp_distributed.kernel_intervals(prof)  # on a CPU no GPU kernel ran; on a GPU pass it to overlap()
        []
    """
    from torch.autograd import DeviceType

    if not callable(getattr(prof, "events", None)):
        raise TypeError(f"kernel_intervals: prof must be a finished torch.profiler.profile, got {type(prof).__name__}")

    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
