"""The public API of the packages, read from their sources (griffe, no import: torch is not needed), for the API
reference pages (docs/api/<package>.md) and the docstring check that makes `mkdocs build --strict` fail.

Public is what a package's `__init__` exports in `__all__`, and what an API page documents with a
`::: <identifier>` line of its own (the submodules the docs tell users to import, and their members). Each
public object needs a docstring; each public function and class needs an `Examples:` section in it (Google
style: a title line `Examples:`, then the snippet as `>>>` lines). docs/hooks.py runs the check in `on_config`
and fills each API page's API_MARKER line with one `:::` directive per export.

    python docs/docstrings.py      the check alone: prints every offender, exits 1 if there is one
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
API_MARKER = "<!-- the API of this package, from its __all__: docs/hooks.py fills it in -->"
DIRECTIVE = re.compile(r"^::: ([\w.]+)\s*$", re.M)
# The directive's options: the YAML lines indented under it (only `members: false` matters to the check).
MEMBERS_FALSE = re.compile(r"^\s+members:\s*false\s*$", re.M)
KINDS = {"function": "Functions", "class": "Classes", "attribute": "Constants", "module": "Modules"}


@dataclass
class Package:
    name: str  # the distribution: kp-norms
    module: str  # its import name: kp_norms
    api_page: str  # docs_dir-relative: api/kp-norms.md


def packages(root: Path = ROOT) -> list[Package]:
    """Every packages/<name>/ with a pyproject.toml, with the one module under its src/."""
    found = []
    for folder in sorted((root / "packages").iterdir()):
        if (folder / "pyproject.toml").is_file():
            (module,) = (p.parent.name for p in (folder / "src").glob("*/__init__.py"))
            found.append(Package(folder.name, module, f"api/{folder.name}.md"))
    return found


def loader(root: Path = ROOT):
    """A griffe loader over every package's src/, Google-style docstrings."""
    import griffe

    paths = [str(p) for p in sorted((root / "packages").glob("*/src"))]
    return griffe.GriffeLoader(search_paths=paths, docstring_parser=griffe.Parser.google)


def load(root: Path = ROOT):
    """A loader with every package loaded and its aliases resolved."""
    griffe_loader = loader(root)
    for package in packages(root):
        griffe_loader.load(package.module)
    griffe_loader.resolve_aliases(external=False, implicit=False)
    return griffe_loader


def exports(griffe_loader, module: str) -> list[tuple[str, str]]:
    """[(exported name, path of the object it is)] for a module's `__all__`. A name that is both a submodule and
    a member imported from it (`from kp_norms.patch import patch`: at run time the function) is the member:
    griffe lists the submodule there."""
    mod = griffe_loader.modules_collection[module]
    out = []
    for name in mod.exports or ():
        name = name if isinstance(name, str) else name.name
        member = mod.members.get(name)
        imported = mod.imports.get(name)
        if member is not None and member.is_module and imported and imported != member.path:
            out.append((name, imported))
        else:
            out.append((name, f"{module}.{name}"))
    return out


def target(griffe_loader, path: str):
    obj = griffe_loader.modules_collection[path]
    return obj.final_target if obj.is_alias else obj


def api_markdown(griffe_loader, module: str) -> str:
    """The API_MARKER's replacement: the package's docstring, then one `:::` directive per export, by kind."""
    groups: dict[str, list[tuple[str, str]]] = {kind: [] for kind in KINDS}
    for name, path in exports(griffe_loader, module):
        groups.setdefault(target(griffe_loader, path).kind.value, []).append((f"{module}.{name}", path))
    lines = [f"::: {module}", "    options:", "      members: false", "      show_root_heading: false"]
    lines += ["      show_root_toc_entry: false", ""]
    for kind, entries in groups.items():
        if entries:
            lines += [f"## {KINDS.get(kind, kind.title())}", ""]
            for shown, path in entries:
                lines.append(f"::: {path}")
                if path != shown:  # a member imported under a submodule's name: headed by its public name
                    lines += ["    options:", f"      heading: {shown}", f"      toc_label: {shown.rpartition('.')[2]}"]
                lines.append("")
    return "\n".join(lines)


def page_directives(markdown: str) -> list[tuple[str, bool]]:
    """[(identifier, whether its members are documented too)] of the `:::` lines written on a page."""
    out = []
    for found in DIRECTIVE.finditer(markdown):
        options = re.match(r"(?:\n[ \t]+.*)*", markdown[found.end() :])[0]
        out.append((found[1], MEMBERS_FALSE.search(options) is None))
    return out


def _rendered_members(griffe_loader, obj) -> list:
    """A module directive's members as mkdocstrings renders them: its `__all__`, or else the public objects
    defined in it."""
    if obj.exports is not None:
        names = [n if isinstance(n, str) else n.name for n in obj.exports]
        return [target(griffe_loader, f"{obj.path}.{n}") for n in names]
    return [m for n, m in obj.members.items() if not n.startswith("_") and not m.is_alias and not m.is_module]


def object_problems(obj, shown_as: str) -> list[str]:
    """What is missing from one public object's docstring."""
    kind = obj.kind.value
    if obj.docstring is None or not obj.docstring.value.strip():
        return [f"{shown_as} ({kind} {obj.path}): no docstring"]
    if kind in ("function", "class"):
        sections = [s for s in obj.docstring.parse("google", warnings=False) if s.kind.value == "examples"]
        if not sections:
            return [f"{shown_as} ({kind} {obj.path}): its docstring has no 'Examples:' section"]
        if not any(part.value == "examples" for s in sections for part, _ in s.value):
            return [f"{shown_as} ({kind} {obj.path}): its 'Examples:' section has no '>>>' snippet"]
    return []


def problems(griffe_loader=None, root: Path = ROOT, docs_dir: Path | None = None) -> list[str]:
    """Every public object missing a docstring or an example, and every package without its API page."""
    docs_dir = Path(docs_dir or root / "docs")
    griffe_loader = griffe_loader or load(root)
    found = []
    for package in packages(root):
        mod = griffe_loader.modules_collection[package.module]
        found += object_problems(mod, package.module)
        if mod.exports is None:
            found.append(f"{package.module}: its __init__ has no __all__")
        for name, path in exports(griffe_loader, package.module):
            found += object_problems(target(griffe_loader, path), f"{package.module}.{name}")
        page = docs_dir / package.api_page
        if not page.is_file() or API_MARKER not in page.read_text():
            found.append(f"{package.name}: docs/{package.api_page} must exist and hold the line {API_MARKER}")
            continue
        for identifier, with_members in page_directives(page.read_text()):
            try:
                obj = target(griffe_loader, identifier)
            except KeyError:
                found.append(f"docs/{package.api_page}: '::: {identifier}' names nothing griffe finds")
                continue
            found += object_problems(obj, identifier)
            if obj.is_module and with_members:
                for member in _rendered_members(griffe_loader, obj):
                    found += object_problems(member, f"{identifier}.{member.name}")
    return list(dict.fromkeys(found))


def main() -> int:
    found = problems()
    for problem in found:
        print(f"check_docstrings: {problem}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
