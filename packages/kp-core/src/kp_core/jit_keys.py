"""Stable Triton cache keys for kernels that share helpers.

Triton 3.5 to 3.7 build a kernel's cache key by walking the `@triton.jit` functions it calls, and merge each
callee's global constexprs into the caller's key before the callee's own key (which collects them) is computed.
A helper's constexprs therefore reach the key of every kernel keyed after the helper's first use, and miss the
key of the first: `_norm_fwd` got one of two keys depending on whether another kernel that calls `act` had
launched first in the process. The on-disk cache then held the kernel under one key while the next process
asked for the other, and compiled it again (on an H200 with Triton 3.6: 229 of a warm conformance run's 249
compiles, and 97 kernel variants compiled twice in a cold run). Computing the callees' keys first, leaves first,
gives a kernel the same key in every process, on every Triton (from 3.8 Triton computes the callee's key first
itself).

Each kernel module calls `settle_module(globals())` as its last line, so its functions' keys are fixed at import,
before anything can ask for one out of order (torch.compile's kernel copies, Triton's own launcher); flex
attention's generated modules settle as they are loaded, and `launch` settles a kernel before its first launch,
for kernels of any other module it is given.
"""

from __future__ import annotations

import ast
import inspect
import threading

_LOCK = threading.Lock()
_MARK = "_kp_key_settled"  # set on a JIT function once its key is computed (an id() could be reused)


def settle(kernel) -> None:
    """Compute the cache key of every `@triton.jit` function `kernel` calls, callees before callers, then the
    kernel's own, once per function and process. Anything that is not a Triton JIT function is left alone (the
    interpreter's functions have no cache key).

    Args:
        kernel: a `@triton.jit` function (a kernel or a helper).

    Examples:
        >>> from kp_core import activation_kernels, jit_keys
        >>> jit_keys.settle(activation_kernels.act)  # settled when its module was imported: nothing more to do
    """
    if _settled(kernel):
        return
    with _LOCK:
        _settle(kernel, set())


def settle_module(namespace: dict) -> None:
    """Settle every `@triton.jit` function defined in the module whose `globals()` is `namespace` (helpers from
    other modules were settled when those were imported). Nothing happens under Triton's interpreter.

    Args:
        namespace: the kernel module's `globals()`.

    Examples:
        A kernel module's last line:

        >>> from kp_core import jit_keys
        >>> jit_keys.settle_module(globals())
    """
    for value in list(namespace.values()):
        if _is_jit(value) and value.fn.__module__ == namespace["__name__"]:
            settle(value)


def _settle(fn, visiting: set[int]) -> None:
    if _settled(fn) or id(fn) in visiting or not _is_jit(fn):
        return
    visiting.add(id(fn))  # a function that calls itself, directly or not, is keyed by Triton's own guard
    for callee in _callees(fn):
        _settle(callee, visiting)
    try:
        fn.cache_key  # noqa: B018  (computed and kept by Triton)
    except Exception:
        # A kernel this Triton cannot key (a branch using a newer triton.language, such as the TMA path's
        # tl.make_tensor_descriptor, which Triton 3.2 looks up while keying): left as Triton finds it, to fail at
        # its launch if it is ever launched, never at import. Triton 3.6 leaves a placeholder key when keying fails.
        fn.hash = None
        return
    setattr(fn, _MARK, True)


def _settled(fn) -> bool:
    return getattr(fn, _MARK, False) is True


def _is_jit(fn) -> bool:
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # no Triton: nothing is a JIT function
        return False
    return isinstance(fn, JITFunction)


def _callees(fn) -> list:
    """The JIT functions `fn`'s source names, resolved as Triton resolves them: a global or closure variable,
    or an attribute of one (`module.helper`)."""
    scope = {**fn.fn.__globals__, **inspect.getclosurevars(fn.fn).nonlocals}
    found = []
    for node in ast.walk(fn.parse()):
        value = _resolve(node, scope)
        if value is not None and _is_jit(value):
            found.append(value)
    return found


def _resolve(node, scope: dict):
    if isinstance(node, ast.Name):
        return scope.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        return None if base is None else getattr(base, node.attr, None)
    return None
