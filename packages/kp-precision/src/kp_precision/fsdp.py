"""Float8 all-gather under FSDP2 (`Float8Config(fsdp_float8_all_gather=True)`).

Without it, FSDP2 all-gathers a Float8Linear's weight in the parameter dtype (2 bytes an element in bf16) and the
forward then casts the whole gathered weight to float8. With it, each rank casts its own shard before the
all-gather: the all-gather moves 1 byte an element, and the forward uses the gathered float8 data as it is.

FSDP2 calls two methods of a sharded parameter's local tensor, when it has them (its all-gather extension):

    fsdp_pre_all_gather(mesh, ...)                 -> ((float8 shard,), (scale, amax))
    fsdp_post_all_gather(outputs, metadata, dtype) -> the unsharded weight

Float8AllGatherWeight is that local tensor: it wraps the high-precision weight (or shard) and is that tensor to
every other op (the optimizer, state_dict, DCP). The unsharded weight is a Float8GatheredWeight: the float8 data
and its scale, with the parameter's dtype and shape; Float8Linear reads the two directly, and any other op sees
the dequantised weight.

The recipe is tensorwise with dynamic scaling. The amax is the whole weight's (an all-reduce of the shards'
amaxes), q = FP8_MAX / max(amax, EPS) and data = float8(saturate(w * q)): kp_precision.quantize's formula, so the
float8 weight is bit for bit what an unsharded Float8Linear computes from the same weight. Each all-gather then
issues its own one-element all-reduce; `precompute_float8_scales(model)` after the optimizer step does every
weight's in one (the weights' version counters tell whether a precomputed scale still holds, so a missed call
costs an all-reduce, never a stale scale).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

import kp_core
from kp_core.float8 import multiplier, saturating_cast
from kp_precision.float8 import Float8Tensor

E4M3 = torch.float8_e4m3fn
aten = torch.ops.aten

# Ops through which the wrapper stays a wrapper: those FSDP2 applies to a parameter to shard and pad it (chunk,
# new_zeros, slice, copy_, view), to move it (_to_copy, _pin_memory) and nn.Parameter's detach. Every other op
# (the optimizer's, state_dict's) gets and returns the plain tensor.
_KEEP = {
    aten.alias.default,
    aten.as_strided.default,
    aten.clone.default,
    aten.copy_.default,
    aten.detach.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.view.default,
    aten._pin_memory.default,
    aten._to_copy.default,
}


def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax().float() if t.numel() else torch.zeros((), device=t.device)


class Float8AllGatherWeight(torch.Tensor):
    """A Float8Linear's weight (or its FSDP2 shard) that FSDP2 all-gathers in float8. `power_of_2` floors the
    scale to a power of two, as Float8Config's.

    Args:
        tensor: the weight (out_features, in_features), or this rank's shard of it, in the parameter's dtype.
        power_of_2: whether the all-gather's scale is a power of two.

    Any op other than FSDP2's sharding ones sees `tensor` itself. Float8Linear makes it with
    `Float8Config(fsdp_float8_all_gather=True)`.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> w = kp_precision.Float8AllGatherWeight(torch.randn(32, 64))
        >>> w.shape, w.dtype, type(w * 2).__name__  # other ops get plain tensors
        (torch.Size([32, 64]), torch.float32, 'Tensor')
        >>> config = kp_precision.Float8Config(fsdp_float8_all_gather=True)
        >>> type(kp_precision.Float8Linear(64, 32, config=config).weight.data).__name__
        'Float8AllGatherWeight'
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, power_of_2: bool = False):
        kp_core.check_tensor("Float8AllGatherWeight", "tensor", tensor)
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, power_of_2: bool = False):
        self._tensor = tensor
        self._power_of_2 = power_of_2
        self._precomputed: tuple | None = None  # (amax, q, the weight's version they were computed at)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        pow2 = []
        args, kwargs = pytree.tree_map_only(
            cls, lambda t: pow2.append(t._power_of_2) or t._tensor, (args, kwargs or {})
        )
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, pow2[0]), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self._power_of_2

    @staticmethod
    def __tensor_unflatten__(inner, power_of_2, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["_tensor"], power_of_2)

    def __repr__(self):
        return f"Float8AllGatherWeight({self._tensor!r}, power_of_2={self._power_of_2})"

    def fsdp_pre_all_gather(self, mesh, outer_size=None, outer_stride=None, module=None, mp_policy=None):
        """The shard cast to float8 with the whole weight's scale, padded to FSDP2's even shard rows."""
        w = self._tensor
        pre = self._precomputed
        if pre is not None and pre[2] == w._version:
            amax, q = pre[0], pre[1]
        else:
            amax = _amax(w)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            q = multiplier(amax, E4M3, self._power_of_2)
        data = saturating_cast(w, q, E4M3)
        if outer_size is not None:  # FSDP2 pads dim 0 to a multiple of the shard group's size
            rows = kp_core.cdiv(outer_size[0], mesh.size())
            if data.shape[0] != rows:
                padded = data.new_zeros((rows, *data.shape[1:]))
                padded[: data.shape[0]] = data
                data = padded
        return (data,), (torch.ones_like(q) / q, amax)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,), (scale, amax) = all_gather_outputs, metadata
        if out is not None:  # the same storage was filled again: only the scale is new
            out._scale, out._amax = scale, amax
            return None
        return Float8GatheredWeight(data, scale, amax, param_dtype), (data,)


def high_precision(weight: torch.Tensor) -> torch.Tensor:
    """The tensor a Float8AllGatherWeight wraps (a weight FSDP2 has not sharded: kernels take it as it is), else
    weight."""
    return weight._tensor if isinstance(weight, Float8AllGatherWeight) else weight


class Float8GatheredWeight(torch.Tensor):
    """The whole weight after a float8 all-gather: `_data` (float8), `_scale` (x ~ data * scale) and `_amax`,
    with the parameter's dtype. Float8Linear uses the data as it is; other ops get data * scale.

    Args:
        data: the gathered weight, float8_e4m3fn (out_features, in_features).
        scale: a 0-d float32 tensor.
        amax: a 0-d float32 tensor (the whole weight's max |w|).
        dtype: the parameter's dtype, which the tensor reports.

    FSDP2's all-gather makes it (Float8AllGatherWeight.fsdp_post_all_gather); `float8()` gives it as a
    tensorwise Float8Tensor.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> t = kp_precision.quantize(torch.randn(32, 64))  # tensorwise
        >>> w = kp_precision.Float8GatheredWeight(t.data, t.scale, t.amax, torch.bfloat16)
        >>> w.dtype, (w + 0).dtype, w.float8().granularity  # other ops see data * scale
        (torch.bfloat16, torch.bfloat16, 'tensorwise')
    """

    @staticmethod
    def __new__(cls, data, scale, amax, dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
        )

    def __init__(self, data, scale, amax, dtype):
        self._data, self._scale, self._amax = data, scale, amax

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            t = args[0]
            return cls(t._data, t._scale, t._amax, t.dtype)
        if func in (aten.as_strided.default, aten.view.default):  # FSDP2 trims the padded rows with as_strided
            t = args[0]
            return cls(func(t._data, *args[1:], **kwargs), t._scale, t._amax, t.dtype)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale", "_amax"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Float8GatheredWeight(inner["_data"], inner["_scale"], inner["_amax"], dtype)

    def __repr__(self):
        return f"Float8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, scale={self._scale.item():g})"

    def float8(self) -> Float8Tensor:
        """The gathered weight as Float8Linear casts a weight: tensorwise data, scale and amax."""
        return Float8Tensor(self._data, self._scale, self._amax, (0, 0))

    def dequantize(self) -> torch.Tensor:
        """data * scale, in the parameter's dtype."""
        return (self._data.float() * self._scale).to(self.dtype)


@torch.no_grad()
def precompute_float8_scales(model: torch.nn.Module) -> None:
    """The float8 scale of every fsdp_float8_all_gather weight in `model`, one all-reduce per mesh, for the next
    all-gathers (call it after optimizer.step(); without it each all-gather runs its own all-reduce).

    Does nothing for a model without such weights.

    Examples:
        In a training loop (torchrun, FSDP2) whose Float8Linear layers have
        Float8Config(fsdp_float8_all_gather=True):

        >>> optimizer.step()  # doctest: +SKIP
        >>> kp_precision.precompute_float8_scales(model)  # doctest: +SKIP
    """
    kp_core.check_module("precompute_float8_scales", "model", model)
    groups: dict[tuple, list] = {}
    for module in model.modules():
        w = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        local = getattr(w, "_local_tensor", None)
        if isinstance(local, Float8AllGatherWeight):
            groups.setdefault((w.device_mesh, tuple(w.placements)), []).append(local)
    for (mesh, placements), weights in groups.items():
        amax = torch.stack([_amax(t._tensor) for t in weights])
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
        for t, a in zip(weights, amax, strict=True):
            t._precomputed = (a, multiplier(a, E4M3, t._power_of_2), t._tensor._version)


def plain_weight(module, state_dict, prefix, local_metadata) -> None:
    """A state_dict hook: the weight as the plain tensor (or DTensor of plain shards) over the same storage, so
    checkpoints hold ordinary tensors (torch.load(weights_only=True), DCP, safetensors) and loading into the
    state_dict's tensors updates the weight."""
    key = prefix + "weight"
    w = state_dict.get(key)
    local = getattr(w, "_local_tensor", w)
    if not isinstance(local, Float8AllGatherWeight):
        return
    if local is w:
        state_dict[key] = local._tensor
        return
    from torch.distributed.tensor import DTensor

    state_dict[key] = DTensor.from_local(
        local._tensor, w.device_mesh, w.placements, run_check=False, shape=w.shape, stride=w.stride()
    )
