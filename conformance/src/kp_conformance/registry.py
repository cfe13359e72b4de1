"""The one registry every per-op list derives from: the conformance specs joined with kp-core's kernel registry.

Each conformance/specs/test_<name>.py declares `Spec(name=<name>, package=..., ops=...)`; importing it imports its
package, whose `kp_core.op` declarations register the ops (`kp_core.registered_kernels()`: name, package, spec,
dtypes). A spec that covers registered kernels has its files named after it, the same name everywhere (FILES).
Memcheck's specs and dtypes and mutants' spec files per package come from here, the docs' Ops nav from the pages
(docs/hooks.py); specs/test_registry.py fails when an op has no spec or a spec lacks one of its files.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import kp_conformance
import kp_core
from kp_conformance.spec import Spec

SPEC_DIR = "conformance/specs"
# What each spec <name> that covers kernels has, relative to the repository root.
FILES = {
    "spec": SPEC_DIR + "/test_{}.py",
    "docs page": "docs/ops/{}.md",
    "benchmark": "benchmarks/bench_{}.py",
}


def spec_file(name: str) -> str:
    return FILES["spec"].format(name)


def load_specs(root: Path) -> dict[str, Spec]:
    """Import every spec module under root (each declares its Spec and imports its package, registering its ops),
    under a name of its own, so that modules a pytest run imported already are left alone."""
    for path in sorted((Path(root) / SPEC_DIR).glob("test_*.py")):
        spec = importlib.util.spec_from_file_location(f"kp_spec_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return dict(kp_conformance.SPECS)


def kernel_specs(specs: dict[str, Spec]) -> list[str]:
    """The specs whose ops are registered kp kernels, in the order given: the ones whose tests launch them."""
    registered = kp_core.registered_kernels()
    return [name for name, s in specs.items() if any(op in registered for op in s.ops)]
