"""Per op: `<op>_kernels.py` (Triton kernels) and `<op>.py` (launchers, reference path, the op declaration);
`kernel_helpers.py` holds the Triton helpers several kernels modules call, `scaled_mm_route.py` the part of
kp::scaled_mm that hands calls to cuBLASLt."""
