"""Bad-input fuzzer: calls built from a table of every public callable's arguments, one argument spoiled a call.

A `Target` is one public function or module call: a small valid call (keyword arguments on the device under test)
and, per argument, its domain (`Tensor` or `Scalar`). From the domains the fuzzer derives the mutations, each
with the outcome it must have:

- not_tensor, dtype, device, rank, size, index (out-of-range values of an index tensor), a refused scalar: a
  TypeError or ValueError whose message names the argument (or one of the words its domain lists);
- strided (the same values through a non-contiguous view): the contiguous call's result exactly, or a refusal
  naming the argument;
- nonfinite (NaN or +-inf at one element) and huge (values near the dtype's largest): what torch's own function
  gives on the same call (the same NaN and inf positions, the finite values close);
- zero_size (the target's empty call): torch's result shape, or a refusal;
- alias (one tensor passed as two arguments): the result of the call given a copy, or a refusal naming one.

Whatever the outcome: no other exception (a Triton, CUDA or index error fails), every input bitwise unchanged, and
the spec guard (kp_conformance.guard) sees no launch touch memory outside its tensors. Accepted calls must have
launched a kernel when the target declares ops, so a call that quietly took the reference path fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st

import kp_core
from kp_conformance.launched import kernel_backend

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
ALL_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
)


@dataclass(frozen=True)
class Tensor:
    dtypes: tuple[torch.dtype, ...] = FLOATS  # accepted; any other dtype must be refused
    sized: tuple[int, ...] = ()  # dims whose size the rest of the call pins (one more there is refused)
    ranked: bool = True  # its number of dims is pinned (one more or one less is refused)
    words: tuple[str, ...] = ()  # other words a refusal may use for it (normalized_shape for an input's last dim)
    index: Callable[[torch.Tensor], torch.Tensor] | None = None  # an out-of-range version of an index tensor
    values: bool = True  # float data: NaN/inf and huge values are compared with torch's function
    first: bool = False  # the call's first tensor: the others are checked against its device


@dataclass(frozen=True)
class Scalar:
    bad: tuple[object, ...]  # values that must be refused


@dataclass(frozen=True)
class Target:
    name: str  # what users call: kp_norms.rms_norm, kp_norms.RMSNorm(...)
    package: str
    fn: Callable
    valid: Callable[[torch.device], dict]
    args: dict[str, Tensor | Scalar]
    torch_fn: Callable | None = None  # torch's own function with the same keyword arguments
    zero: Callable[[torch.device], dict] | None = None  # an empty call
    aliases: tuple[tuple[str, str], ...] = ()  # (a, b): a's tensor passed as b too
    launches: bool = True  # an accepted call launches a kernel
    results: Callable = field(default=lambda r: r)  # the tensors of a result (a Float8Tensor -> data, scale)
    mutates: tuple[str, ...] = ()  # arguments the API writes in place (a KV cache's new tokens)
    # where out-of-range index values are reported after the call (the kernel stays in bounds and sets a flag):
    # called after an accepted `index` case, it must raise the ValueError naming the argument
    report: Callable[[torch.device], None] | None = None


def cases(target: Target) -> list[tuple[str, str]]:
    """(argument, mutation) pairs the target's domains allow."""
    out = []
    for name, dom in target.args.items():
        if isinstance(dom, Scalar):
            out.append((name, "scalar"))
            continue
        out += [(name, "not_tensor"), (name, "dtype"), (name, "strided")]
        out += [(name, "device")] if not dom.first else []
        out += [(name, "rank")] if dom.ranked else []
        out += [(name, "size")] if dom.sized else []
        out += [(name, "index")] if dom.index else []
        if dom.values and target.torch_fn is not None and any(d.is_floating_point for d in dom.dtypes):
            out += [(name, "nonfinite"), (name, "huge")]
    out += [("-", "zero_size")] if target.zero else []
    out += [(f"{a}={b}", "alias") for a, b in target.aliases]
    return out


def _other_device(device: torch.device) -> torch.device:
    return torch.device("cpu" if device.type == "cuda" else "meta")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values through a view whose last dim has stride 2 (or a 0-dim tensor's expand)."""
    if t.dim() == 0:
        return t.reshape(1).expand(1).squeeze(0)
    wide = torch.empty((*t.shape, 2), dtype=t.dtype, device=t.device)
    wide[..., 0] = t
    return wide[..., 0]


def _grown(t: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.cat([t, t.narrow(dim, 0, 1)], dim)


def _bytes(t: torch.Tensor) -> torch.Tensor | None:
    if t.device.type == "meta":
        return None
    return t.detach().reshape(-1).clone().view(torch.uint8) if t.numel() else t.detach().clone()


class Refused(AssertionError):
    pass


def _tensors(kwargs: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}


def call(target: Target, kwargs: dict):
    """The target on `kwargs`: its result, or the TypeError/ValueError it raised (returned, not raised). Any
    other exception propagates (a failure); an input changed by the call fails."""
    snapshot = {k: (t, _bytes(t)) for k, t in _tensors(kwargs).items() if k not in target.mutates}
    try:
        result = target.fn(**kwargs)
    except (TypeError, ValueError) as e:
        result = e
    for k, (t, b) in snapshot.items():
        if b is not None and not torch.equal(_bytes(t), b):
            raise AssertionError(f"{target.name}: the call changed its input {k!r}")
    return result


def _torch_raises(target: Target, kwargs: dict, error: BaseException) -> bool:
    """Whether torch's own function raises the same exception type on the call (doing what torch does)."""
    if target.torch_fn is None:
        return False
    try:
        target.torch_fn(**kwargs)
    except Exception as e:
        return type(e) is type(error)
    return False


def expect_refusal(target: Target, kwargs: dict, names: tuple[str, ...], what: str) -> None:
    try:
        result = call(target, kwargs)
    except Exception as e:
        if isinstance(e, AssertionError) or not _torch_raises(target, kwargs, e):
            raise
        return  # torch's own layers inside the target raised, as they do under torch
    if not isinstance(result, Exception):
        raise AssertionError(f"{target.name} accepted {what}; expected a TypeError/ValueError naming {names[0]!r}")
    message = str(result)
    if not any(n in message for n in names):
        raise AssertionError(f"{target.name}: {what} raised {type(result).__name__}({message!r}), not naming {names}")


def _flat(result, target: Target) -> list[torch.Tensor]:
    result = target.results(result)
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def _close(name: str, ours: list[torch.Tensor], theirs: list[torch.Tensor], exact: bool) -> None:
    assert len(ours) == len(theirs), f"{name}: {len(ours)} results, expected {len(theirs)}"
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, f"{name}: result {i} has shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        if a.device.type == "meta":
            continue
        # an answer computed wider (float64) is compared as the result's dtype can hold it (overflow included)
        a, b = a.detach().float(), b.detach().to(a.dtype).float()
        for test in (torch.isnan, torch.isposinf, torch.isneginf):
            where = test(a) != test(b)
            assert not where.any(), (
                f"{name}: result {i}: {test.__name__} differs at {where.nonzero()[0].tolist()} "
                f"(ours {a[where][0].item()}, expected {b[where][0].item()})"
            )
        finite = torch.isfinite(b)
        if exact:
            assert torch.equal(a[finite], b[finite]), f"{name}: result {i} differs from the contiguous call's"
        else:
            scale = b[finite].abs().max().item() if finite.any() else 0.0
            torch.testing.assert_close(
                a[finite], b[finite], rtol=2e-2, atol=2e-2 * scale + 1e-6, msg=lambda m: f"{name}: {m}"
            )


def _accepted(target: Target, kwargs: dict, expected, what: str, exact: bool, also=None, launch=True) -> None:
    """The call either refuses naming an argument or gives `expected` (a callable made lazily), or `also`'s
    result when given (the float64 answer, where torch in low precision overflows)."""
    with kp_core.record_launches() as record:
        result = call(target, kwargs)
    if isinstance(result, Exception):
        if not any(n in str(result) for n in kwargs):
            raise AssertionError(f"{target.name}: {what} raised {result!r}, naming none of its arguments")
        return
    if target.launches and launch:
        ran = {launch.backend for launch in record.launches}
        assert kernel_backend() in ran, f"{target.name}: {what} launched no kernel (backends: {ran or 'none'})"
    ours = _flat(result, target)
    try:
        _close(f"{target.name} ({what})", ours, _flat(expected(), target), exact)
    except AssertionError:
        if also is None:
            raise
        _close(f"{target.name} ({what}, against float64)", ours, _flat(also(), target), exact)


def _valid(target: Target, device: torch.device) -> dict:
    torch.manual_seed(0)  # the same values each time: a call is compared with a rebuilt one
    return target.valid(device)


def check(target: Target, arg: str, kind: str, data: st.DataObject, device: torch.device) -> None:
    """One fuzz case: spoil `arg` of the target's valid call by `kind` (parameters drawn from `data`)."""
    kwargs = _valid(target, device)
    if kind == "zero_size":
        empty = target.zero(device)
        if target.torch_fn is None:
            call(target, empty)  # refused or not: no other exception, no input changed
            return
        expected = lambda: target.torch_fn(**empty)  # noqa: E731
        return _accepted(target, empty, expected, "an empty call", exact=False, launch=False)
    if kind == "alias":
        a, b = arg.split("=")
        fresh = _valid(target, device)  # the call with a copy, on its own inputs (the target may write in place)
        copy = dict(fresh, **{b: fresh[a].clone()})
        kwargs[b] = kwargs[a]
        return _accepted(target, kwargs, lambda: target.fn(**copy), f"{a} passed as {b}", exact=True)
    dom = target.args[arg]
    names = (arg, *getattr(dom, "words", ()))
    if kind == "scalar":
        for bad in dom.bad:
            expect_refusal(target, dict(kwargs, **{arg: bad}), names, f"{arg}={bad!r}")
        return
    t = kwargs[arg]
    if kind == "not_tensor":
        bad = t.tolist() if t.numel() < 64 else float(t.reshape(-1)[0])
        return expect_refusal(target, dict(kwargs, **{arg: bad}), names, f"{arg} as a {type(bad).__name__}")
    if kind == "dtype":
        dtype = data.draw(st.sampled_from([d for d in ALL_DTYPES if d not in dom.dtypes]), label="dtype")
        bad = torch.zeros(t.shape, dtype=dtype, device=t.device) if dtype.is_complex else t.to(dtype)
        return expect_refusal(target, dict(kwargs, **{arg: bad}), names, f"{arg} as {dtype}")
    if kind == "device":
        bad = t.to(_other_device(device))
        return expect_refusal(target, dict(kwargs, **{arg: bad}), names, f"{arg} on {bad.device}")
    if kind == "rank":
        more = data.draw(st.booleans(), label="one more dim") or t.dim() == 0
        bad = t.unsqueeze(0) if more else t[0]
        return expect_refusal(target, dict(kwargs, **{arg: bad}), names, f"{arg} of shape {tuple(bad.shape)}")
    if kind == "size":
        dim = data.draw(st.sampled_from(dom.sized), label="dim")
        bad = _grown(t, dim)
        return expect_refusal(target, dict(kwargs, **{arg: bad}), names, f"{arg} of shape {tuple(bad.shape)}")
    if kind == "index":
        bad = dict(kwargs, **{arg: dom.index(t)})
        if target.report is None or isinstance(call(target, bad), Exception):
            return expect_refusal(target, bad, names, f"{arg} out of range")
        try:
            target.report(device)
        except ValueError as e:
            assert any(n in str(e) for n in names), f"{target.name}: the report {e!r} does not name {names}"
            return
        raise AssertionError(f"{target.name} took {arg} out of range and its report raised nothing")
    if kind == "strided":
        bad = dict(kwargs, **{arg: _strided(t)})
        return _accepted(target, bad, lambda: target.fn(**kwargs), f"a strided {arg}", exact=True)
    if kind in ("nonfinite", "huge"):
        spoiled = t.clone(memory_format=torch.contiguous_format)
        flat = spoiled.view(-1)
        if kind == "nonfinite":
            at = data.draw(st.integers(0, flat.numel() - 1), label="at")
            flat[at] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]), label="value")
        else:
            big = torch.finfo(t.dtype).max / 4
            spoiled.copy_(torch.where(spoiled >= 0, big, -big) * data.draw(st.sampled_from([1.0, 0.5]), label="x"))
        bad = dict(kwargs, **{arg: spoiled})
        wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in bad.items()}
        return _accepted(
            target,
            bad,
            lambda: target.torch_fn(**bad),
            f"{kind} values in {arg}",
            exact=False,
            also=lambda: target.torch_fn(**wide),
        )
    raise ValueError(f"unknown mutation {kind!r}")
