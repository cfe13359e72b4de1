"""Branch census: which kernels a run launched, and with which compile-time switches.

A tier must reach every branch of every kernel it touches: for each kernels module (`kp_*.ops.*_kernels`) a run
launched anything from, every launchable kernel of that module (a `@triton.jit` function no other kernel of the
module calls) must have launched, and every bool constexpr of each must have been seen both True and False.
Other constexprs (tile sizes, activation ids) are listed in the report, not enforced.
"""

from __future__ import annotations

import inspect
import re
import sys

_SEEN: dict[str, dict[str, list]] = {}  # "module:kernel" -> {constexpr: distinct values}
_LAUNCHABLE: dict[str, list[str]] = {}  # module -> its launchable kernels (filled where the modules are imported)


def note(kernel, consts: dict) -> None:
    fn = getattr(kernel, "fn", kernel)
    if not fn.__module__.startswith("kp_"):  # the suite's own test kernels
        return
    entry = _SEEN.setdefault(f"{fn.__module__}:{fn.__name__}", {})
    for name, value in consts.items():
        if isinstance(value, (bool, int)):
            values = entry.setdefault(name, [])
            if value not in values:
                values.append(value)


def data() -> dict:
    """This process's census (for an xdist worker to send to the controller)."""
    for name in {k.split(":")[0] for k in _SEEN}:
        if name not in _LAUNCHABLE and name in sys.modules:
            _LAUNCHABLE[name] = _launchable(sys.modules[name])
    return {"seen": _SEEN, "launchable": _LAUNCHABLE}


def merge(other: dict) -> None:
    _LAUNCHABLE.update(other["launchable"])
    for kernel, switches in other["seen"].items():
        entry = _SEEN.setdefault(kernel, {})
        for name, values in switches.items():
            entry.setdefault(name, [])
            entry[name] += [v for v in values if v not in entry[name]]


def _launchable(module) -> list[str]:
    """The module's @triton.jit functions that no other jit function of the module calls."""
    jit = {n: f for n, f in vars(module).items() if hasattr(f, "fn") and hasattr(f, "arg_names")}
    jit = {n: f for n, f in jit.items() if getattr(f.fn, "__module__", None) == module.__name__}
    sources = {n: inspect.getsource(f.fn) for n, f in jit.items()}
    called = {n for n in jit for m, src in sources.items() if m != n and re.search(rf"\b{n}\(", src)}
    return sorted(set(jit) - called)


def gaps() -> list[str]:
    """What the run did not reach, one line each (empty: every branch of every touched module)."""
    data()
    out = []
    for name in sorted({k.split(":")[0] for k in _SEEN}):
        for kernel in _LAUNCHABLE.get(name, ()):
            switches = _SEEN.get(f"{name}:{kernel}")
            if switches is None:
                out.append(f"{name}:{kernel} never launched")
                continue
            for switch, values in sorted(switches.items()):
                if all(isinstance(v, bool) for v in values) and len(values) < 2:
                    out.append(f"{name}:{kernel} {switch} only {values[0]}")
    return out
