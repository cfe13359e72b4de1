"""kp-losses' ops: per op, its Triton kernels (`*_kernels.py`) and its launchers + declaration beside them."""
