"""Fail when README.md's package table disagrees with packages/: every package folder must have a row with its
version, every row with a version must be a package folder of that version (its __version__). Every package (and
conformance/) writes its version only in `__version__`: pyproject.toml declares it dynamic and points hatch there.
Every package (and conformance/) carries the repository's LICENSE unchanged (hatchling puts it in the wheel and
sdist) and a py.typed marker.

    python docs/check_packages.py     (run by `nox -s docs`)
"""

import re
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\|\s*`(kp(?:-[a-z]+)?)`\s*\|.*\|\s*([^|]+?)\s*\|\s*$")


def single_version(folder: Path) -> tuple[str | None, str | None]:
    """(the version in the package's __version__, or a problem with how pyproject.toml takes it)."""
    pyproject = tomllib.loads((folder / "pyproject.toml").read_text())
    (module,) = (Path(p).name for p in pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"])
    init = f"src/{module}/__init__.py"
    code = re.search(r'^__version__ = "([^"]+)"', (folder / init).read_text(), re.M)
    version = code[1] if code else None
    if "version" in pyproject["project"] or "version" not in pyproject["project"].get("dynamic", []):
        return version, 'pyproject.toml must not write a version: dynamic = ["version"] takes __version__'
    if pyproject["tool"].get("hatch", {}).get("version", {}).get("path") != init:
        return version, f'pyproject.toml needs [tool.hatch.version] path = "{init}"'
    if version is None:
        return None, f'{init} needs a line __version__ = "<version>"'
    return version, None


def main() -> int:
    table = {m[1]: m[2] for line in (ROOT / "README.md").read_text().splitlines() if (m := ROW.match(line))}
    problems = []
    for folder in [*sorted((ROOT / "packages").iterdir()), ROOT / "conformance"]:
        if not (folder / "pyproject.toml").is_file():
            continue
        version, problem = single_version(folder)
        if problem:
            problems.append(f"{folder.name}: {problem}")
        if folder.parent.name == "packages" and table.get(folder.name) != version:
            problems.append(f"README.md: the row of {folder.name} must say {version}, it says {table.get(folder.name)}")
    license_text = (ROOT / "LICENSE").read_text()
    for folder in [*sorted((ROOT / "packages").iterdir()), ROOT / "conformance"]:
        if not (folder / "pyproject.toml").is_file():
            continue
        if not (folder / "LICENSE").is_file() or (folder / "LICENSE").read_text() != license_text:
            problems.append(f"{folder.name}: LICENSE must be a copy of the repository's")
        if not list((folder / "src").glob("*/py.typed")):
            problems.append(f"{folder.name}: its package under src/ needs a py.typed marker")
    for name, status in table.items():
        if status != "planned" and not (ROOT / "packages" / name / "pyproject.toml").is_file():
            problems.append(f"README.md: {name} has status {status!r} but packages/{name}/ does not exist")
    for problem in problems:
        print(f"check_packages: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
