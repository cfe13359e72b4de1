"""Size tiers. Each is a Hypothesis profile; a tier's strategies also draw every smaller tier's sizes."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, settings


@dataclass(frozen=True)
class Tier:
    name: str
    max_numel: int  # elements in one input tensor
    max_cols: int  # widest normalised row
    max_examples: int


TIERS = (
    Tier("micro", 4_096, 300, 12),
    Tier("small", 200_000, 20_000, 12),
    Tier("realistic", 8 << 20, 16_384, 20),
    Tier("large", 64 << 20, 70_000, 20),
    Tier("xlarge", 512 << 20, 262_144, 30),
)
_BY_NAME = {t.name: t for t in TIERS}


def current() -> Tier:
    name = os.environ.get("KP_TIER", "small")
    if name not in _BY_NAME:
        raise ValueError(f"KP_TIER must be one of {tuple(_BY_NAME)}, got {name!r}")
    return _BY_NAME[name]


def register_profiles() -> None:
    # derandomize: the same examples every run (CI reproducibility); KP_HYPOTHESIS_RANDOM=1 explores.
    random = os.environ.get("KP_HYPOTHESIS_RANDOM") == "1"
    for tier in TIERS:
        settings.register_profile(
            tier.name,
            max_examples=tier.max_examples,
            derandomize=not random,
            deadline=None,  # a kernel's first call includes its compile time
            database=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
    settings.load_profile(current().name)
