"""What a spec declares; `specs/test_registry.py` fails if a registered kp kernel has no spec."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Spec:
    name: str  # matches KernelInfo.spec in kp_core's registry
    ops: tuple[str, ...]  # the torch.library ops it covers
    reference: str  # where the independent reference's maths comes from
    dtypes: tuple[torch.dtype, ...]
    properties: tuple[str, ...]
    requires: str = "any GPU Triton supports; CPU through the Triton interpreter"


SPECS: dict[str, Spec] = {}


def declare(spec: Spec) -> Spec:
    SPECS[spec.name] = spec
    return spec
