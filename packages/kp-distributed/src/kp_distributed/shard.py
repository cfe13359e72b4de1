"""shard(): torchtitan's FSDP2 recipe in one call. Per transformer block, in this order: activation checkpointing,
torch.compile, fully_shard; then the root module. The last block and the root are not resharded after the forward
(the backward needs them at once), and each block prefetches the next blocks' parameters in the forward and the
previous ones in the backward (explicit prefetching: the all-gathers are issued before the compute that would
otherwise wait).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from kp_distributed.mesh import STRATEGIES, check_model, make_mesh

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the entries of the largest nn.ModuleList (or nn.Sequential) whose entries are all of
    one class (model.layers in Llama-style models, transformer.h in GPT-2); [] when there is none.

    Examples:
        >>> from torch import nn
        >>> import kp_distributed
        >>> class Model(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.embed = nn.Embedding(100, 32)
        ...         self.layers = nn.ModuleList([nn.TransformerEncoderLayer(32, 4) for _ in range(3)])
        >>> blocks = kp_distributed.find_blocks(Model())
        >>> len(blocks), type(blocks[0]).__name__
        (3, 'TransformerEncoderLayer')
    """
    check_model("find_blocks", model)
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) > len(best):
            entries = list(module)
            if len({type(m) for m in entries}) == 1 and any(True for _ in entries[0].parameters()):
                best = entries
    return best


def mp_policy(mixed_precision):
    """FSDP2's MixedPrecisionPolicy from (param dtype, reduce dtype) names; None for full precision."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None:
        return MixedPrecisionPolicy()
    if (
        not isinstance(mixed_precision, (tuple, list))
        or len(mixed_precision) != 2
        or any(name not in DTYPES for name in mixed_precision)
    ):
        raise ValueError(
            f"shard: mixed_precision must be None or (param dtype, reduce dtype), each one of {sorted(DTYPES)}, "
            f"got {mixed_precision!r}"
        )
    param, reduce = (DTYPES[name] for name in mixed_precision)
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)


def _check(strategy, prefetch, activation_checkpointing, mesh) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"shard: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"shard: prefetch must be an int >= 0 (blocks fetched ahead), got {prefetch!r}")
    ac = activation_checkpointing
    if ac not in (None, "full") and (isinstance(ac, bool) or not isinstance(ac, int) or ac < 1):
        raise ValueError(
            f"shard: activation_checkpointing must be None, 'full' or an int k >= 1 (every k-th block), got {ac!r}"
        )
    if mesh is not None:
        want = {"full": 1, "hybrid": 2, "none": 1}[strategy]
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != want:
            raise ValueError(f"shard: strategy {strategy!r} takes a {want}-D DeviceMesh, got {mesh!r}")


def _no_cache(model: nn.Module) -> None:
    """Turn off a Hugging Face model's KV cache: a checkpointed block recomputed in the backward would append its
    keys and values to the cache a second time (as transformers' own gradient_checkpointing_enable does)."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)}
    for config in configs.values():
        config.use_cache = False
    if configs:
        warnings.warn("shard: activation checkpointing: use_cache set to False in the model's config", stacklevel=3)


def _checkpointed(blocks: list[nn.Module], every, model: nn.Module) -> list[nn.Module]:
    """Wrap every k-th block ("full": all) for activation checkpointing, in place in its parent."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    k = 1 if every == "full" else every
    _no_cache(model)
    parents = {id(child): (parent, name) for parent in model.modules() for name, child in parent.named_children()}
    out = []
    for i, block in enumerate(blocks):
        if i % k == 0:
            if id(block) not in parents:
                raise ValueError(f"shard: blocks[{i}] ({type(block).__name__}) is not a submodule of the model")
            parent, name = parents[id(block)]
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
            setattr(parent, name, wrapped)
            block = wrapped
        out.append(block)
    return out


def shard(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    strategy: str = "full",
    mixed_precision=("bf16", "fp32"),
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    activation_checkpointing=None,
    compile_blocks=False,
    offload: bool = False,
    blocks: list[nn.Module] | None = None,
) -> nn.Module:
    """Shard `model` for data-parallel training over all ranks; returns the module to train (the same module,
    sharded in place, except strategy="none", which returns a DistributedDataParallel around it).

    strategy: "full" (FSDP2), "hybrid" (HSDP on a (replicate, shard) mesh), "none" (DDP: whole parameters).
    mixed_precision: (param dtype, gradient reduce dtype) names, "bf16" / "fp16" / "fp32"; None keeps the
    parameters' dtype. The optimizer steps the sharded parameters in their own dtype (fp32 for an fp32 model).
    With strategy="none" it is checked and not applied: DDP computes in the parameters' dtype (use autocast, and
    kp_distributed.compress for the gradients' all-reduce).
    reshard_after_forward: free each block's gathered parameters after its forward, to gather them again in the
    backward (False: keep them, more memory, fewer all-gathers); the last block and the root are kept either way.
    prefetch: how many blocks ahead each block's all-gather is issued (0: FSDP2's implicit prefetch only).
    activation_checkpointing: None, "full" (every block) or k (every k-th block). compile_blocks: True, or a dict
    of torch.compile options, compiles each block. offload: parameters, gradients and optimizer state on the
    CPU (FSDP2's CPUOffloadPolicy). blocks: the transformer blocks, when find_blocks cannot find them.

    The parameters then are DTensors sharded over the mesh ("full", "hybrid"); the model's inputs and outputs
    are as before.

    Examples:
        In a script started with `torchrun --nproc-per-node 2 train.py` (here two CPU processes, gloo):

        >>> import torch
        >>> from torch import nn
        >>> import kp_distributed
        >>> kp_distributed.init()
        >>> model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])  # 4 blocks of one class
        >>> model = kp_distributed.shard(model, mixed_precision=None)
        >>> type(model[0].weight).__name__, tuple(model[0].weight.to_local().shape)  # each rank holds half
        ('DTensor', (32, 64))
        >>> model(torch.randn(8, 64)).sum().backward()
    """
    check_model("shard", model)
    _check(strategy, prefetch, activation_checkpointing, mesh)
    policy = mp_policy(mixed_precision)
    if blocks is None:
        blocks = find_blocks(model)
    if not blocks:
        raise ValueError(
            f"shard: no transformer blocks found in {type(model).__name__} (looked for an nn.ModuleList of modules "
            "of one class, as model.layers); pass blocks=[...]"
        )
    if activation_checkpointing is not None:
        blocks = _checkpointed(blocks, activation_checkpointing, model)
    if compile_blocks:
        options = compile_blocks if isinstance(compile_blocks, dict) else {}
        for block in blocks:
            block.compile(**options)
    mesh = mesh if mesh is not None else make_mesh(strategy)
    if strategy == "none":
        return _replicate(model, mesh)
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kw = dict(mesh=mesh, mp_policy=policy, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not last, **kw)
    # the root (embeddings, final norm, head) is never resharded after the forward: the backward starts with it.
    # FSDP2 does so by itself only when the root's reshard_after_forward is left unset; set to True (torch 2.11 and
    # 2.13 obey it), the root would be all-gathered again at once, which cost about 1 % of a step on 2 x H100.
    fully_shard(model, reshard_after_forward=False, **kw)
    if prefetch:
        for i, block in enumerate(blocks):
            ahead = blocks[i + 1 : i + 1 + prefetch]
            behind = blocks[max(0, i - prefetch) : i][::-1]
            if ahead:
                block.set_modules_to_forward_prefetch(ahead)
            if behind:
                block.set_modules_to_backward_prefetch(behind)
    return model


def _replicate(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.get_group())
