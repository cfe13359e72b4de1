"""Input checks that fail with a message naming the op, the argument, what was expected and what came."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The floating-point dtypes most kp kernels take: float16, bfloat16, float32, float64."""
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
    TypeError/ValueError naming `op` and `name` otherwise. Returns it.

    TypeError for something that is not a tensor or has another dtype; ValueError for the device or the number of
    dimensions. Each check is skipped when its argument is None.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> x = kp_core.check_tensor("my_op", "x", torch.ones(2, 3), dtypes=kp_core.FLOAT_DTYPES, ndim=2)
        >>> kp_core.check_tensor("my_op", "x", torch.ones(2, dtype=torch.int64), dtypes=kp_core.FLOAT_DTYPES)
        Traceback (most recent call last):
            ...
        TypeError: my_op: x must have dtype in (float16, bfloat16, float32, float64), got int64
    """
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
    """ValueError naming `op` and `name` unless `tensor` has shape `expected`.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> kp_core.check_shape("my_op", "weight", torch.ones(3), (4,))
        Traceback (most recent call last):
            ...
        ValueError: my_op: weight must have shape (4,), got (3,)
    """
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{op}: {name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_same_dtype(op: str, name: str, tensor: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    """TypeError unless `tensor` has `like`'s dtype.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> x, r = torch.ones(2), torch.ones(2, dtype=torch.float16)
        >>> kp_core.check_same_dtype("my_op", "residual", r, x, "input")
        Traceback (most recent call last):
            ...
        TypeError: my_op: residual must have the dtype of input (float32), got float16
    """
    if tensor.dtype != like.dtype:
        raise TypeError(
            f"{op}: {name} must have the dtype of {like_name} ({_names([like.dtype])}), got {_names([tensor.dtype])}"
        )


def check_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    """ValueError unless every given tensor (None skipped) is on the first one's device.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> kp_core.check_same_device("my_op", input=torch.ones(2), weight=None, bias=torch.zeros(2))
    """
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
    """ValueError when `count` elements pass the kernel's index limit (int32 offsets by default).

    Examples:
        >>> import kp_core
        >>> kp_core.check_index_fits("my_op", "input", 2**31)
        Traceback (most recent call last):
            ...
        ValueError: my_op: input has 2147483648 elements, more than the kernel's limit of 2147483647
    """
    if count > limit:
        raise ValueError(f"{op}: {name} has {count} elements, more than the kernel's limit of {limit}")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def check_no_overlap(op: str, name: str, tensor: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    """Refuse two tensors a call writes (or writes one, reads the other) that share memory: the same start, or
    intersecting spans where one is contiguous (it then covers its span). Interleaved views of one buffer (k and
    v halves of a packed cache) pass. Tensors of any shape and dtype; empty ones, tensors on different devices
    and calls under torch.compile tracing are not checked.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> buf = torch.zeros(8)
        >>> kp_core.check_no_overlap("my_op", "out", buf[:4], "cache", buf[2:])
        Traceback (most recent call last):
            ...
        ValueError: my_op: out and cache must not share memory (both are written or read back)
        >>> kv = torch.zeros(4, 2)
        >>> kp_core.check_no_overlap("my_op", "k", kv[:, 0], "v", kv[:, 1])  # interleaved halves pass
    """
    if tensor.numel() == 0 or other.numel() == 0 or tensor.device != other.device or torch.compiler.is_compiling():
        return  # (traced tensors have no addresses: eager calls are checked)
    (a0, a1), (b0, b1) = _byte_span(tensor), _byte_span(other)
    if a0 == b0 or (a0 < b1 and b0 < a1 and (tensor.is_contiguous() or other.is_contiguous())):
        raise ValueError(f"{op}: {name} and {other_name} must not share memory (both are written or read back)")


def check_bool(op: str, name: str, value: object) -> bool:
    """A flag must be a bool: 1 or "yes" would be taken as True silently (an in-place write, a mode switch).

    Returns `value`; TypeError naming `op` and `name` otherwise.

    Examples:
        >>> import kp_core
        >>> kp_core.check_bool("my_op", "in_place", True)
        True
        >>> kp_core.check_bool("my_op", "in_place", 1)
        Traceback (most recent call last):
            ...
        TypeError: my_op: in_place must be a bool, got 1
    """
    if not isinstance(value, bool):  # (bool has no subclasses; isinstance is what torch.compile can trace)
        raise TypeError(f"{op}: {name} must be a bool, got {value!r}")
    return value


def check_module(op: str, name: str, module: object) -> torch.nn.Module:
    """TypeError unless `module` is a torch.nn.Module. Returns it.

    Examples:
        >>> import kp_core
        >>> kp_core.check_module("my_op", "model", "not a module")
        Traceback (most recent call last):
            ...
        TypeError: my_op: model must be a torch.nn.Module, got str
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"{op}: {name} must be a torch.nn.Module, got {type(module).__name__}")
    return module


def check_callable(op: str, name: str, fn: object, optional: bool = True) -> None:
    """TypeError unless `fn` is callable (or None where `optional`).

    Examples:
        >>> import kp_core
        >>> kp_core.check_callable("my_op", "score_mod", None)
        >>> kp_core.check_callable("my_op", "score_mod", 3, optional=False)
        Traceback (most recent call last):
            ...
        TypeError: my_op: score_mod must be a function, got 3
    """
    if not (callable(fn) or (optional and fn is None)):
        raise TypeError(f"{op}: {name} must be a function{' or None' if optional else ''}, got {fn!r}")
