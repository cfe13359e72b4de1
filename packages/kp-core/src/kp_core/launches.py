"""A record of kernel launches: the proof that a kernel (not the reference) produced a result."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Launch:
    op: str
    kernel: str
    backend: str


@dataclass
class LaunchRecord:
    launches: list[Launch] = field(default_factory=list)

    def count(self, op: str | None = None, backend: str | None = None, kernel: str | None = None) -> int:
        return sum(
            1
            for launch in self.launches
            if (op is None or launch.op == op)
            and (backend is None or launch.backend == backend)
            and (kernel is None or launch.kernel == kernel)
        )

    def backends(self, op: str | None = None) -> set[str]:
        return {launch.backend for launch in self.launches if op is None or launch.op == op}


# Process-wide, not per thread: on CUDA, autograd runs backward on its own device thread.
_records: list[LaunchRecord] = []
_lock = threading.Lock()


def note_launch(op: str, kernel: str, backend: str) -> None:
    """Called by every launcher (and every reference path, with backend="reference")."""
    if _records:
        launch = Launch(op, kernel, backend)
        with _lock:
            for record in _records:
                record.launches.append(launch)


@contextlib.contextmanager
def record_launches() -> Iterator[LaunchRecord]:
    record = LaunchRecord()
    with _lock:
        _records.append(record)
    try:
        yield record
    finally:
        with _lock:
            _records.remove(record)
