"""Branch census: which kernels a run launched, and with which compile-time switches.

A tier must reach every branch of every kernel it touches: for each kernels module (`kp_*.ops.*_kernels`) a run
launched anything from, every launchable kernel of that module (a `@triton.jit` function no other kernel of the
module calls) must have launched, and every bool constexpr of each must have been seen both True and False.
A module counts as touched when a spec importing its package launched it: kp-losses' spec reaches kp-precision's
casts through the float8 head, and a run of that spec alone answers for kp-losses' kernels, not kp-precision's.
Other constexprs (tile sizes, activation ids) are listed in the report, not enforced.
"""

from __future__ import annotations

import inspect
import re
import sys

_SEEN: dict[str, dict[str, list]] = {}  # "module:kernel" -> {constexpr: distinct values}
_LAUNCHABLE: dict[str, list[str]] = {}  # module -> its launchable kernels (filled where the modules are imported)
_OWNED: set[str] = set()  # kernels modules launched by a spec that imports their package
_PACKAGES: set[str] = set()  # the kp packages the running spec imports


def testing(module) -> None:
    """The spec module whose test runs now (its kp package imports, direct or through imported names)."""
    names = {getattr(v, "__name__" if inspect.ismodule(v) else "__module__", None) for v in vars(module).values()}
    _PACKAGES.clear()
    _PACKAGES.update(n.split(".")[0] for n in names if isinstance(n, str) and n.startswith("kp_"))


def note(kernel, consts: dict) -> None:
    fn = getattr(kernel, "fn", kernel)
    if not fn.__module__.startswith("kp_"):  # the suite's own test kernels
        return
    if fn.__module__.split(".")[0] in _PACKAGES:
        _OWNED.add(fn.__module__)
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
    return {"seen": _SEEN, "launchable": _LAUNCHABLE, "owned": sorted(_OWNED)}


def merge(other: dict) -> None:
    _LAUNCHABLE.update(other["launchable"])
    _OWNED.update(other.get("owned", ()))
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


def touched() -> list[str]:
    """The kernels modules the census answers for: launched by a spec importing their package."""
    return sorted({k.split(":")[0] for k in _SEEN} & _OWNED)


def gaps() -> list[str]:
    """What the run did not reach, one line each (empty: every branch of every touched module)."""
    data()
    out = []
    for name in touched():
        for kernel in _LAUNCHABLE.get(name, ()):
            switches = _SEEN.get(f"{name}:{kernel}")
            if switches is None:
                out.append(f"{name}:{kernel} never launched")
                continue
            for switch, values in sorted(switches.items()):
                if all(isinstance(v, bool) for v in values) and len(values) < 2:
                    out.append(f"{name}:{kernel} {switch} only {values[0]}")
    return out
