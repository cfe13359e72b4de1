"""What a spec declares: its Spec (the registry's entry, kp_conformance.registry) and its bad-input cases.

`specs/test_registry.py` fails if a registered kp kernel has no spec, or a spec's ops lack their docs page,
benchmark or nav entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


@dataclass(frozen=True)
class Spec:
    name: str  # matches KernelInfo.spec in kp_core's registry; the file names follow it (kp_conformance.registry)
    package: str  # whose code it checks ("kp-norms"): mutants run a package's specs against its planted bugs
    ops: tuple[str, ...]  # the torch.library ops it covers
    reference: str  # where the independent reference's maths comes from
    dtypes: tuple[torch.dtype, ...]
    properties: tuple[str, ...]
    requires: str = "any GPU Triton supports; CPU through the Triton interpreter"


SPECS: dict[str, Spec] = {}


def declare(spec: Spec) -> Spec:
    SPECS[spec.name] = spec
    return spec


def bad_input_test(kernel: str, cases: Sequence[tuple], *args) -> Callable:
    """A spec's `test_bad_input`, one case a test: `cases` holds (what, call, error, words), and `call(*args)` must
    raise `error` with a message matching `words`. Its matrix cell is (kernel, bad_input); bind it to the name
    `test_bad_input` in the spec (mutants deselect "bad_input": argument checks are blind to a kernel's maths)."""

    @pytest.mark.conformance(kernel=kernel, prop="bad_input")
    @pytest.mark.parametrize("what,call,error,words", cases, ids=[c[0] for c in cases])
    def test_bad_input(what, call, error, words):
        with pytest.raises(error, match=words):
            call(*args)

    return test_bad_input


def fuzz_test(kernel: str, targets: Sequence) -> Callable:
    """A spec's bad-input fuzzer (kp_conformance.fuzz): one test per (target, argument, mutation), Hypothesis
    drawing the mutation's details. Its matrix cell is (kernel, bad_input); bind it to `test_bad_input_fuzz`."""
    from kp_conformance import env, fuzz, tiers

    by_name = {t.name: t for t in targets}
    assert len(by_name) == len(targets), "fuzz targets need distinct names"
    params = [pytest.param(t.name, a, k, id=f"{t.name}:{a}:{k}") for t in targets for a, k in fuzz.cases(t)]

    @pytest.mark.conformance(kernel=kernel, prop="bad_input")
    @pytest.mark.parametrize("target,arg,kind", params)
    @settings(max_examples=min(tiers.current().max_examples, 4))
    @given(data=st.data())
    def test_bad_input_fuzz(target, arg, kind, data):
        fuzz.check(by_name[target], arg, kind, data, env.device())

    return test_bad_input_fuzz
