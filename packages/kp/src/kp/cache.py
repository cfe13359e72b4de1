"""kp.optimize's measured times on disk, per (machine and versions, mode, layer signature, candidates), so that a
second run on the same model skips the timing. Verdicts are not reused: on a hit the candidate about to be chosen
is checked again against float64, since the weights may have changed (kp.decisions)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def path() -> Path:
    """$KP_CACHE_DIR/optimize.json, else ~/.cache/kp/optimize.json ($XDG_CACHE_HOME respected).

    Exported as kp.cache_path. Delete the file to make kp.optimize time every layer again.

    Examples:
        >>> import kp
        >>> kp.cache_path().name
        'optimize.json'
    """
    root = os.environ.get("KP_CACHE_DIR")
    if root is None:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kp"
    return Path(root) / "optimize.json"


def key(environment: dict, mode: str, signature: str, candidates: list[str]) -> str:
    text = json.dumps([environment, mode, signature, candidates], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load() -> dict:
    try:
        data = json.loads(path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def store(entries: dict) -> None:
    """Merge `entries` into the file (written whole, through a temporary file: a reader never sees half)."""
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    data = {**load(), **entries}
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    tmp.replace(target)
