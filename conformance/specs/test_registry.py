"""The registry (kp_conformance.registry) holds together: every kernel registered with kp_core has a conformance
spec of its package, every spec a registered op, and every spec that covers kernels its docs page, benchmark,
nav entry and row in its package page's table of ops, named after it; every docs/ops page belongs to a spec."""

import importlib.util
import pathlib
import re

import pytest

import kp_conformance
import kp_core
from kp_conformance import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]

kp_conformance.declare(
    kp_conformance.Spec(
        name="registry",
        package="kp-conformance",
        ops=(),
        reference="kp_core.registered_kernels() against the declared specs and the files named after them",
        dtypes=(),
        properties=("every_kernel_has_spec", "every_op_has_its_files"),
    )
)


@pytest.mark.conformance(kernel="registry", prop="every_kernel_has_spec")
def test_every_registered_kernel_has_a_spec():
    specs = registry.load_specs(ROOT)
    registered = kp_core.registered_kernels()
    assert registered, "no kernel is registered: the packages under test were not imported"
    missing = {name: info.spec for name, info in registered.items() if info.spec not in specs}
    assert not missing, f"registered kernels without a conformance spec: {missing}"
    uncovered = {name for name, info in registered.items() if name not in specs[info.spec].ops}
    assert not uncovered, f"ops whose spec does not list them: {uncovered}"
    stale = {op for s in specs.values() for op in s.ops if op not in registered}
    assert not stale, f"specs name ops that are not registered: {stale}"
    owner = {name: (info.package, specs[info.spec].package) for name, info in registered.items()}
    elsewhere = {name: pair for name, pair in owner.items() if pair[0] != pair[1]}
    assert not elsewhere, f"ops of another package than their spec's (op's, spec's): {elsewhere}"


def _hooks():
    """docs/hooks.py, the mkdocs hook that makes the Ops nav and the packages' tables of ops (needs no mkdocs)."""
    spec = importlib.util.spec_from_file_location("kp_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.conformance(kernel="registry", prop="every_op_has_its_files")
def test_every_op_has_its_docs_page_benchmark_and_nav_entry():
    specs = registry.load_specs(ROOT)
    ops = registry.kernel_specs(specs)
    assert ops, "no spec covers a registered kernel: the packages under test were not imported"
    missing = [f.format(n) for n in ops for f in registry.FILES.values() if not (ROOT / f.format(n)).is_file()]
    assert not missing, f"files of specs that cover kernels (named after the spec) missing: {missing}"
    pages = {p.stem for p in (ROOT / "docs" / "ops").glob("*.md")}
    assert pages <= set(ops), f"docs/ops pages with no spec that covers kernels: {sorted(pages - set(ops))}"
    hooks = _hooks()
    config = (ROOT / "mkdocs.yml").read_text()
    assert re.search(r"^hooks:\n\s+- docs/hooks\.py\b", config, re.M), "mkdocs.yml does not run docs/hooks.py"
    assert re.search(r"^\s+- Ops:", config, re.M), "mkdocs.yml's nav has no Ops section for docs/hooks.py to fill"
    nav = {title: path for entry in hooks.ops_nav(ROOT / "docs") for title, path in entry.items()}
    unlisted = [n for n in ops if nav.get(n) != f"ops/{n}.md"]
    assert not unlisted, f"ops missing from the docs' Ops nav: {unlisted}"
    claimed = {n: hooks.package_of(ROOT / "docs" / nav[n]) for n in ops}
    wrong = {n: (pkg, specs[n].package) for n, pkg in claimed.items() if pkg != specs[n].package}
    assert not wrong, f"docs/ops pages whose 'Part of' names another package than the spec (page's, spec's): {wrong}"
    for package in sorted({specs[n].package for n in ops}):
        assert hooks.OPS_TABLE in (ROOT / "docs" / f"{package}.md").read_text(), f"docs/{package}.md: no ops table"
        table = hooks.ops_table(ROOT / "docs", package)  # fails on a page without its "# <op>: ..." title
        absent = [n for n in ops if specs[n].package == package and f"(ops/{n}.md)" not in table]
        assert not absent, f"ops missing from the table of docs/{package}.md: {absent}"
