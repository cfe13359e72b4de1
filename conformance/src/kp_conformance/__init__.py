"""kp-conformance: shared strategies, tiers, tolerance rule and reporting for kp's kernel specs."""

from kp_conformance import guard
from kp_conformance.env import arch, device, dtype_id, interpreting, not_covered_reason
from kp_conformance.launched import assert_kernel_ran, kernel_backend, skip_if_not_covered
from kp_conformance.spec import SPECS, Spec, bad_input_test, declare, fuzz_test
from kp_conformance.strategies import (
    ATTENTION_FAMILIES,
    FAMILIES,
    GLU_FAMILIES,
    LAYOUTS,
    alibi_slopes,
    attention_family,
    kv_cache,
    make_input,
    randn,
    row_shapes,
)
from kp_conformance.tiers import TIERS, current, register_profiles
from kp_conformance.tolerance import atol_for, check_close, check_decode

__version__ = "0.2.0"

__all__ = [
    "guard",
    "LAYOUTS",
    "SPECS",
    "Spec",
    "declare",
    "TIERS",
    "arch",
    "assert_kernel_ran",
    "atol_for",
    "bad_input_test",
    "fuzz_test",
    "check_close",
    "check_decode",
    "current",
    "device",
    "dtype_id",
    "interpreting",
    "kernel_backend",
    "kv_cache",
    "make_input",
    "FAMILIES",
    "ATTENTION_FAMILIES",
    "GLU_FAMILIES",
    "alibi_slopes",
    "attention_family",
    "randn",
    "not_covered_reason",
    "register_profiles",
    "row_shapes",
    "skip_if_not_covered",
]
