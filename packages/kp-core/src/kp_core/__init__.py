"""kp-core: backend choice, launch records, input checks, launch settings and op registration."""

from kp_core.backend import (
    INTERPRET,
    REFERENCE,
    TRITON,
    choose_backend,
    forced_backend,
    has_triton,
    interpreter_enabled,
)
from kp_core.checks import (
    FLOAT_DTYPES,
    check_index_fits,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from kp_core.launch_config import (
    MAX_FUSED_COLS,
    RowConfig,
    next_power_of_2,
    persistent_programs,
    row_config,
)
from kp_core.launches import Launch, LaunchRecord, note_launch, record_launches
from kp_core.library import KernelInfo, custom_op, registered_kernels

__version__ = "0.1.0"

__all__ = [
    "FLOAT_DTYPES",
    "INTERPRET",
    "MAX_FUSED_COLS",
    "REFERENCE",
    "TRITON",
    "KernelInfo",
    "Launch",
    "LaunchRecord",
    "RowConfig",
    "check_index_fits",
    "check_same_device",
    "check_same_dtype",
    "check_shape",
    "check_tensor",
    "choose_backend",
    "custom_op",
    "forced_backend",
    "has_triton",
    "interpreter_enabled",
    "next_power_of_2",
    "note_launch",
    "persistent_programs",
    "record_launches",
    "registered_kernels",
    "row_config",
]
