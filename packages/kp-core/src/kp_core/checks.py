"""Input checks that fail with a message naming the op, the argument, what was expected and what came."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT32_MAX = 2**31 - 1


def _names(dtypes: Iterable[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    tensor: object,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    ndim: int | None = None,
    min_ndim: int | None = None,
) -> torch.Tensor:
    """`tensor` is a torch.Tensor with one of `dtypes`, on `device`, with `ndim` (or at least `min_ndim`) dims;
    TypeError/ValueError naming `op` and `name` otherwise. Returns it."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise TypeError(f"{op}: {name} must have dtype in ({_names(dtypes)}), got {_names([tensor.dtype])}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{op}: {name} must be on {device} (like the input), got {tensor.device}")
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if min_ndim is not None and tensor.dim() < min_ndim:
        raise ValueError(f"{op}: {name} must have at least {min_ndim} dimensions, got shape {tuple(tensor.shape)}")
    return tensor


def check_shape(op: str, name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    """ValueError naming `op` and `name` unless `tensor` has shape `expected`."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{op}: {name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_same_dtype(op: str, name: str, tensor: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    """TypeError unless `tensor` has `like`'s dtype."""
    if tensor.dtype != like.dtype:
        raise TypeError(
            f"{op}: {name} must have the dtype of {like_name} ({_names([like.dtype])}), got {_names([tensor.dtype])}"
        )


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """ValueError unless every given tensor (None skipped) is on the first one's device."""
    present = {k: t for k, t in tensors.items() if t is not None}
    if not present:
        return
    first_name, first = next(iter(present.items()))
    for name, tensor in present.items():
        if tensor.device != first.device:
            raise ValueError(
                f"{op}: {name} must be on the same device as {first_name} ({first.device}), got {tensor.device}"
            )


def check_index_fits(op: str, name: str, count: int, limit: int = INT32_MAX) -> None:
    """ValueError when `count` elements pass the kernel's index limit (int32 offsets by default)."""
    if count > limit:
        raise ValueError(f"{op}: {name} has {count} elements, more than the kernel's limit of {limit}")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def check_no_overlap(op: str, name: str, tensor: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """Refuse two tensors a call writes (or writes one, reads the other) that share memory: the same start, or
    intersecting spans where one is contiguous (it then covers its span). Interleaved views of one buffer (k and
    v halves of a packed cache) pass."""
    if tensor.numel() == 0 or other.numel() == 0 or tensor.device != other.device or torch.compiler.is_compiling():
        return  # (traced tensors have no addresses: eager calls are checked)
    (a0, a1), (b0, b1) = _byte_span(tensor), _byte_span(other)
    if a0 == b0 or (a0 < b1 and b0 < a1 and (tensor.is_contiguous() or other.is_contiguous())):
        raise ValueError(f"{op}: {name} and {other_name} must not share memory (both are written or read back)")


def check_bool(op: str, name: str, value: object) -> bool:
    """A flag must be a bool: 1 or "yes" would be taken as True silently (an in-place write, a mode switch)."""
    if not isinstance(value, bool):  # (bool has no subclasses; isinstance is what torch.compile can trace)
        raise TypeError(f"{op}: {name} must be a bool, got {value!r}")
    return value


def check_module(op: str, name: str, module: object) -> torch.nn.Module:
    """TypeError unless `module` is a torch.nn.Module. Returns it."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{op}: {name} must be a torch.nn.Module, got {type(module).__name__}")
    return module


def check_callable(op: str, name: str, fn: object, optional: bool = True) -> None:
    """TypeError unless `fn` is callable (or None where `optional`)."""
    if not (callable(fn) or (optional and fn is None)):
        raise TypeError(f"{op}: {name} must be a function{' or None' if optional else ''}, got {fn!r}")
