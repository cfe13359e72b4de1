"""mkdocs hook (mkdocs.yml `hooks:`): the lists of ops in the docs come from the pages under docs/ops/, never from a
hand-kept list: the nav's "Ops" section, and the table of a package's ops where its page has the OPS_TABLE line.

An op page is titled "# <op>: <what it is>" and names its package on its "Part of [kp-...](../kp-....md)." line.
In the nav the pages are grouped by package in the order of the nav's package pages, then by op name, each
titled with its op name (the spec's name: see kp_conformance.registry). conformance/specs/test_registry.py checks
that every op has its page and that the nav lists it.

The benchmark plots (benchmarks/results/<device>/*.png) join the site as plots/<device>/<name>.png, and the PLOTS
line of a page becomes every plot, by device: a committed plot is on the site without a hand-kept list.

The nav's "API reference" section is every package's docs/api/<package>.md, in the same order; the API_MARKER line
of such a page becomes one mkdocstrings directive per name of the package's __all__ (docs/docstrings.py). Before
the build, every public object's docstring is checked there (a docstring; for a function or class, an Examples:
section with a >>> snippet): one missing fails the build, naming each offender.
"""

import importlib.util
import re
import sys
from pathlib import Path

PART_OF = re.compile(r"^Part of \[(kp-[a-z-]+)\]\(\.\./\1\.md\)", re.M)
TITLE = re.compile(r"# (\w+): (.+)")  # an op page's first line
OPS_TABLE = "<!-- the table of this package's ops: docs/hooks.py fills it in -->"
PLOTS = "<!-- every benchmark plot: docs/hooks.py fills them in -->"
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


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


def plots() -> list[tuple[str, Path]]:
    """(site path, file) of every committed benchmark plot, by device then name."""
    return [(f"plots/{png.parent.name}/{png.name}", png) for png in sorted(RESULTS.glob("*/*.png"))]


def plots_markdown() -> str:
    """Every plot under a heading per device, each captioned with its results table's path."""
    lines, device = [], None
    for uri, png in plots():
        if png.parent.name != device:
            device = png.parent.name
            lines += [f"### {device}", ""]
        lines += [f"`benchmarks/results/{device}/{png.stem}.md`", "", f"![{device} {png.stem}]({uri})", ""]
    return "\n".join(lines)


def on_files(files, config):
    from mkdocs.structure.files import File  # imported here, as in on_config

    for uri, png in plots():
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


_LOADED = {}  # "griffe": the packages as docs/docstrings.py loads them, once per build (on_config)


def _docstrings():
    """docs/docstrings.py as a module (hooks are loaded from their path; docs/ is not on sys.path)."""
    name = "kp_docs_docstrings"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("docstrings.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def on_page_markdown(markdown, page, config, files):
    if OPS_TABLE in markdown:
        markdown = markdown.replace(OPS_TABLE, ops_table(config["docs_dir"], Path(page.file.src_uri).stem))
    if PLOTS in markdown:
        markdown = markdown.replace(PLOTS, plots_markdown())
    docstrings = _docstrings()
    if docstrings.API_MARKER in markdown:
        package = next(p for p in docstrings.packages() if p.api_page == page.file.src_uri)
        api = docstrings.api_markdown(_LOADED.get("griffe") or docstrings.load(), package.module)
        markdown = markdown.replace(docstrings.API_MARKER, api)
    return markdown


def on_config(config):
    entries = [e for e in config["nav"] if isinstance(e, dict)]
    ops = next((e for e in entries if "Ops" in e), None)
    if ops is None:
        raise ValueError("mkdocs.yml: the nav needs an 'Ops' entry for docs/hooks.py to fill")
    pages = [v for e in entries for v in e.values() if isinstance(v, str)]
    names = [p.removesuffix(".md") for p in pages if p.startswith("kp-") or p == "kp.md"]
    ops["Ops"] = ops_nav(config["docs_dir"], [n for n in names if n != "kp"])
    api = next((e for e in entries if "API reference" in e), None)
    if api is None:
        raise ValueError("mkdocs.yml: the nav needs an 'API reference' entry for docs/hooks.py to fill")
    docstrings = _docstrings()
    rank = {name: i for i, name in enumerate(names)}
    pages = sorted(docstrings.packages(), key=lambda p: (rank.get(p.name, len(rank)), p.name))
    api["API reference"] = [{p.name: p.api_page} for p in pages]
    _LOADED["griffe"] = docstrings.load()
    problems = docstrings.problems(_LOADED["griffe"], docs_dir=config["docs_dir"])
    if problems:
        # imported here: conformance/specs/test_registry.py loads this file where mkdocs is not installed
        from mkdocs.exceptions import PluginError

        raise PluginError("docstrings (docs/docstrings.py):\n  " + "\n  ".join(problems))
    return config
