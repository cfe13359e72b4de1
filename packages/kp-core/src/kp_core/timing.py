"""How long a call takes, for the choices kp makes by measuring (kp.optimize's layers, kp-attention's backend)."""

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object]) -> float:
    """Median ms of timed calls after warm-up: CUDA events on a GPU (about 25 ms of calls, 3 to 100 of them); wall
    time elsewhere, where the kernels run interpreted and the figure only orders candidates of one run.

    Args:
        fn: a call with no arguments; its result is ignored.

    Examples:
        >>> import torch
        >>> import kp_core
        >>> x = torch.randn(256, 256)
        >>> ms = kp_core.median_ms(lambda: x @ x)
        >>> ms > 0
        True
    """
    fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = int(min(100, max(3, 25.0 / max(start.elapsed_time(end), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)
