"""Launch settings pinned by a benchmark sweep or a test, in one form for every kernel: name -> settings.

A launcher asks `settings(name, **defaults)` and gets its defaults with any pinned values laid over them.
`generation()` changes whenever a pin does, so launchers that cache per-shape launch decisions put it in
their cache key and never serve a stale decision. Names are kernel names (`"_norm_fwd"`), or a shared
decision such as `"row_config"` (the fused / looped threshold of row-wise kernels).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_PINNED: dict[str, dict] = {}
_generation = 0


def settings(name: str, **defaults) -> dict:
    """A kernel's launch settings: `defaults` with whatever kp_core.pin(name, ...) set laid over them.

    Examples:
        >>> import kp_core
        >>> kp_core.settings("my_kernel", BLOCK=128, num_warps=4)
        {'BLOCK': 128, 'num_warps': 4}
    """
    pinned = _PINNED.get(name)
    return defaults if pinned is None else {**defaults, **pinned}


def generation() -> int:
    return _generation


def pin(name: str, **values) -> None:
    """Pin launch settings for `name` until `unpin(name)` (benchmark sweeps).

    Examples:
        >>> import kp_core
        >>> kp_core.pin("my_kernel", BLOCK=64)
        >>> kp_core.settings("my_kernel", BLOCK=128, num_warps=4)
        {'BLOCK': 64, 'num_warps': 4}
        >>> kp_core.unpin("my_kernel")
    """
    global _generation
    _PINNED[name] = dict(values)
    _generation += 1


def unpin(name: str | None = None) -> None:
    """Drop the pins of `name`, or every pin.

    Examples:
        >>> import kp_core
        >>> kp_core.pin("my_kernel", BLOCK=64)
        >>> kp_core.unpin("my_kernel")
        >>> kp_core.settings("my_kernel", BLOCK=128)
        {'BLOCK': 128}
    """
    global _generation
    if name is None:
        _PINNED.clear()
    else:
        _PINNED.pop(name, None)
    _generation += 1


@contextlib.contextmanager
def pinned(name: str, **values) -> Iterator[None]:
    """`with kp_core.pinned("row_config", max_fused_cols=64): ...` (tests reaching a branch on small inputs).

    The pins `name` had before come back when the block ends.

    Examples:
        >>> import kp_core
        >>> with kp_core.pinned("row_config", max_fused_cols=64):
        ...     kp_core.row_config("my_op", 100, 4).looped
        True
        >>> kp_core.row_config("my_op", 100, 4).looped
        False
    """
    before = _PINNED.get(name)
    pin(name, **values)
    try:
        yield
    finally:
        if before is None:
            unpin(name)
        else:
            pin(name, **before)
