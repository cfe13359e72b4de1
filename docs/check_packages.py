"""Fail when README.md's package table disagrees with packages/: every package folder must have a row with its
version, every row with a version must be a package folder of that version (pyproject.toml and __version__).
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


def main() -> int:
    table = {m[1]: m[2] for line in (ROOT / "README.md").read_text().splitlines() if (m := ROW.match(line))}
    problems = []
    for folder in sorted(p for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").is_file()):
        name = folder.name
        version = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["version"]
        init = (folder / "src" / name.replace("-", "_") / "__init__.py").read_text()
        code = re.search(r'^__version__ = "([^"]+)"', init, re.M)
        if code is None or code[1] != version:
            problems.append(f"{name}: pyproject.toml says {version}, __version__ says {code[1] if code else None}")
        if table.get(name) != version:
            problems.append(f"README.md: the row of {name} must say {version}, it says {table.get(name)}")
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
