"""What graphed callables did: captures, replays per bucket, eager fallbacks, pool bytes, capture time."""

from __future__ import annotations

import dataclasses
import weakref


@dataclasses.dataclass
class Stats:
    name: str
    capture_seconds: float = 0.0
    replays: dict = dataclasses.field(default_factory=dict)  # bucket -> count
    captured: dict = dataclasses.field(default_factory=dict)  # bucket -> captures (per signature; again when stale)
    eager: dict = dataclasses.field(default_factory=dict)  # reason -> count
    invalidations: int = 0
    pool_bytes: int = 0

    def count_eager(self, reason: str) -> None:
        self.eager[reason] = self.eager.get(reason, 0) + 1

    @property
    def captures(self) -> int:
        return sum(self.captured.values())

    @property
    def calls(self) -> int:
        return sum(self.replays.values()) + sum(self.eager.values())

    @property
    def hit_rate(self) -> float:
        """The share of calls replayed from a graph (the rest ran eagerly)."""
        return sum(self.replays.values()) / self.calls if self.calls else 0.0

    def bucket_hit_rates(self) -> dict:
        """Per bucket, the share of its replays that found their graph already captured."""
        return {b: (n - self.captured.get(b, 0)) / n for b, n in self.replays.items() if n}


_LIVE: weakref.WeakSet = weakref.WeakSet()


def register(graphed) -> None:
    _LIVE.add(graphed)


def report() -> str:
    """A markdown table of every live graphed callable's stats.

    Examples:
        >>> import torch
        >>> import kp_graphs
        >>> g = kp_graphs.graphed(torch.nn.Linear(8, 8), buckets=[4], name="tiny")
        >>> y = g(torch.randn(3, 8))  # on a CPU: eager, counted
        >>> table = kp_graphs.report().splitlines()
        >>> table[0].split(" | ")[:4]
        ['| graphed', 'calls', 'replayed', 'per bucket: replays (graph already there)']
        >>> [row for row in table if row.startswith("| tiny")]
        ['| tiny | 1 | 0 % | - | not on a CUDA device: 1 | 0 | 0.000 | 0.0 |']
    """
    lines = [
        "| graphed | calls | replayed | per bucket: replays (graph already there) | eager (why) | captures | "
        "capture s | pool MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in sorted(_LIVE, key=lambda g: g.stats.name):
        s = g.stats
        hits = s.bucket_hit_rates()
        per = ", ".join(f"{b}: {n} ({100 * hits[b]:.0f} %)" for b, n in sorted(s.replays.items())) or "-"
        why = ", ".join(f"{r}: {n}" for r, n in sorted(s.eager.items())) or "-"
        lines.append(
            f"| {s.name} | {s.calls} | {100 * s.hit_rate:.0f} % | {per} | {why} | {s.captures} | "
            f"{s.capture_seconds:.3f} | {s.pool_bytes / 2**20:.1f} |"
        )
    return "\n".join(lines)
