"""Fail when a package's modules import each other in a circle, or import another module's private (`_name`)
objects, or raise a TypeError/ValueError whose message does not follow the error convention; print each
package's module count, floors and largest file with --stats.

The error convention: a message starts with the public function the user called, `kp_norms.rms_norm: ...`;
never with a torch.library op name (`kp::norm: ...`), which several functions share and users never call.

    python docs/check_imports.py [--stats]      (run by `nox -s lint`)

Imports are read from the source (ast), at any depth: an import inside a function to dodge a circle is still
one. Floors: the longest chain of imports inside the package, counting the modules on it (1 = imports no
module of its own package). A module imports its package's `__init__` only through a name it re-exports, so
package `__init__` files are left out of the graph.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for one package's src folder."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            continue
        out[".".join(parts)] = path
    return out


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import of a module in `known`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:  # from pkg.ops import quantize (a module)
                    out.append((sub, None, node.lineno))
                elif node.module in known:
                    out.append((node.module, alias.name, node.lineno))
    return out


def error_prefixes(path: Path) -> list[tuple[int, str]]:
    """Raised TypeError/ValueError messages that start with an op name (`kp::...`, or an `OP` constant)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        call = node.exc if isinstance(node, ast.Raise) else None
        if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") in ("TypeError", "ValueError")):
            continue
        first = call.args[0] if call.args else None
        if isinstance(first, ast.JoinedStr) and first.values:
            first = first.values[0]
            if isinstance(first, ast.FormattedValue) and getattr(first.value, "id", "").endswith("OP"):
                out.append((node.lineno, "an error message starts with an op name: name the public function"))
                continue
        if isinstance(first, ast.Constant) and str(first.value).startswith("kp::"):
            out.append((node.lineno, "an error message starts with an op name: name the public function"))
    return out


def check(src: Path) -> tuple[list[str], dict]:
    known = modules(src)
    graph = {m: set() for m in known}
    problems = []
    for mod, path in known.items():
        for target, name, line in imports(path, known):
            graph[mod].add(target)
            if name is not None and name.startswith("_"):
                where = path.relative_to(ROOT)
                problems.append(f"{where}:{line}: imports the private {name} from {target}")
        problems += [f"{path.relative_to(ROOT)}:{line}: {why}" for line, why in error_prefixes(path)]
    found = circles(graph)
    for cycle in found:
        problems.append("import circle: " + " -> ".join([*cycle, cycle[0]]))
    # floors over the graph with each circle as one node (a circle's modules share a floor)
    node = {m: min(c) for c in found for m in c}

    @functools.cache
    def floor(m: str) -> int:
        members = [c for c in found if m in c]
        out = {node.get(t, t) for n in (members[0] if members else [m]) for t in graph[n]} - {m}
        return 1 + max((floor(t) for t in out), default=0)

    largest = max(known.values(), key=lambda p: len(p.read_text().splitlines()))
    stats = dict(
        modules=len(known),
        floors=max((floor(node.get(m, m)) for m in graph), default=0),
        largest=f"{largest.relative_to(src)} ({len(largest.read_text().splitlines())} lines)",
    )
    return problems, stats


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one member's cycle order."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stats", action="store_true", help="print modules, floors and the largest file per package")
    args = parser.parse_args()
    bad = 0
    for src in sorted(ROOT.glob("packages/*/src")) + [ROOT / "conformance" / "src"]:
        problems, stats = check(src)
        for problem in problems:
            print(f"check_imports: {problem}")
        bad += len(problems)
        if args.stats:
            print(
                f"{src.parent.name}: {stats['modules']} modules, {stats['floors']} floors, largest {stats['largest']}"
            )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
