"""What kp-sparsity's layers share, below all of them: the 2:4 matmul dtypes, whether a weight can run 2:4, GPU
timing for the routers, and the nn.Linear plumbing of the training layers (kp_sparsity.training's 2:4 weights,
kp_sparsity.activations' 2:4 inputs)."""

from __future__ import annotations

import torch
from torch import nn

from kp_sparsity import functional

SPARSE_DTYPES = (torch.float16, torch.bfloat16)


def time_ms(fn, reps: int = 20) -> float:
    """GPU time of fn in ms: reps calls back to back between two CUDA events (as a model's layers run: the host
    queues ahead), after warmup (cuSPARSELt picks its algorithm on the first calls)."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def eligible(shape, dtype: torch.dtype, device: torch.device, matmul: bool) -> str:
    """Why a weight of this shape, dtype and device cannot be 2:4 ('' when it can); matmul: it must also run the
    2:4 matmul."""
    if dtype not in (SPARSE_DTYPES if matmul else functional.prune_op.DTYPES):
        return f"dtype {dtype} (2:4 matmuls take fp16 / bf16)"
    if matmul and device.type != "cuda":
        return "not on a CUDA device"
    if shape[1] % 4 or (matmul and (shape[0] % 32 or shape[1] % 64)):
        return f"shape {tuple(shape)} (out_features a multiple of 32, in_features of 64)"
    return ""


def sharing(cls, linear: nn.Linear):
    """An instance of cls (an nn.Linear subclass) holding linear's own parameters, no copy and no __init__ run:
    what from_dense builds on."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{cls.__name__}.from_dense: linear must be an nn.Linear, got {type(linear).__name__}")
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    return new


def compute_operands(layer: nn.Linear, x: torch.Tensor):
    """(x, weight, bias) in the dtype the layer computes in: autocast's where it is on (an fp32 weight cast for the
    call, its gradient flowing back to it), else the weight's."""
    weight, bias = layer.weight, layer.bias
    dev = x.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    if weight.dtype != dtype:
        weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
    return x.to(dtype), weight, bias
