"""Scratch buffers that launchers reuse from call to call instead of allocating (several microseconds each).

A workspace holds what one call's kernels pass between them and nobody reads afterwards (a norm backward's
per-program partial sums, a split decode's partial outputs). It is keyed by device, stream, thread, dtype and
shape: kernels on one stream run in launch order, and one thread launches a call's kernels back to back, so the
next call's first write to a buffer comes after this call's last read of it (two threads sharing a stream could
interleave their launches: each gets its own buffers).

Not cached, so allocated as usual: buffers over MAX_BYTES, any once MAX_ENTRIES are held, all during CUDA
graph capture (a graph must own its memory; a cached buffer replayed on another stream would race with eager
calls), and all on a stream other than the device's default one: torch.compile's cudagraph trees run their
warmup on a stream of their own with every allocation routed to their graph pool, and a buffer kept from there
is a live tensor in that pool that no output accounts for (reduce-overhead then refuses to run). Cached buffers
are never freed or replaced, so none is released under a graph that uses it. While torch.compile traces a
launcher (kp_core.library), each buffer is the graph's own.
"""

from __future__ import annotations

import threading

import torch

from kp_core import launches

MAX_BYTES = 16 << 20
MAX_ENTRIES = 256

_BUFFERS: dict[tuple, object] = {}


def workspace(like: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, count: int = 1):
    """An uninitialised tensor of `shape` and `dtype` on like's device (a tuple of `count` distinct ones when
    count > 1), reused by later calls with the same key (see the module docstring for when it is not kept).

    Args:
        like: any tensor on the device wanted.
        shape: the buffer's shape.
        dtype: the buffer's dtype.
        count: how many distinct buffers.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> x = torch.ones(4)
        >>> partial = kp_core.workspace(x, (4, 8), torch.float32)
        >>> partial.shape, kp_core.workspace(x, (4, 8), torch.float32) is partial
        (torch.Size([4, 8]), True)
    """
    cuda = like.is_cuda
    stream = torch._C._cuda_getCurrentRawStream(like.get_device()) if cuda else 0
    key = (like.get_device(), stream, threading.get_ident(), dtype, shape, count)
    bufs = _BUFFERS.get(key)
    # traced into a compiled graph (kp_core.library): a buffer of that graph, never one kept across graphs
    cacheable = not launches.inlining_active() and (
        not cuda or (stream == _default_stream(like.get_device()) and not torch.cuda.is_current_stream_capturing())
    )
    if bufs is not None and cacheable:
        return bufs
    made = tuple(like.new_empty(shape, dtype=dtype) for _ in range(count))
    bufs = made[0] if count == 1 else made
    if cacheable and len(_BUFFERS) < MAX_ENTRIES and count * made[0].numel() * made[0].element_size() <= MAX_BYTES:
        _BUFFERS[key] = bufs
    return bufs


_DEFAULT_STREAMS: dict[int, int] = {}


def _default_stream(device: int) -> int:
    if device not in _DEFAULT_STREAMS:
        _DEFAULT_STREAMS[device] = torch.cuda.default_stream(device).cuda_stream
    return _DEFAULT_STREAMS[device]


def clear() -> None:
    """Drop every cached buffer (tests; or to give the memory back when no CUDA graph still uses one)."""
    _BUFFERS.clear()
