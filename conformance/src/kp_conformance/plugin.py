"""pytest plugin: records each conformance cell (kernel x dtype x property) and writes the run's JSON.

A test opts in with `@pytest.mark.conformance(kernel=..., prop=...)`; its dtype comes from a `dtype`
parameter when it has one. Outcomes map to cells: passed -> pass, failed -> fail, skipped -> not covered
(with the skip's reason), a strict xfail (a known failure, kept as a test) -> fail. A skip is never a pass.

A tier too long for one sitting runs in parts over whole spec files: KP_REPORT_RESUME=1 makes a run add to the
report an earlier part left (same architecture, device, tier, torch and triton, else it refuses), a rerun test
replacing its earlier cells; KP_CENSUS=defer leaves the branch census to a later part, which checks it over every
part's launches.

Each test's time (setup + call + teardown, seconds) goes into the report (`durations`, slowest first) so a tier's
long tail is visible; KP_PROGRESS=FILE also appends a line per test as it starts and ends, which survives a run
that is killed at a time limit (the tests started but never ended are the tail), and a line as the session starts
and ends (the time before the first test and after the last is the workers' start-up, collection and shutdown).
KP_COMPILES=FILE logs every Triton compile with its test, and whether it missed the disk cache (`compiles`).

A run starts its tests longest first, by the durations the existing report for its architecture and tier recorded
(tests it has no time for first of all). With `--dist load --maxschedchunk 1` each xdist worker then takes the
next-longest test as it frees up, so the long cells do not start last and hold the run's end.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from kp_conformance import census, compiles, env, tiers

_STATUS = {"passed": "pass", "failed": "fail", "skipped": "not covered"}


_TESTS: list[dict] = []  # one cell per test, as the tests report them


_DURATIONS: dict[str, float] = {}  # nodeid -> seconds, as the (controller's) reports arrive
_OUTCOMES: dict[str, str] = {}  # nodeid -> failed / skipped until its teardown report (for KP_PROGRESS)

_EARLIER: dict = {}  # the report a resumed run adds to: its test cells, whether it ran whole files


def pytest_configure(config):
    config.addinivalue_line("markers", "conformance(kernel, prop): a conformance matrix cell")
    if os.environ.get("KP_REPORT_RESUME") == "1" and not hasattr(config, "workerinput"):
        _resume()
    _share_cores()
    compiles.install()  # KP_COMPILES=FILE


def pytest_collection_modifyitems(session, config, items):
    path = _report_path(_identity())
    if path.exists():
        items[:] = _longest_first(items, json.loads(path.read_text()).get("durations", {}))


def _longest_first(items: list, durations: dict[str, float]) -> list:
    """`items` by their recorded seconds, slowest first; those without a record ahead of all (they may be long),
    in their collected order. Every xdist worker sorts the same collection the same way, as xdist requires."""
    return sorted(items, key=lambda item: -durations.get(item.nodeid, float("inf")))


def _share_cores() -> None:
    """Under xdist each worker's torch starts a thread per core (16 workers on 16 cores: 256 threads for the
    float64 references and the inputs), and each worker's Inductor a pool of compile processes per core (a
    sidecar that imports torch, plus 16 forks: 272 processes, mostly idle, competing with the cold Triton
    compiles). Each worker gets its share of the cores for both unless OMP_NUM_THREADS or
    TORCHINDUCTOR_COMPILE_THREADS is set; a share of one compiles in the worker itself."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers <= 1:
        return
    share = max(1, (os.cpu_count() or 1) // workers)
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(share)
    if "TORCHINDUCTOR_COMPILE_THREADS" not in os.environ:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(share)  # read when Inductor's config is imported
        inductor = sys.modules.get("torch._inductor.config")
        if inductor is not None:  # already imported: its value was decided
            inductor.compile_threads = share


def _identity() -> dict:
    return {"arch": env.arch(), "device": env.device_name(), "tier": tiers.current().name, **env.versions()}


def _report_path(identity: dict) -> Path:
    cwd = Path.cwd()
    default = cwd / "conformance" / "reports" if (cwd / "conformance").is_dir() else cwd / "kp-reports"
    return Path(os.environ.get("KP_REPORT_DIR", default)) / f"{identity['arch']}-{identity['tier']}.json"


def _resume() -> None:
    identity = _identity()
    path = _report_path(identity)
    if not path.exists():
        return  # the first part
    earlier = json.loads(path.read_text())
    theirs = {k: earlier.get(k) for k in identity}
    if theirs != identity or "tests" not in earlier:
        raise pytest.UsageError(
            f"KP_REPORT_RESUME=1: {path} is not an earlier part of this run (it has {theirs}, "
            f"{'with' if 'tests' in earlier else 'without'} its test cells; this run is {identity})"
        )
    census.merge(earlier["census"])
    _EARLIER.update(tests=earlier["tests"], whole_files=earlier["whole_files"], durations=earlier.get("durations", {}))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("conformance")
    if marker is None or (report.when != "call" and not (report.when == "setup" and report.outcome != "passed")):
        return
    params = getattr(getattr(item, "callspec", None), "params", {})
    dtype = str(params.get("dtype", "-")).replace("torch.", "")
    reason = ""
    status = _STATUS[report.outcome]
    if hasattr(report, "wasxfail"):  # a known failure (strict xfail): a fail in the matrix, not a skip
        status, reason = "fail", f"known failure: {report.wasxfail}"
    elif report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.outcome == "failed":
        reason = _failure(report)
    kernel = marker.kwargs["kernel"]
    backend = params.get("attention_backend", "kp")  # specs/conftest.py: one cell per attention backend
    cell = {
        "kernel": kernel if backend == "kp" else f"{kernel} [{backend}]",
        "property": marker.kwargs["prop"],
        "dtype": dtype,
        "status": status,
        "reason": reason,
        "test": item.nodeid,
    }
    report.user_properties.append(("kp_cell", json.dumps(cell)))


def _failure(report) -> str:
    """A failed report's reason: the assertion's own message (error, bound) rather than the traceback's last line."""
    text = str(report.longrepr).strip() if report.longrepr else ""
    lines = text.splitlines()
    asserted = [ln.lstrip("E ").strip() for ln in lines if ln.startswith("E ") and "Error:" in ln]
    reason = (asserted[0] if asserted else lines[-1] if lines else "")[:300]
    # Hypothesis' falsifying example (the drawn case), which the matrix's reason otherwise leaves out: "Falsifying
    # example:" in its report, "Failing test case:" in the note it adds to the assertion (a case's dict spans lines)
    marks = ("Falsifying example", "Failing test case")
    example = next((i for i, ln in enumerate(lines) if any(m in ln for m in marks)), None)
    if example is not None:
        shown = " ".join(ln.lstrip("E ").strip() for ln in lines[example : example + 24])
        reason += " | " + shown[: shown.find(")", shown.find("}")) + 1 or 1200][:1200]
    return reason


def _progress(*fields) -> None:
    path = os.environ.get("KP_PROGRESS")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller alone writes it
        with open(path, "a") as f:  # opened per line: a killed run keeps every line written
            f.write("\t".join([f"{time.time():.2f}", *map(str, fields)]) + "\n")


def pytest_sessionstart(session):
    _progress("session", "start")  # to the first test's start: the workers' start-up and collection


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    census.testing(item.module)  # before its fixtures, which launch kernels too


def pytest_runtest_logstart(nodeid, location):
    compiles.running(nodeid)
    _progress("start", nodeid)


def pytest_runtest_logreport(report):
    # Runs in the controller under xdist too, with the workers' user_properties.
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    if report.failed or (report.skipped and report.when != "teardown"):
        _OUTCOMES[report.nodeid] = report.outcome
    if report.failed:  # the reason at once: a run killed at its time limit prints no summary
        _progress("failed", report.nodeid, _failure(report).replace("\n", " "))
    if report.when == "teardown":
        outcome = _OUTCOMES.pop(report.nodeid, "passed")
        _progress("end", f"{_DURATIONS[report.nodeid]:.2f}", outcome, report.nodeid)
    for key, value in getattr(report, "user_properties", ()):
        if key == "kp_cell":
            _TESTS.append(json.loads(value))


def _merge(cells: list[dict]) -> dict:
    """One cell from several tests: any fail fails; else any pass passes; else not covered."""
    statuses = {c["status"] for c in cells}
    status = "fail" if "fail" in statuses else "pass" if "pass" in statuses else "not covered"
    reasons = sorted({c["reason"] for c in cells if c["status"] == status and c["reason"]})
    return {**cells[0], "status": status, "reason": "; ".join(reasons), "tests": len(cells)}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist controller: a worker's branch census."""
    sent = getattr(node, "workeroutput", {}).get("kp_census")
    if sent:
        census.merge(json.loads(sent))


def _whole_files(config) -> bool:
    """The run selected whole spec files or directories (no -k, -m or node ids): the census is enforced."""
    args = config.invocation_params.args
    return not config.option.keyword and not config.option.markexpr and not any("::" in str(a) for a in args)


def _census_cells(session, whole: bool) -> list[dict]:
    """One cell per touched kernels module: every launchable kernel launched, every bool switch both ways. Runs
    that select part of a file (-k, -m, node ids) get none: their gaps say nothing about the tier."""
    if not whole or os.environ.get("KP_CENSUS") == "defer":
        return []
    gaps = census.gaps()
    cells = []
    for module in census.touched():
        missing = [g for g in gaps if g.startswith(f"{module}:")]
        status = "fail" if missing else "pass"
        cells.append(
            {
                "kernel": module.split(".")[-1],
                "property": "every_branch",
                "dtype": "-",
                "status": status,
                "reason": "; ".join(missing),
                "test": "census",
                "tests": 1,
            }
        )
    if gaps:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        session.config._kp_gaps = gaps
    return cells


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes the report
        session.config.workeroutput["kp_census"] = json.dumps(census.data())
        return
    tests = list(_TESTS)
    if not tests:
        return
    ran = {c["test"] for c in tests}
    tests += [c for c in _EARLIER.get("tests", ()) if c["test"] not in ran]
    whole = _whole_files(session.config) and _EARLIER.get("whole_files", True)
    by_cell: dict[tuple[str, str, str], list[dict]] = {}
    for c in tests:
        by_cell.setdefault((c["kernel"], c["property"], c["dtype"]), []).append(c)
    identity = _identity()
    report = {
        **identity,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cells": sorted(
            [*(_merge(v) for v in by_cell.values()), *_census_cells(session, whole)],
            key=lambda c: (c["kernel"], c["property"], c["dtype"]),
        ),
        # what a later part (KP_REPORT_RESUME=1) needs to add to this report
        "whole_files": whole,
        "census": census.data(),
        "tests": sorted(tests, key=lambda c: c["test"]),
        "durations": dict(
            sorted(
                {**_EARLIER.get("durations", {}), **{k: round(v, 2) for k, v in _DURATIONS.items()}}.items(),
                key=lambda kv: -kv[1],
            )
        ),
    }
    path = _report_path(identity)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    session.config._kp_report_path = path
    _progress("session", "end")  # from the last test's end: the workers' shutdown and this report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for gap in getattr(config, "_kp_gaps", ()):
        terminalreporter.write_line(f"kp branch census: not reached: {gap}", red=True)
    path = getattr(config, "_kp_report_path", None)
    if path:
        terminalreporter.write_line(f"kp conformance report: {path}")
    if compiles.path() and not hasattr(config, "workerinput"):
        for line in compiles.summary(compiles.path()):
            terminalreporter.write_line(line)
