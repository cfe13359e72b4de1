"""The tiers' Hypothesis draws depend on the test alone: not on which modules a worker happened to import before
it (kp_conformance.tiers turns off Hypothesis' constants taken from local modules), so a tier's examples, and the
suite's run time, are the same in every run and every order."""

import importlib.util
import sys

import pytest
from hypothesis import given, settings

import kp_conformance as kc

kc.declare(
    kc.Spec(
        name="tiers",
        package="kp-conformance",
        ops=(),
        reference="the same strategy's draws before and after a local module full of literals is imported",
        dtypes=(),
        properties=("reproducible_draws",),
    )
)


def _draws():
    seen = []

    @settings(max_examples=30, derandomize=True, database=None)
    @given(kc.row_shapes(kc.current()))
    def run(shape):
        seen.append(shape)

    run()
    return seen


@pytest.mark.conformance(kernel="tiers", prop="reproducible_draws")
def test_draws_do_not_depend_on_loaded_modules(tmp_path, monkeypatch):
    before = _draws()
    # A module outside site-packages, as a conftest, a helper on PYTHONPATH or torch.compile's generated code is.
    path = tmp_path / "kp_local_literals.py"
    path.write_text("SIZES = (" + ", ".join(str(7 * i + 3) for i in range(400)) + ")\n")
    spec = importlib.util.spec_from_file_location("kp_local_literals", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "kp_local_literals", module)  # taken out again after the test
    assert _draws() == before, "the tier's draws changed when a local module was imported"
