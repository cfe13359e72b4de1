"""Per op: `<op>_kernels.py` (Triton kernels) and `<op>.py` (launchers, reference path, the op declaration)."""
