"""Guarded buffers: what a value comparison cannot see.

Installed for every spec (kp_core.set_guard), the guard
- moves every tensor a kernel launch receives into a larger buffer filled with a canary byte: PAD bytes before,
  after, and in the gaps of strided views (views of one storage share one buffer, so aliasing is kept). After
  the launch, a changed canary byte fails the test naming the op, kernel, argument and offset; what the kernel
  wrote inside its tensors is copied back. The canary is all-ones bytes, a NaN in every float dtype, so a load
  that strays outside a tensor poisons the values the spec then compares.
- checksums (bitwise) every tensor argument of every op call, forward and backward, that the op does not declare
  as mutated, and fails the test naming the op, argument and first changed element if the call wrote to it.

It also takes the branch census (kp_conformance.census). KP_GUARD=0 turns both off (e.g. to time a spec without
the copies).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import threading

import torch

from kp_conformance import census
from kp_conformance.env import interpreting
from kp_core import cdiv

CANARY = 0xFF
PAD = 4096  # bytes on each side: past a row of any tier, so a stray store lands in the canary, not elsewhere


class GuardError(AssertionError):
    pass


def _byte_offsets(t: torch.Tensor) -> torch.Tensor:
    """Byte offsets (from the storage's start) of every byte of every element of `t`, flattened."""
    es = t.element_size()
    off = torch.full((), t.storage_offset() * es, dtype=torch.int64, device=t.device)
    for size, stride in zip(t.shape, t.stride()):
        off = off.unsqueeze(-1) + torch.arange(size, device=t.device) * (stride * es)
    return (off.reshape(-1, 1) + torch.arange(es, device=t.device)).reshape(-1)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of `t` in its storage."""
    es = t.element_size()
    lo = t.storage_offset() * es
    hi = lo + (sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) + 1) * es
    return lo, hi


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of `t` as a flat uint8 tensor (a view: writes reach `t`)."""
    storage = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, 0, (storage.nbytes(),), (1,))


class _Group:
    """The views of one storage among a launch's arguments, re-homed into one guarded buffer."""

    def __init__(self, views: list[tuple[int, torch.Tensor]]):
        first = views[0][1]
        spans = [_span(t) for _, t in views]
        self.lo, self.hi = min(s[0] for s in spans), max(s[1] for s in spans)
        self.views = views
        self.original = _storage_bytes(first)[self.lo : self.hi]
        # Keep each pointer's 16-byte alignment (Triton specialises on it).
        self.pad = PAD + (first.untyped_storage().data_ptr() + self.lo) % 16
        n = self.hi - self.lo
        total = cdiv(self.pad + n + PAD, 16) * 16
        self.buffer = torch.full((total,), CANARY, dtype=torch.uint8, device=first.device)
        self.inner = self.buffer[self.pad : self.pad + n]
        # Which bytes of [lo, hi) the views cover: None when one contiguous view covers them all (the common case,
        # which then needs no mask).
        self.allowed = None
        if not any(t.is_contiguous() and _span(t) == (self.lo, self.hi) for _, t in views):
            self.allowed = torch.zeros(n, dtype=torch.bool, device=first.device)
            for _, t in views:
                if t.is_contiguous():
                    lo, hi = _span(t)
                    self.allowed[lo - self.lo : hi - self.lo] = True
                else:
                    self.allowed[_byte_offsets(t) - self.lo] = True
        if self.allowed is None:
            self.inner.copy_(self.original)
        else:
            self.inner[self.allowed] = self.original[self.allowed]

    def rehomed(self, t: torch.Tensor) -> torch.Tensor:
        es = t.element_size()
        offset = self.pad + t.storage_offset() * es - self.lo
        return self.buffer.view(t.dtype).as_strided(t.shape, t.stride(), offset // es)

    def describe(self, at: int, names: list[str]) -> str:
        """The argument nearest to byte `at` of the buffer, and where `at` lies relative to its elements."""
        byte = at - self.pad + self.lo  # in the original storage
        i, t = min(self.views, key=lambda v: _distance(byte, _span(v[1])))
        es = t.element_size()
        lo, hi = _span(t)
        side = "before" if byte < lo else "after" if byte >= hi else "in a gap of"
        return (
            f"{names[i]!r} (shape {tuple(t.shape)}, stride {t.stride()}, {t.dtype}); first at element offset "
            f"{(byte - t.storage_offset() * es) / es:+g} from its start, {side} its elements"
        )

    def readable(self, offsets):
        """Which byte offsets into the buffer (numpy int64) are bytes of the views."""
        inside = (offsets >= self.pad) & (offsets < self.pad + len(self.inner))
        if self.allowed is not None:
            allowed = self.allowed.cpu().numpy()
            inside[inside] = allowed[offsets[inside] - self.pad]
        return inside

    def check_and_copy_back(self, where: str, names: list[str]) -> None:
        stray = self.buffer != CANARY
        if self.allowed is None:
            stray[self.pad : self.pad + len(self.inner)] = False
        else:
            stray[self.pad : self.pad + len(self.inner)] &= ~self.allowed
        if bool(stray.any()):
            where_ = self.describe(int(stray.nonzero()[0, 0]), names)
            raise GuardError(f"{where}: wrote {int(stray.sum())} byte(s) outside argument {where_}")
        if self.allowed is None:
            self.original.copy_(self.inner)
        else:
            self.original[self.allowed] = self.inner[self.allowed]


def _distance(byte: int, span: tuple[int, int]) -> int:
    return max(span[0] - byte, byte - span[1] + 1, 0)


def _addressed(arg) -> torch.Tensor | None:
    """The tensor a kernel argument addresses: the argument itself, or a TMA tensor descriptor's base (the
    descriptor is rebuilt on the guarded copy, so its loads and stores are checked like a pointer's)."""
    if isinstance(arg, torch.Tensor):
        return arg
    base = getattr(arg, "base", None) if dataclasses.is_dataclass(arg) else None
    return base if isinstance(base, torch.Tensor) else None


class Guard:
    """The object kp_core.set_guard installs (see the module docstring)."""

    def launch(self, op, kernel, args, consts, go) -> None:
        census.note(kernel, consts)
        if _capturing():  # a capture cannot read the canaries back; the eager warmup runs were guarded
            go(args)
            return
        groups: dict[tuple, list] = {}
        for i, a in enumerate(args):
            a = _addressed(a)
            if a is not None and a.numel() > 0:
                key = (a.device, a.untyped_storage().data_ptr())
                groups.setdefault(key, []).append((i, a))
        if not groups:
            go(args)
            return
        with torch.no_grad():
            guarded = [_Group([(i, a.detach()) for i, a in views]) for views in groups.values()]
            new = list(args)
            for g in guarded:
                for i, t in g.views:
                    home = g.rehomed(t)
                    new[i] = home if isinstance(args[i], torch.Tensor) else dataclasses.replace(args[i], base=home)
            names = _arg_names(kernel, len(args))
            what = f"{op}: kernel {_kernel_name(kernel)}"
            global _READS
            # _READS is the one launch in flight: interpreted launches from several threads take turns here
            # (compiled ones keep running concurrently; they do not read it).
            with _INTERPRETED if interpreting() else contextlib.nullcontext():
                _READS = (what, guarded, names)
                try:
                    _run(go, tuple(new))
                except Exception as e:  # the interpreter wraps what a load check raised
                    if isinstance(e.__cause__, GuardError):
                        raise e.__cause__ from None
                    raise
                finally:
                    _READS = None
            for g in guarded:
                g.check_and_copy_back(what, names)

    def call(self, name, fn, args, mutated):
        if _capturing():
            return fn(*args)
        with torch.no_grad():
            saved = [
                (i, a, a.detach().clone())
                for i, a in enumerate(args)
                if isinstance(a, torch.Tensor) and i not in mutated and a.numel() > 0
            ]
        out = fn(*args)
        with torch.no_grad():
            for i, a, before in saved:
                if not _same_bits(a, before):
                    names = _arg_names(fn, len(args))
                    where = (_bits(a) != _bits(before)).reshape(-1).nonzero()
                    raise GuardError(
                        f"{name}: the call wrote to its input {names[i]!r} (shape {tuple(a.shape)}, {a.dtype}); "
                        f"first changed element at flat index {int(where[0, 0])}"
                    )
        return out


def _run(go, args) -> None:
    """The launch; under Triton's interpreter, on a thread of its own (joined at once). CPython 3.11 keeps frames in
    16 KiB chunks that it maps and unmaps as the call stack crosses a chunk's end; the interpreter makes millions of
    small calls per launch, and at the depth of a spec (pytest, Hypothesis, autograd, this guard) they crossed one:
    half of a run's CPU time went to the kernel mapping pages. A new thread starts with an empty stack."""
    if not interpreting():
        go(args)
        return
    failure = []

    def body():
        try:
            go(args)
        except BaseException as e:  # re-raised on the caller's thread
            failure.append(e)

    thread = threading.Thread(target=body, name="kp-interpreted-launch")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on this stream (checks that read back to the host cannot run)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width, so NaNs compare by their bits."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    if t.dtype == torch.bool or t.is_complex():
        return t.contiguous().view(torch.uint8)
    return t.contiguous().view(ints[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _kernel_name(kernel) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))


def _arg_names(fn, n: int) -> list[str]:
    """Parameter names of a kernel or launcher (positional ones first), padded with indices."""
    try:
        names = list(getattr(fn, "arg_names", None) or inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    return (names + [f"#{i}" for i in range(len(names), n)])[:n] if n else names


# Under Triton's interpreter, loads are checked as they happen: the launch in flight (what, groups, names).
_READS = None
_INTERPRETED = threading.Lock()


def _check_reads(ptrs, mask) -> None:
    """Every active lane of an interpreted load must read bytes of the launch's tensor arguments: a stray read
    that never reaches an output (a dropped load mask whose lanes the store masks off) changes no value, so only
    this sees it. On a GPU, compute-sanitizer's memcheck is the counterpart (kp_conformance.memcheck)."""
    import numpy as np

    what, groups, names = _READS
    addr = np.broadcast_to(ptrs, mask.shape)[mask].astype(np.int64)
    if addr.size == 0:
        return
    ok = np.zeros(addr.shape, dtype=bool)
    for g in groups:
        off = addr - g.buffer.data_ptr()
        near = (off >= 0) & (off < g.buffer.numel())
        ok[near] = g.readable(off[near])
        bad = near & ~ok
        if bad.any():
            raise GuardError(
                f"{what}: read {int(bad.sum())} element(s) outside argument {g.describe(int(off[bad][0]), names)}"
            )
    if not ok.all():
        raise GuardError(f"{what}: read {int((~ok).sum())} element(s) outside every tensor argument")


def _patch_interpreter() -> None:
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load = builder.create_masked_load

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        if _READS is not None:
            _check_reads(ptrs.data, mask.data)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    builder.create_masked_load = create_masked_load


def install() -> None:
    """Install the guard unless KP_GUARD=0 (and, under Triton's interpreter, the read check)."""
    if os.environ.get("KP_GUARD", "1") != "0":
        import kp_core

        kp_core.set_guard(Guard())
        if interpreting():
            _patch_interpreter()
