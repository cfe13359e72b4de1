"""FlashAttention's own test suite against kp_attention.flash_attn (`nox -s fa-suite -- PATH`, a GPU).

A pytest plugin (`-p kp_conformance.fa_suite`): `flash_attn` resolves to kp's module through the shim package in
kp_conformance/fa_shim (put first on sys.path before the tests are collected); a fixed-seed sample of the
collected cases runs (--fa-sample N, default 400; 0 runs all; --fa-seed S); the summary counts passed, failed and
skipped cases per test function, and --fa-report PATH writes them as JSON. The test file is read from the
checkout the user points to, never copied into kp.

Left out, each with its reason in the summary: tests of FlashAttention's private C++ entry points (not its
public API, which is what kp_attention.flash_attn reproduces).

--fa-backend B pins kp_attention's backend (kp_attention.backend: "kp", the default, "torch:cudnn",
"torch:flash", "fa4" or "auto"): the same tests then check that implementation behind kp's module. A case the
backend cannot take (FlashAttention-4 has no dropout or ALiBi, ...) is skipped with the reason, not failed; the
summary and the report count the reasons. FlashAttention-4's own modules (`flash_attn.cute`) stay importable under
the shim, so that the "fa4" backend can run. torch's kernels return no lse: under a "torch:*" backend the shim's
functions answer `return_attn_probs=True` with (out, None, None), which the tests accept where they read neither
(the output tests without dropout; dropout itself torch refuses), and any test that reads lse fails visibly.
"""

from __future__ import annotations

import collections
import functools
import json
import random
import sys
from pathlib import Path

import pytest

SHIM = Path(__file__).resolve().parent / "fa_shim"
DEFAULT_SAMPLE = 400
PRIVATE = {"test_flash_attn_generator_arg_must_be_none": "calls flash_attn_gpu, FlashAttention's C++ extension"}


def pytest_addoption(parser):
    group = parser.getgroup("kp fa-suite")
    group.addoption("--fa-sample", type=int, default=DEFAULT_SAMPLE, help="cases to run (0: all)")
    group.addoption("--fa-seed", type=int, default=0, help="the sample's seed")
    group.addoption("--fa-report", default=None, help="write the per-function counts here (JSON)")
    group.addoption("--fa-backend", default="kp", help="kp_attention's backend the tests check (default kp)")


def pytest_configure(config):
    import kp_core
    from kp_attention import backend

    chosen = config.getoption("--fa-backend")
    backend.check("--fa-backend", chosen)
    kp_core.pin("attention_backend", backend=chosen)  # the implementation the suite checks (kp's by default)
    _import_fa4()  # before the shim: FlashAttention-4's flash_attn.cute keeps its own modules
    sys.path.insert(0, str(SHIM))
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        if not name.startswith("flash_attn.cute"):
            del sys.modules[name]  # an installed FlashAttention must not stand in for kp's
    if chosen.startswith("torch"):
        import flash_attn  # the shim

        for name in _lse_functions():
            setattr(flash_attn, name, _without_lse(getattr(flash_attn, name)))


def _lse_functions() -> tuple[str, ...]:
    """The shim's functions that take return_attn_probs: every public one but the KV-cache call."""
    from kp_attention import flash_attn

    return tuple(name for name in flash_attn.__all__ if name != "flash_attn_with_kvcache")


def _import_fa4() -> None:
    """FlashAttention-4 imported where it is installed and can run (kp_attention's fa4 backend imports it
    lazily, by a name the shim would otherwise take)."""
    import torch

    from kp_attention.ops import attention_fa4

    if torch.cuda.is_available():
        attention_fa4.unavailable(torch.device("cuda"))


def _without_lse(fn):
    """fn answering return_attn_probs=True with (out, None, None): torch's kernels make no lse or S_dmask."""

    @functools.wraps(fn)
    def call(*args, return_attn_probs=False, **kwargs):
        out = fn(*args, **kwargs)
        return (out, None, None) if return_attn_probs else out

    return call


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A case the pinned backend cannot take is not a failure of that backend: skipped, with its reason."""
    try:
        return (yield)
    except ValueError as e:
        if "cannot take this call" in str(e):
            pytest.skip(str(e)[:200])
        raise


def _function(item) -> str:
    return getattr(item, "originalname", None) or item.name.split("[")[0]


def pytest_collection_modifyitems(session, config, items):
    kept, dropped = [], []
    for item in items:
        (dropped if _function(item) in PRIVATE else kept).append(item)
    n = config.getoption("--fa-sample")
    if 0 < n < len(kept):
        chosen = set(random.Random(config.getoption("--fa-seed")).sample(range(len(kept)), n))
        dropped += [item for i, item in enumerate(kept) if i not in chosen]
        kept = [item for i, item in enumerate(kept) if i in chosen]
    config._kp_fa = {"collected": len(items), "private": sorted({_function(i) for i in items} & set(PRIVATE))}
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _skip_reason(report) -> str:
    """A skip's reason: why the backend cannot take the call, or the skip's own message (FlashAttention's tests
    skip cases of their own); read from the report, so it reaches the controller under xdist."""
    text = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    text = text.removeprefix("Skipped: ")
    return text.split("cannot take this call: ", 1)[-1][:120]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    reasons: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for outcome in ("passed", "failed", "skipped", "error"):
        for report in terminalreporter.stats.get(outcome, []):
            # a case's outcome: its call, or its setup where that skipped or failed it (there is no call then)
            when = getattr(report, "when", None)
            if hasattr(report, "nodeid") and (when == "call" or (when == "setup" and outcome != "passed")):
                name = report.nodeid.split("::")[-1].split("[")[0]
                counts[name][outcome] += 1
                if outcome == "skipped":
                    reasons[name][_skip_reason(report)] += 1
    info = getattr(config, "_kp_fa", {})
    tr = terminalreporter
    tr.section(f"FlashAttention's tests against kp_attention.flash_attn, backend {config.getoption('--fa-backend')}")
    tr.write_line(
        f"collected {info.get('collected', '?')}, sample of {config.getoption('--fa-sample')} "
        f"(seed {config.getoption('--fa-seed')})"
    )
    for name in info.get("private", []):
        tr.write_line(f"left out: {name} ({PRIVATE[name]})")
    tr.write_line(f"{'test function':48s} {'passed':>7s} {'failed':>7s} {'skipped':>8s} {'error':>6s}")
    for name in sorted(counts):
        c = counts[name]
        tr.write_line(f"{name:48s} {c['passed']:7d} {c['failed']:7d} {c['skipped']:8d} {c['error']:6d}")
    for name in sorted(reasons):
        for why, n in reasons[name].most_common(3):
            tr.write_line(f"skipped {name}: {n} x {why}")
    path = config.getoption("--fa-report")
    if path:
        out = {k: {**v, **({"skip reasons": dict(reasons[k])} if reasons.get(k) else {})} for k, v in counts.items()}
        out = dict(sorted(out.items()))
        Path(path).write_text(json.dumps(out, indent=1) + "\n")
