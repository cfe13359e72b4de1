"""Shape buckets: which captured graph a call falls into, and the padding up to it.

A bucket spec names the dimensions that vary between calls and the sizes a graph is captured at: a sequence of
sizes means dimension 0 of every tensor input (the batch), a dict {dim: sizes} several dimensions (batch and
sequence length, say). A call's size along each such dimension is taken from its tensor inputs, which must agree;
the call runs in the smallest bucket at least that large, its inputs padded up to it, or eagerly when a size is
beyond every bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.utils._pytree import tree_unflatten


class Buckets:
    def __init__(self, spec: Sequence[int] | Mapping[int, Sequence[int]]):
        if isinstance(spec, Mapping):
            items = dict(spec)
        elif isinstance(spec, Sequence) and not isinstance(spec, str):
            items = {0: spec}
        else:
            raise TypeError(f"graphed: buckets must be a sequence of sizes or a dict {{dim: sizes}}, got {spec!r}")
        if not items:
            raise ValueError("graphed: buckets names no dimension")
        self.sizes: dict[int, tuple[int, ...]] = {}
        for dim, sizes in items.items():
            if not isinstance(dim, int) or isinstance(dim, bool) or dim < 0:
                raise ValueError(f"graphed: buckets: dimensions must be non-negative ints, got {dim!r}")
            sizes = list(sizes) if isinstance(sizes, Sequence) and not isinstance(sizes, str) else None
            if not sizes or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sizes):
                raise ValueError(
                    f"graphed: buckets: the sizes of dimension {dim} must be positive ints, got {items[dim]!r}"
                )
            self.sizes[dim] = tuple(sorted(set(sizes)))
        self.dims = tuple(sorted(self.sizes))
        self._chosen: dict = {}

    def actual(self, leaves: Sequence) -> tuple[int, ...]:
        """The call's size along each bucketed dimension, read from the tensors among `leaves` (the flattened
        inputs); ValueError naming the inputs that disagree or lack a dimension."""
        tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        out = []
        for dim in self.dims:
            seen = {}
            for i, t in tensors:
                if t.dim() <= dim:
                    raise ValueError(
                        f"graphed: input #{i} has {t.dim()} dimension(s), but the buckets vary dimension {dim}"
                    )
                seen.setdefault(t.shape[dim], i)
            if len(seen) > 1:
                pairs = ", ".join(f"#{i} has {s}" for s, i in seen.items())
                raise ValueError(f"graphed: the inputs disagree on the size of bucketed dimension {dim}: {pairs}")
            out.append(next(iter(seen)) if seen else 0)
        return tuple(out)

    def choose(self, actual: tuple[int, ...]) -> tuple[int, ...] | None:
        """The smallest bucket holding `actual` along every dimension, or None when none does (memoised: it is
        on every call's path)."""
        try:
            return self._chosen[actual]
        except KeyError:
            pass
        out = []
        for dim, n in zip(self.dims, actual):
            fits = [s for s in self.sizes[dim] if s >= n]
            if not fits:
                out = None
                break
            out.append(fits[0])
        chosen = self._chosen[actual] = None if out is None else tuple(out)
        return chosen

    def largest(self) -> tuple[int, ...]:
        return tuple(self.sizes[d][-1] for d in self.dims)

    def __repr__(self) -> str:
        return f"Buckets({self.sizes})"


def pad_to(t: torch.Tensor, dims: tuple[int, ...], bucket: tuple[int, ...], value) -> torch.Tensor:
    """t grown along `dims` to the bucket's sizes, the new entries `value` (t itself when it already fits)."""
    if all(t.shape[d] == b for d, b in zip(dims, bucket)):
        return t
    shape = list(t.shape)
    for d, b in zip(dims, bucket):
        shape[d] = b
    out = t.new_full(shape, value)
    out[tuple(slice(0, n) for n in t.shape)].copy_(t)
    return out


def fill_into(dst: torch.Tensor, src: torch.Tensor, value) -> None:
    """dst (a bucket-sized static buffer) = src padded with `value`, in place, without allocating."""
    region = tuple(slice(0, n) for n in src.shape)
    dst[region].copy_(src)
    if tuple(src.shape) != tuple(dst.shape):
        # the padding: every slab past src's extent along each dimension
        for d in range(dst.dim()):
            if src.shape[d] < dst.shape[d]:
                index = tuple(slice(0, src.shape[i]) if i < d else slice(None) for i in range(d))
                dst[(*index, slice(src.shape[d], None))].fill_(value)


def trim(t: torch.Tensor, dims: tuple[int, ...], bucket: tuple[int, ...], actual: tuple[int, ...]):
    """An output cut back from the bucket to the call's sizes along each bucketed dimension it has at the
    bucket's size (an output without that dimension, or of another size there, is returned whole)."""
    index = []
    for d in range(t.dim()):
        if d in dims and t.shape[d] == bucket[dims.index(d)]:
            index.append(slice(0, actual[dims.index(d)]))
        else:
            index.append(slice(None))
    return t[tuple(index)]


def unflatten(leaves, spec):
    """(args, kwargs) of a call from its flattened inputs: spec is a pytree spec, or the count of a call made of
    tensors only (graphed's fast path, which skips pytree)."""
    if isinstance(spec, int):
        return tuple(leaves), {}
    return tree_unflatten(list(leaves), spec)
