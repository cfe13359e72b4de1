"""mkdocs hook (mkdocs.yml `hooks:`): the lists of ops in the docs come from the pages under docs/ops/, never from a
hand-kept list: the nav's "Ops" section, and the table of a package's ops where its page has the OPS_TABLE line.

An op page is titled "# <op>: <what it is>" and names its package on its "Part of [kp-...](../kp-....md)." line.
In the nav the pages are grouped by package in the order of the nav's package pages, then by op name, each
titled with its op name (the spec's name: see kp_conformance.registry). conformance/specs/test_registry.py checks
that every op has its page and that the nav lists it.
"""

import re
from pathlib import Path

PART_OF = re.compile(r"^Part of \[(kp-[a-z-]+)\]\(\.\./\1\.md\)", re.M)
TITLE = re.compile(r"# (\w+): (.+)")  # an op page's first line
OPS_TABLE = "<!-- the table of this package's ops: docs/hooks.py fills it in -->"


def package_of(page: Path) -> str:
    found = PART_OF.search(page.read_text())
    if found is None:
        raise ValueError(f"{page}: no 'Part of [kp-...](../kp-....md).' line naming the op's package")
    return found[1]


def ops_nav(docs_dir, packages=()) -> list[dict[str, str]]:
    """[{op: "ops/<op>.md"}, ...] for every page of docs_dir/ops, by package (in `packages`' order), then by op."""
    rank = {name: i for i, name in enumerate(packages)}
    pages = sorted(Path(docs_dir, "ops").glob("*.md"), key=lambda p: (rank.get(package_of(p), len(rank)), p.stem))
    return [{page.stem: f"ops/{page.name}"} for page in pages]


def ops_table(docs_dir, package: str) -> str:
    """A markdown table of the package's ops: each op's page and what its title says it is."""
    rows = ["| op | what it is |", "|---|---|"]
    for page in sorted(Path(docs_dir, "ops").glob("*.md")):
        title = TITLE.match(page.read_text())
        if title is None or title[1] != page.stem:
            raise ValueError(f"{page}: its first line must be '# {page.stem}: <what it is>'")
        if package_of(page) == package:
            rows.append(f"| [{page.stem}](ops/{page.name}) | {title[2]} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    if OPS_TABLE not in markdown:
        return markdown
    return markdown.replace(OPS_TABLE, ops_table(config["docs_dir"], Path(page.file.src_uri).stem))


def on_config(config):
    entries = [e for e in config["nav"] if isinstance(e, dict)]
    ops = next((e for e in entries if "Ops" in e), None)
    if ops is None:
        raise ValueError("mkdocs.yml: the nav needs an 'Ops' entry for docs/hooks.py to fill")
    pages = [v for e in entries for v in e.values() if isinstance(v, str)]
    ops["Ops"] = ops_nav(config["docs_dir"], [p.removesuffix(".md") for p in pages if p.startswith("kp-")])
    return config
