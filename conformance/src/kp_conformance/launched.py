"""Proof that a conformance check ran the kernel itself: which backend a cell needs, and the assertion."""

from __future__ import annotations

import pytest
import torch

from kp_conformance.env import interpreting, not_covered_reason


def kernel_backend() -> str:
    """The backend a kernel must have launched on for a cell to count: the interpreter off-GPU, else Triton."""
    import kp_core

    return kp_core.INTERPRET if interpreting() else kp_core.TRITON


def skip_if_not_covered(dtype: torch.dtype, uses_dot: bool = False) -> None:
    reason = not_covered_reason(dtype, uses_dot)
    if reason:
        pytest.skip(reason)


def assert_kernel_ran(record, *ops: str) -> None:
    """Every op in `ops` launched, and only on the kernel backend (never the reference fallback)."""
    expected = kernel_backend()
    for op in ops:
        ran = record.backends(op)
        assert ran == {expected}, f"{op}: expected only {expected} launches, got {ran or 'none'}"
