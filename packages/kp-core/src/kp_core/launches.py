"""Kernel launches: the one place kp starts a Triton kernel, and the record that proves a kernel ran.

`launch` calls the compiled kernel directly once Triton's JIT has compiled it for a specialisation: Triton's
own dispatcher re-derives the specialisation, builds a cache key and checks globals on every call (about
15 us plus 1 us an argument on an H100 host), which is most of a small op's CPU time. The key kp keeps is at
least as fine as Triton's: per tensor its dtype and 16-byte alignment, per int its range class, whether it is
1 and whether it divides by 16 (what Triton 3.2 to 3.9 specialise on), plus the constexprs and launch options.
Under the interpreter, with a launch hook installed (profilers), or on a device that is not the current one,
the call goes through Triton's JIT as usual. While torch.compile traces a launcher (kp_core.library), the
kernel goes to inductor instead (torch.library.wrap_triton): nothing is launched or recorded then.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kp_core import jit_keys
from kp_core.backend import INTERPRET, REFERENCE, interpreter_problem


@dataclass(frozen=True)
class Launch:
    """One kernel launch (or reference path) as `record_launches` records it.

    Attributes:
        op: the declared op's name ("kp::norm").
        kernel: the kernel function's name, or "reference".
        backend: "triton", "interpret" or "reference" (kp_core.TRITON, INTERPRET, REFERENCE).

    Examples:
        >>> import kp_core
        >>> kp_core.Launch("kp::norm", "reference", kp_core.REFERENCE)
        Launch(op='kp::norm', kernel='reference', backend='reference')
    """

    op: str
    kernel: str
    backend: str


@dataclass
class LaunchRecord:
    """What `record_launches` yields: the launches made inside its block, in order, with counts and sets of them.

    Attributes:
        launches: every Launch, in the order made.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> import kp_norms
        >>> with kp_core.record_launches() as record:
        ...     y = kp_norms.rms_norm(torch.randn(4, 64), (64,))
        >>> record.count("kp::norm"), record.backends()  # CPU tensors, TRITON_INTERPRET unset
        (1, {'reference'})
    """

    launches: list[Launch] = field(default_factory=list)

    def count(self, op: str | None = None, backend: str | None = None, kernel: str | None = None) -> int:
        """How many launches match every filter given (op, backend, kernel name)."""
        return sum(
            1
            for launch in self.launches
            if (op is None or launch.op == op)
            and (backend is None or launch.backend == backend)
            and (kernel is None or launch.kernel == kernel)
        )

    def backends(self, op: str | None = None) -> set[str]:
        """The backends `op` (or any op) ran on."""
        return {launch.backend for launch in self.launches if op is None or launch.op == op}

    def kernels(self, op: str | None = None) -> set[str]:
        """The kernel names `op` (or any op) launched ("reference" for the reference path)."""
        return {launch.kernel for launch in self.launches if op is None or launch.op == op}


# Process-wide, not per thread: on CUDA, autograd runs backward on its own device thread.
_records: list[LaunchRecord] = []
_lock = threading.Lock()


# ---- logging: one logger per package ("kp.norms", ...), under "kp" ----

# KP_LOG=info: say once per op which backend it runs on (and when it takes the PyTorch reference path);
# KP_LOG=launches: also every launch, with its kernel, grid and argument shapes. Read once, at import: the launch
# path then tests a bool. Without KP_LOG, the lines go to the "kp" loggers at INFO/DEBUG for an app to show.
_KP_LOG = os.environ.get("KP_LOG", "").strip().lower()
_LOG_LAUNCHES = _KP_LOG == "launches"
_FIRST: set = set()  # (op, backend) already said
PACKAGES: dict[str, str] = {}  # op -> its package ("kp::norm" -> "kp-norms"), filled by kp_core.library


def _configure_logging() -> None:
    if _KP_LOG not in ("", "info", "launches"):
        raise ValueError(f"KP_LOG must be 'info' or 'launches', got {_KP_LOG!r}")
    if _KP_LOG:
        root = logging.getLogger("kp")
        root.setLevel(logging.DEBUG if _LOG_LAUNCHES else logging.INFO)
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            root.addHandler(handler)


def package_logger(op: str) -> logging.Logger:
    """The logger of the package that declared `op` ("kp::norm" -> kp.norms)."""
    return logging.getLogger(PACKAGES.get(op, "kp-core").replace("-", "."))


def _first(op: str, kernel: str, backend: str) -> None:
    _FIRST.add((op, backend))
    if backend == REFERENCE:
        package_logger(op).info(
            "%s: the PyTorch reference path (no kernel: CPU tensors without TRITON_INTERPRET=1, no Triton, "
            "KP_BACKEND=reference, or an empty input)",
            op,
        )
    else:
        package_logger(op).info("%s: kernels run on %s (first: %s)", op, backend, kernel)


def _log_launch(op: str, kernel, backend: str, grid, args) -> None:
    shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args if not isinstance(a, (int, float))]
    package_logger(op).debug("%s: %s on %s, grid %s, tensors %s", op, _name(kernel), backend, tuple(grid), shapes)


def _name(kernel) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))


def note_launch(op: str, kernel: str, backend: str) -> None:
    """Called for every launch (and every reference path, with backend="reference"): adds a Launch to every
    record open now. `launch` and `reference` call it; a launcher that starts a kernel another way calls it itself.

    Examples:
        >>> import kp_core
        >>> with kp_core.record_launches() as record:
        ...     kp_core.note_launch("my_op", "my_kernel", kp_core.TRITON)
        >>> record.kernels("my_op")
        {'my_kernel'}
    """
    if _records:
        launch = Launch(op, kernel, backend)
        with _lock:
            for record in _records:
                record.launches.append(launch)


def _no_autograd_cache():
    """AOTAutograd's cache keys a graph before kp's ops are traced into it (kp_core.library): while launches are
    recorded, a graph compiled earlier with its kernels inlined must not come back from it (nor one compiled now
    go into it)."""
    try:
        from torch._functorch import config

        return config.patch(enable_autograd_cache=False)
    except (ImportError, AttributeError):
        return contextlib.nullcontext()


@contextlib.contextmanager
def record_launches() -> Iterator[LaunchRecord]:
    """Record every kernel launch (op, kernel, backend; "reference" for a PyTorch reference path) made inside
    the block, from any thread: `with kp_core.record_launches() as rec: ...; rec.backends("kp::norm")`.

    While a record is open, torch.compile keeps kp's ops as calls into Python (no kernel goes to inductor), so
    every launch is seen.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> import kp_norms
        >>> with kp_core.record_launches() as record:
        ...     y = kp_norms.rms_norm(torch.randn(4, 64), (64,))
        >>> record.backends("kp::norm")  # CPU tensors without TRITON_INTERPRET=1: the reference path
        {'reference'}
    """
    record = LaunchRecord()
    with _lock:
        _records.append(record)
    try:
        with _no_autograd_cache():
            yield record
    finally:
        with _lock:
            _records.remove(record)


def reference(op: str) -> None:
    """Note that `op` ran its PyTorch reference path (no kernel): recorded as kernel "reference", and said once per
    op on the package's logger (KP_LOG=info shows it).

    Examples:
        >>> import kp_core
        >>> with kp_core.record_launches() as record:
        ...     kp_core.reference("my_op")
        >>> record.launches
        [Launch(op='my_op', kernel='reference', backend='reference')]
    """
    if (op, REFERENCE) not in _FIRST:
        _first(op, "reference", REFERENCE)
    note_launch(op, "reference", REFERENCE)


# ---- launching ----

# (kernel, device, options, constexprs, argument specialisation) -> (run, function, packed metadata)
_COMPILED: dict[tuple, tuple] = {}
_FAST = os.environ.get("KP_FAST_LAUNCH", "1") != "0"

# A checker around every launch and every op call, or None (normal use). The conformance suite installs one
# (kp_conformance.guard) to move kernel arguments into canary-guarded buffers and to catch writes to inputs.
_guard = None


# Non-zero while torch.compile traces an op's launcher into its graph (kp_core.library's inlining): launch() then
# hands each kernel to inductor through torch.library.wrap_triton, and inductor launches it from its own code.
_inlining = 0


@contextlib.contextmanager
def inlining() -> Iterator[None]:
    global _inlining
    _inlining += 1
    try:
        yield
    finally:
        _inlining -= 1


def inlining_active() -> bool:
    """Whether a launcher is being traced into a compiled graph now: its tensors are fake, so nothing about
    them can be learnt by running a kernel or a library call.

    Examples:
        >>> import kp_core
        >>> kp_core.inlining_active()  # in eager code
        False
    """
    return _inlining > 0


def inline_enabled() -> bool:
    """Whether torch.compile may trace launchers into its graph: not with KP_INLINE=0, and not while launches
    are recorded or a guard is installed (both need each launch to pass through Python)."""
    return not _records and _guard is None and os.environ.get("KP_INLINE", "1") != "0"


def set_guard(guard) -> object:
    """Install `guard` (None removes it) and return the previous one. A guard has `launch(op, kernel, args,
    consts, go)`, which must call `go(args)` once (with the same or replacement tensors), and `call(name, fn,
    args, mutated)`, which must return `fn(*args)`; `mutated` are the argument indices the op may write.

    kp_conformance.guard is one. While a guard is installed, torch.compile keeps kp's ops as calls into Python.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> import kp_norms
        >>> class CountCalls:
        ...     calls = []
        ...
        ...     def launch(self, op, kernel, args, consts, go):
        ...         go(args)
        ...
        ...     def call(self, name, fn, args, mutated):
        ...         self.calls.append(name)
        ...         return fn(*args)
        >>> previous = kp_core.set_guard(CountCalls())
        >>> y = kp_norms.rms_norm(torch.randn(2, 8), (8,))
        >>> guard = kp_core.set_guard(previous)
        >>> guard.calls
        ['kp::norm']
    """
    global _guard
    previous, _guard = _guard, guard
    return previous


def _spec(args: tuple) -> tuple:
    """What Triton specialises a compiled kernel on, per argument (see the module docstring): for an int whether
    it divides by 16, is 1 and fits in int32; for a tensor its dtype and 16-byte alignment."""
    return tuple(
        [
            (a & 15 == 0) + 2 * (a == 1) + 4 * (-2147483648 <= a <= 2147483647)
            if a.__class__ is int
            else (a.dtype, a.data_ptr() & 15 == 0)
            if isinstance(a, torch.Tensor)
            else 0.5
            if a.__class__ is float
            else a  # None, bool
            for a in args
        ]
    )


_INTERNED: dict[tuple, int] = {}


class Constexprs(dict):
    """A launch's constexprs made once and reused (a launcher's cached plan): the launch key holds one interned
    int for them instead of hashing every value per call (Triton's dtypes hash in Python).

    A dict of the keyword arguments given, in their order (the kernel's), plus `key`: the same int for equal
    values.

    Examples:
        >>> import kp_core
        >>> consts = kp_core.Constexprs(BLOCK=1024, ACT=1)
        >>> consts["BLOCK"], consts.key == kp_core.Constexprs(BLOCK=1024, ACT=1).key
        (1024, True)
    """

    __slots__ = ("key",)

    def __init__(self, **values):
        super().__init__(values)
        plain = tuple(
            (n, type(v).__name__, v if isinstance(v, (int, float, bool)) else repr(v)) for n, v in values.items()
        )
        self.key = _INTERNED.setdefault(plain, len(_INTERNED))


@dataclass(frozen=True)
class _Triton:
    """What the direct call needs to know about the installed Triton, read once."""

    passes_constexprs: bool  # 3.3+: the compiled launcher takes every argument, constexprs included
    hooks: object  # where launch hooks live (triton.knobs.runtime, or CompiledKernel before 3.4)


_TRITON: _Triton | None = None


def _triton() -> _Triton:
    global _TRITON
    if _TRITON is None:
        import triton

        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
        try:
            from triton import knobs

            hooks = knobs.runtime
        except ImportError:
            from triton.compiler import CompiledKernel as hooks
        _TRITON = _Triton((major, minor) >= (3, 3), hooks)
    return _TRITON


def launch(
    op: str,
    backend: str,
    kernel,
    grid: tuple,
    args: tuple,
    consts: dict,
    num_warps: int = 4,
    num_stages: int | None = None,
    plain: bool = False,
) -> None:
    """Run `kernel[grid](*args, **consts)` with the launch options, and note it under `op`.

    `args` are the runtime arguments in the kernel's order, `consts` its constexprs by name. The constexprs
    must follow the runtime arguments in the kernel's signature (kp's kernels are written that way). `plain`:
    always through Triton's own launcher, for arguments only it translates (TMA tensor descriptors).

    Args:
        op: the declared op's name, under which the launch is recorded and logged.
        backend: the call's backend, from `choose_backend` (TRITON or INTERPRET).
        kernel: a `@triton.jit` function.
        grid: the launch grid, 1 to 3 ints.
        args: the runtime arguments (tensors on the device, ints, floats, None), in the kernel's order.
        consts: the constexprs by name, in the kernel's order (a dict or a Constexprs).
        num_warps: warps per program.
        num_stages: software pipelining stages, or None for Triton's default.
        plain: always launch through Triton's own launcher.

    Examples:
        Under TRITON_INTERPRET=1 (set before Python starts) on CPU tensors, or on a GPU with
        `kp_core.TRITON` and CUDA tensors:

        >>> import torch
        >>> import triton
        >>> import triton.language as tl
        >>> import kp_core
        >>> @triton.jit
        ... def add_one(x_ptr, n, BLOCK: tl.constexpr):
        ...     offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ...     tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)
        >>> x = torch.zeros(100)
        >>> kp_core.launch("my_op", kp_core.INTERPRET, add_one, (kp_core.cdiv(100, 64),), (x, 100), {"BLOCK": 64})
        >>> x.sum().item()
        100.0
    """
    if _inlining:
        jit_keys.settle(kernel)
        torch.library.wrap_triton(kernel)[grid](*args, **consts, **_options(num_warps, num_stages))
        return
    if _guard is not None:
        _guard.launch(
            op,
            kernel,
            args,
            consts,
            lambda a: _launch(op, backend, kernel, grid, a, consts, num_warps, num_stages, plain),
        )
        return
    _launch(op, backend, kernel, grid, args, consts, num_warps, num_stages, plain)


# Triton's interpreter swaps triton.language's functions for its own while a kernel runs, for the whole process:
# two threads interpreting at once break each other ("Did you forget to add @triton.jit ?"). Interpreted launches
# take turns; compiled ones do not need to.
_INTERPRETER = threading.Lock()
_interpreting = {"launch": False, "patched": set()}  # the language modules patched for the current launch


def _patch_lang_once() -> None:
    """Triton's interpreter patches triton.language for a launch, then again on every call of a @triton.jit
    helper inside it (Triton 3.6-3.9: inspect.getmembers over the language each time), though the modules are
    already patched unless the helper sees one the launch did not (Triton's own helpers see triton.language.core).
    kp's kernels call helpers in their inner loops: that repeat was a third of an interpreted training step's
    time (cProfile, kp-distributed's composition test). Inside one of kp's interpreted launches a helper is
    patched for only when it sees a language module not patched yet; everything else is Triton's own code."""
    from triton import language
    from triton.runtime import interpreter

    real = interpreter._patch_lang
    if getattr(real, "_kp_once", False) or not hasattr(interpreter, "_LangPatchScope"):
        return  # done, or a Triton whose interpreter is shaped otherwise: leave it as it is
    modules = (language, language.core)

    def patch_lang(fn):
        langs = {id(m) for m in fn.__globals__.values() if any(m is lang for lang in modules)}
        if _interpreting["launch"] and langs <= _interpreting["patched"]:
            return interpreter._LangPatchScope()  # nothing patched, nothing to restore
        scope = real(fn)
        if _interpreting["launch"]:
            _interpreting["patched"] |= langs
        return scope

    patch_lang._kp_once = True
    interpreter._patch_lang = patch_lang


def _check_interpreted(op: str, kernel) -> None:
    """TRITON_INTERPRET=1 set after the kernels were defined: Triton decided at decoration (import) time and
    would fail with its own "0 active drivers" error on CPU tensors. Say what to do instead."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"{op}: TRITON_INTERPRET=1 was set after kp's kernels were defined (Triton reads it when a module "
            "imports): set it before importing any kp package, e.g. `TRITON_INTERPRET=1 python script.py`"
        )
    problem = interpreter_problem()
    if problem is not None:
        raise RuntimeError(f"{op}: {problem}")


def _launch(op, backend, kernel, grid, args, consts, num_warps, num_stages, plain=False) -> None:
    if backend == INTERPRET:
        _check_order(kernel, args, consts)  # the caller's mistake first, then the environment's
        _check_interpreted(op, kernel)
        with _INTERPRETER:
            _patch_lang_once()
            _interpreting.update(launch=True, patched=set())
            try:
                kernel[grid](*args, **consts, **_options(num_warps, num_stages))
            finally:
                _interpreting.update(launch=False, patched=set())
    elif not _FAST or plain:
        _check_order(kernel, args, consts)
        jit_keys.settle(kernel)
        kernel[grid](*args, **consts, **_options(num_warps, num_stages))
    else:
        _launch_compiled(kernel, grid, args, consts, num_warps, num_stages)
    if (op, backend) not in _FIRST:
        _first(op, kernel.fn.__name__, backend)
    if _LOG_LAUNCHES:
        _log_launch(op, kernel, backend, grid, args)
    if _records:
        note_launch(op, kernel.fn.__name__, backend)


def _options(num_warps: int, num_stages: int | None) -> dict:
    return {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}


def _active(hook) -> bool:
    """A launch hook is set: a function (Triton < 3.6), or a HookChain with calls in it (3.6+, never None)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launch_compiled(kernel, grid, args, consts, num_warps, num_stages) -> None:
    t = _TRITON or _triton()
    device = torch._C._cuda_getDevice()  # torch.cuda.current_device() without its Python wrapper
    first = args[0] if isinstance(args[0], torch.Tensor) else next(a for a in args if isinstance(a, torch.Tensor))
    if _active(t.hooks.launch_enter_hook) or _active(t.hooks.launch_exit_hook) or first.get_device() != device:
        jit_keys.settle(kernel)
        with torch.cuda.device(first.device):
            kernel[grid](*args, **consts, **_options(num_warps, num_stages))
        return
    # id(kernel): a JITFunction hashes its source key in Python; kp's kernels live as long as their modules.
    consts_key = consts.key if consts.__class__ is Constexprs else tuple(consts.values())
    key = (id(kernel), device, num_warps, num_stages, consts_key, *_spec(args))
    hit = _COMPILED.get(key)
    if hit is None:  # Triton's JIT compiles (or finds) the kernel and launches it this once
        _check_order(kernel, args, consts)
        jit_keys.settle(kernel)  # its key the same in every process, so the on-disk cache finds it
        compiled = kernel[grid](*args, **consts, **_options(num_warps, num_stages))
        compiled._init_handles()
        _COMPILED[key] = (compiled.run, compiled.function, compiled.packed_metadata)
        return
    run, function, metadata = hit
    stream = torch._C._cuda_getCurrentRawStream(device)
    g = (*grid, 1, 1)
    if t.passes_constexprs:
        run(g[0], g[1], g[2], stream, function, metadata, None, None, None, *args, *consts.values())
    else:
        run(g[0], g[1], g[2], stream, function, metadata, None, None, None, *args)


_ORDER_OK: set = set()


def _check_order(kernel, args: tuple, consts: dict) -> None:
    """The direct call passes args then constexprs positionally: they must be the kernel's order. Checked once
    per kernel and call shape, under the interpreter too, so CPU runs hold launchers to it."""
    key = (kernel, len(args), tuple(consts))
    if key in _ORDER_OK:
        return
    params = list(inspect.signature(kernel.fn).parameters.values())
    is_const = ["constexpr" in str(p.annotation) for p in params]
    names = [p.name for p in params]
    if names[len(args) :] != list(consts) or any(is_const[: len(args)]) or not all(is_const[len(args) :]):
        raise TypeError(
            f"kp_core.launch: {kernel.fn.__name__} takes {names}; got {len(args)} runtime arguments and "
            f"constexprs {list(consts)} (runtime arguments first, then every constexpr in order)"
        )
    _ORDER_OK.add(key)


_configure_logging()
