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
    if not random:
        _ignore_local_constants()
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


def _ignore_local_constants() -> None:
    """Hypothesis (6.131 on) mixes literals from the non-installed modules in sys.modules into its draws (1 draw in
    20 picks a constant), so a derandomized test drew other examples depending on what ran before it in its worker:
    a conftest, a spec file's helpers, torch.compile's generated code, a plugin on PYTHONPATH. The tier's examples
    then moved between runs and orders (a norm cell took 18 s in one CI run and 85 s in the next). Draws are made
    from Hypothesis' own constants only, so a test's examples depend on the test alone. Hypothesis exposes no
    switch for this; the hook is internal, so it is set only where it exists."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover  (an older Hypothesis: no local constants)
        return
    if hasattr(providers, "_get_local_constants") and hasattr(providers, "Constants"):
        providers._get_local_constants = providers.Constants
