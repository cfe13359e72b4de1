"""kp-core: backend choice, input checks, launch settings, kernel launches and records, op declaration, reused
scratch buffers, the activations kernels fuse."""

from kp_core.activation import Activation
from kp_core.backend import (
    INTERPRET,
    REFERENCE,
    TRITON,
    choose_backend,
    forced_backend,
    has_triton,
    interpreter_enabled,
    interpreter_problem,
)
from kp_core.checks import (
    FLOAT_DTYPES,
    check_bool,
    check_callable,
    check_index_fits,
    check_module,
    check_no_overlap,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from kp_core.constants import GELU_TANH_CUBIC, INV_SQRT_2PI, LN2, LOG2E, SQRT1_2, SQRT_2_OVER_PI
from kp_core.launch_config import (
    MAX_FUSED_COLS,
    RowConfig,
    cdiv,
    next_power_of_2,
    persistent_programs,
    row_config,
    sm_count,
)
from kp_core.launches import (
    Constexprs,
    Launch,
    LaunchRecord,
    inlining_active,
    launch,
    note_launch,
    record_launches,
    reference,
    set_guard,
)
from kp_core.library import KernelInfo, Op, op, registered_kernels, vjp
from kp_core.scratch import workspace
from kp_core.timing import median_ms
from kp_core.tolerance import atol_for, rule_bound
from kp_core.tuning import pin, pinned, settings, unpin

__version__ = "0.3.0"

__all__ = [
    "Activation",
    "Constexprs",
    "FLOAT_DTYPES",
    "GELU_TANH_CUBIC",
    "INTERPRET",
    "INV_SQRT_2PI",
    "KernelInfo",
    "LN2",
    "LOG2E",
    "Launch",
    "LaunchRecord",
    "MAX_FUSED_COLS",
    "Op",
    "REFERENCE",
    "RowConfig",
    "SQRT1_2",
    "SQRT_2_OVER_PI",
    "TRITON",
    "atol_for",
    "cdiv",
    "check_bool",
    "check_callable",
    "check_index_fits",
    "check_module",
    "check_no_overlap",
    "check_same_device",
    "check_same_dtype",
    "check_shape",
    "check_tensor",
    "choose_backend",
    "forced_backend",
    "has_triton",
    "interpreter_enabled",
    "interpreter_problem",
    "inlining_active",
    "launch",
    "median_ms",
    "next_power_of_2",
    "note_launch",
    "op",
    "persistent_programs",
    "pin",
    "pinned",
    "record_launches",
    "reference",
    "registered_kernels",
    "row_config",
    "rule_bound",
    "set_guard",
    "settings",
    "sm_count",
    "unpin",
    "vjp",
    "workspace",
]
