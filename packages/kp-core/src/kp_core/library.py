"""torch.library registration in one call, and the registry of every public kp kernel.

Ops are made with `torch.library.custom_op` + `register_fake` + `register_autograd`: that path passes
`opcheck` and `torch.compile(fullgraph=True)` both on GPU and on CPU under the Triton interpreter, where
`triton_op` + `wrap_triton` does not (see REFERENCES.md). The op is opaque to Inductor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelInfo:
    name: str  # "kp::rms_norm"
    package: str  # "kp-norms"
    spec: str  # conformance spec that covers it, e.g. "rms_norm"
    dtypes: tuple[torch.dtype, ...]
    op: object


_REGISTRY: dict[str, KernelInfo] = {}


def custom_op(
    name: str,
    *,
    package: str,
    spec: str,
    dtypes: Sequence[torch.dtype],
    fake: Callable,
    backward: Callable | None = None,
    setup_context: Callable | None = None,
    mutates_args: Sequence[str] = (),
) -> Callable[[Callable], object]:
    """Decorator: define `name` from a typed Python function, with its fake kernel and autograd formula."""

    def wrap(fn: Callable) -> object:
        op = torch.library.custom_op(name, mutates_args=tuple(mutates_args))(fn)
        op.register_fake(fake)
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
        _REGISTRY[name] = KernelInfo(name, package, spec, tuple(dtypes), op)
        return op

    return wrap


def registered_kernels() -> dict[str, KernelInfo]:
    return dict(_REGISTRY)
