"""pytest plugin: records each conformance cell (kernel x dtype x property) and writes the run's JSON.

A test opts in with `@pytest.mark.conformance(kernel=..., prop=...)`; its dtype comes from a `dtype`
parameter when it has one. Outcomes map to cells: passed -> pass, failed -> fail, skipped -> not covered
(with the skip's reason), a strict xfail (a known failure, kept as a test) -> fail. A skip is never a pass.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from kp_conformance import census, env, tiers

_STATUS = {"passed": "pass", "failed": "fail", "skipped": "not covered"}


_CELLS: dict[tuple[str, str, str], list[dict]] = {}


def pytest_configure(config):
    config.addinivalue_line("markers", "conformance(kernel, prop): a conformance matrix cell")


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
        text = str(report.longrepr).strip() if report.longrepr else ""
        # the assertion's own message (error, bound) rather than the traceback's last line
        asserted = [ln.lstrip("E ").strip() for ln in text.splitlines() if ln.startswith("E ") and "Error:" in ln]
        reason = (asserted[0] if asserted else text.splitlines()[-1] if text else "")[:300]
    cell = {
        "kernel": marker.kwargs["kernel"],
        "property": marker.kwargs["prop"],
        "dtype": dtype,
        "status": status,
        "reason": reason,
        "test": item.nodeid,
    }
    report.user_properties.append(("kp_cell", json.dumps(cell)))


def pytest_runtest_logreport(report):
    # Runs in the controller under xdist too, with the workers' user_properties.
    for key, value in getattr(report, "user_properties", ()):
        if key == "kp_cell":
            cell = json.loads(value)
            _CELLS.setdefault((cell["kernel"], cell["property"], cell["dtype"]), []).append(cell)


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


def _census_cells(session) -> list[dict]:
    """One cell per touched kernels module: every launchable kernel launched, every bool switch both ways. Runs
    that select part of a file (-k, -m, node ids) get none: their gaps say nothing about the tier."""
    if not _whole_files(session.config):
        return []
    gaps = census.gaps()
    cells = []
    for module in sorted({k.split(":")[0] for k in census.data()["seen"]}):
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
    cells = _CELLS
    if not cells:
        return
    default = (
        Path.cwd() / "conformance" / "reports" if (Path.cwd() / "conformance").is_dir() else Path.cwd() / "kp-reports"
    )
    out_dir = Path(os.environ.get("KP_REPORT_DIR", default))
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "arch": env.arch(),
        "device": env.device_name(),
        "tier": tiers.current().name,
        **env.versions(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cells": sorted(
            [*(_merge(v) for v in cells.values()), *_census_cells(session)],
            key=lambda c: (c["kernel"], c["property"], c["dtype"]),
        ),
    }
    path = out_dir / f"{report['arch']}-{report['tier']}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    session.config._kp_report_path = path


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for gap in getattr(config, "_kp_gaps", ()):
        terminalreporter.write_line(f"kp branch census: not reached: {gap}", red=True)
    path = getattr(config, "_kp_report_path", None)
    if path:
        terminalreporter.write_line(f"kp conformance report: {path}")
