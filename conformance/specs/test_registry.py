"""Every kernel registered with kp_core must have a conformance spec, and every spec a registered op."""

import importlib.util
import pathlib

import pytest

import kp_conformance
import kp_core

SPEC_DIR = pathlib.Path(__file__).parent


def _load_specs():
    for path in sorted(SPEC_DIR.glob("test_*.py")):
        if path.name == pathlib.Path(__file__).name:
            continue
        spec = importlib.util.spec_from_file_location(f"kp_spec_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # declares its Spec and imports its package (registering ops)
    return dict(kp_conformance.SPECS)


@pytest.mark.conformance(kernel="registry", prop="every_kernel_has_spec")
def test_every_registered_kernel_has_a_spec():
    specs = _load_specs()
    registered = kp_core.registered_kernels()
    assert registered, "no kernel is registered: the packages under test were not imported"
    missing = {name: info.spec for name, info in registered.items() if info.spec not in specs}
    assert not missing, f"registered kernels without a conformance spec: {missing}"
    uncovered = {name for name, info in registered.items() if name not in specs[info.spec].ops}
    assert not uncovered, f"ops whose spec does not list them: {uncovered}"
    stale = {op for s in specs.values() for op in s.ops if op not in registered}
    assert not stale, f"specs name ops that are not registered: {stale}"
