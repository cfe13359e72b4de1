"""Regression check: a benchmark run against the committed results for the same device.

    python benchmarks/compare.py --run DIR [--baseline benchmarks/results] [--device SLUG] [--threshold-file F]
    python benchmarks/compare.py --derive RUN_DIR RUN_DIR [RUN_DIR ...] [--device SLUG]

DIR holds a run as the benchmarks write it (KP_RESULTS_DIR=DIR: DIR/<device>/<kernel>.json). For every kernel
JSON in both the run and the baseline, each kp provider's time in a cell is divided by an anchor's time in the
same cell of the same run, so that what moves every provider alike (clocks, a busier host, another machine of
the same kind) cancels; the check is on that ratio, new against old. Exit status 1 on a regression, 0 otherwise.
docs/benchmarks.md ("Regression check") describes the rules and how the thresholds are derived.

--derive compares repeated honest runs of the same code with each other and writes the thresholds they imply
into --threshold-file (benchmarks/results/thresholds.json), keeping the entries of kernels those runs lack.
Only the standard library is used: the check runs anywhere the results are (CI's CPU jobs test it).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
THRESHOLDS = RESULTS / "thresholds.json"

# How thresholds follow from the spread of repeated runs (see derive()).
MULTIPLIER = 3.0
KERNEL_FLOOR = 0.03
CELL_FLOOR = 0.10

# A row names its provider under one of these keys (the end-to-end benchmarks say "variant").
PROVIDER_KEYS = ("provider", "variant")
# Fields that describe a result or the provider, not the case measured: never part of a cell's identity (a run
# whose router picked another backend is the same cell, and its time is what is checked; bench_distributed's
# "flags" are each provider's command line; bench_attention's "chose" is what kp's backend="auto" picked).
NOT_IDENTITY = {
    "failed",
    "measured",
    "report",
    "router",
    "backend",
    "alg_id",
    "captures",
    "chosen",
    "chose",
    "step",
    "flags",
}
# Unit-less time columns (ms): bench_sparsity_model's "eager" and "graph".
UNITLESS_TIMES = {"eager", "graph"}
# One-off costs (capture, compile), not the steady-state speed the check is about.
SETUP_PREFIXES = ("first_pass",)
# Rows without a provider that hold a kp figure and its anchor side by side: kernel -> (kp field, anchor field).
# sparsity: F.linear with kp's 2:4 weight (torch's default cuSPARSELt algorithm, and the one kp's router picks)
# against the dense F.linear timed beside it. Its fp8 columns are torch alone (kp only prunes): not checked.
PAIRS = {"sparsity": (("sparse_ms", "dense_ms"), ("tuned_ms", "dense_ms"))}
TIMINGS = ("graph", "eager")
# Software and device fields of a results file's metadata (harness.versions()).
VERSION_KEYS = ("device", "torch", "triton", "liger_kernel")


def is_kp(provider: str) -> bool:
    """kp's own providers, as the harness's tables tell them from the anchors."""
    return "kp" in provider


def metric_kind(name: str) -> str | None:
    """'time' (ms, us: lower is better), 'rate' (GB/s, TFLOP/s, tokens/s: higher is better) or None."""
    if name.startswith(SETUP_PREFIXES):
        return None
    parts = set(name.lower().split("_"))
    if name in UNITLESS_TIMES or parts & {"ms", "us"}:
        return "time"
    if parts & {"gbps", "tflops"} or name.endswith("tokens_per_s"):
        return "rate"
    return None


def _provider(row: dict) -> str | None:
    return next((row[k] for k in PROVIDER_KEYS if isinstance(row.get(k), str)), None)


def _anchors(rows: list) -> set:
    return {p for r in rows if isinstance(r, dict) and "failed" not in r for p in [_provider(r)] if p and not is_kp(p)}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _identity(row: dict) -> tuple:
    """A row's cell: its fields that are neither metrics, provider nor results (shape, mode, group, ...)."""
    return tuple(
        sorted(
            (k, v)
            for k, v in row.items()
            if k not in PROVIDER_KEYS
            and k not in NOT_IDENTITY
            and not k.endswith("_failed")  # bench_sparsity's fp8_failed: one column failed, the others stand
            and metric_kind(k) is None
            and isinstance(v, (str, int, bool))
        )
    )


def measurements(kernel: str, rows: list) -> dict:
    """{(metric, cell): {provider: time}} for a results file's rows. A rate enters as its inverse, so every value
    is lower-is-better. A kernel's metrics are its time fields; only a kernel that has none (gbps_graph alone, say)
    is checked on its rates: a GB/s figure beside its ms is the same measurement. Graph and eager timings are
    separate metrics. Failed rows are skipped."""
    rows = [r for r in rows if isinstance(r, dict) and "failed" not in r]
    named = [(_provider(r), r) for r in rows if _provider(r) is not None]
    has_time = any(metric_kind(k) == "time" and _number(v) for _, r in named for k, v in r.items())
    use = "time" if has_time else "rate"
    out: dict = {}
    for provider, row in named:
        cell = _identity(row)
        for k, v in row.items():
            if metric_kind(k) == use and _number(v):
                values = out.setdefault((k, cell), {})
                t = v if use == "time" else 1.0 / v
                values[provider] = min(t, values.get(provider, math.inf))  # a repeated case: its best
    for kp_field, anchor_field in PAIRS.get(kernel, ()):
        for row in rows:
            kp, anchor = row.get(kp_field), row.get(anchor_field)
            if not any(k in row for k in PROVIDER_KEYS) and _number(kp) and _number(anchor):
                out[(kp_field, _identity(row))] = {"kp": kp, anchor_field: anchor}
    return out


@dataclass
class Unit:
    """One kp provider in one cell under one metric: its time over the anchor's, in the baseline and in the run."""

    metric: str
    cell: tuple
    provider: str
    anchor: str
    base: float
    run: float

    @property
    def log_change(self) -> float:
        """log(new ratio / old ratio): > 0 when kp lost ground against the anchor."""
        return math.log(self.run / self.base)

    def where(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.cell) + f" | {self.provider} vs {self.anchor}"


@dataclass
class KernelComparison:
    units: list = field(default_factory=list)
    missing: list = field(default_factory=list)  # (side it is missing from, metric, cell, provider)
    no_anchor: list = field(default_factory=list)  # (metric, cell, provider)


def compare_kernel(kernel: str, base_rows: list, run_rows: list) -> KernelComparison:
    """Each kp provider against the best anchor of the cell, the anchor fixed by name: the fastest in the
    baseline among those present in both, used in both runs."""
    base, run = measurements(kernel, base_rows), measurements(kernel, run_rows)
    out = KernelComparison()
    for key in sorted(set(base) | set(run), key=repr):
        metric, cell = key
        b, r = base.get(key, {}), run.get(key, {})
        for p in sorted({p for p in (*b, *r) if is_kp(p)}):
            if p not in r:
                out.missing.append(("run", metric, cell, p))
            elif p not in b:
                out.missing.append(("baseline", metric, cell, p))
        anchors = sorted(p for p in b if not is_kp(p) and p in r)
        kps = sorted(p for p in b if is_kp(p) and p in r)
        if not anchors:
            out.no_anchor += [(metric, cell, p) for p in kps]
            continue
        anchor = min(anchors, key=lambda p: b[p])
        out.units += [Unit(metric, cell, p, anchor, b[p] / b[anchor], r[p] / r[anchor]) for p in kps]
    return out


def geomean_log(units: list) -> float:
    """A kernel's change: the mean log change of its cells (a geometric mean), the len // 10 largest and smallest
    left out. Plain-launch timings of short ops swing by 15-100 % in single cells between honest runs (a busy
    host); trimmed, one such cell does not move the kernel's figure, while a change to every cell moves it fully."""
    logs = sorted(u.log_change for u in units)
    cut = len(logs) // 10
    kept = logs[cut : len(logs) - cut]
    return sum(kept) / len(kept)


def by_metric(units: list) -> dict:
    out: dict = {}
    for u in units:
        out.setdefault(u.metric, []).append(u)
    return out


# ---- loading ----


def load_results(root: Path, device: str) -> dict:
    """{kernel: parsed JSON} for root/device/*.json that hold a list of rows (others, e.g. cpu_overhead.json, have
    no cells to compare)."""
    out = {}
    for path in sorted((Path(root) / device).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"warning: {path}: unreadable ({e}); skipped")
            continue
        if isinstance(doc, dict) and isinstance(doc.get("rows"), list):
            out[path.stem] = doc
    return out


def devices(root: Path) -> list[str]:
    """The device folders under root that hold results."""
    if not Path(root).is_dir():
        return []
    return sorted(p.name for p in Path(root).iterdir() if p.is_dir() and any(p.glob("*.json")))


def load_thresholds(path: Path) -> dict:
    if path is None or not Path(path).is_file():
        return {}
    return json.loads(Path(path).read_text())


def timing_of(metric: str) -> str:
    """The harness's two timing methods (ms_graph, gbps_eager, ...) share their noise across kernels; the rest
    (ms, us_per_call, tokens_per_s, a pair's field) are measured in each benchmark's own way."""
    last = metric.rsplit("_", 1)[-1]
    return last if last in TIMINGS else "other"


def threshold_for(thresholds: dict, kernel: str, metric: str) -> tuple[dict, str]:
    """The kernel's own limits for the metric where derived, else the file's default for the metric's timing
    method, else the built-in floors."""
    entry = thresholds.get("kernels", {}).get(kernel, {}).get("metrics", {}).get(metric)
    if entry:
        return entry, "derived"
    default = thresholds.get("default", {}).get(timing_of(metric))
    if default:
        return default, "default"
    return {"kernel": KERNEL_FLOOR, "cell": CELL_FLOOR}, "built-in"


# ---- the check ----


def _beyond(log_change: float, limit: float) -> bool:
    """A change beyond the limit (a fraction); one equal to it up to rounding is not."""
    return log_change > math.log1p(limit) + 1e-9


@dataclass
class Row:
    kernel: str
    metric: str
    units: list
    limits: dict
    source: str

    @property
    def geomean(self) -> float:
        return math.exp(geomean_log(self.units))

    @property
    def worst(self) -> Unit:
        return max(self.units, key=lambda u: u.log_change)

    @property
    def cells_over(self) -> list:
        return [u for u in self.units if _beyond(u.log_change, self.limits["cell"])]

    @property
    def verdict(self) -> str:
        if _beyond(geomean_log(self.units), self.limits["kernel"]) or self.cells_over:
            return "REGRESSION"
        if _beyond(-geomean_log(self.units), self.limits["kernel"]):
            return "faster"
        return "ok"


@dataclass
class Report:
    device: str
    rows: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    @property
    def regressions(self) -> list:
        return [r for r in self.rows if r.verdict == "REGRESSION"]


class NothingToCompare(Exception):
    """The run holds no results (nothing was measured): not a pass."""


def check(run_dir: Path, baseline_dir: Path = RESULTS, device: str | None = None, thresholds: dict | None = None):
    """Compare the run in run_dir/<device> with baseline_dir/<device>; a Report."""
    thresholds = thresholds if thresholds is not None else load_thresholds(THRESHOLDS)
    if device is None:
        found = devices(run_dir)
        if len(found) != 1:
            raise NothingToCompare(f"{run_dir}: expected one device folder with results, found {found or 'none'}")
        device = found[0]
    report = Report(device)
    run, base = load_results(run_dir, device), load_results(baseline_dir, device)
    if not run:
        raise NothingToCompare(f"{run_dir}: no results for {device}")
    if not base:
        report.warnings.append(f"no committed results for {device} in {baseline_dir}: nothing compared")
        return report
    absent = sorted(set(base) - set(run))
    if absent:
        report.warnings.append(f"kernels in the baseline but not in this run (not compared): {', '.join(absent)}")
    for kernel in sorted(set(run) - set(base)):
        report.warnings.append(f"{kernel}: no committed result for {device} (not compared)")
    for kernel in sorted(set(run) & set(base)):
        differ = [
            f"{k} {base[kernel].get(k)} (baseline) vs {run[kernel].get(k)} (run)"
            for k in VERSION_KEYS
            if base[kernel].get(k) != run[kernel].get(k)
        ]
        if differ:
            report.notes.append(f"{kernel}: " + "; ".join(differ))
        failed = [r for r in run[kernel]["rows"] if isinstance(r, dict) and "failed" in r and is_kp(_provider(r) or "")]
        if failed:
            shown = "; ".join(f"{_provider(r)}: {r['failed']}" for r in failed[:3])
            report.warnings.append(f"{kernel}: {len(failed)} kp row(s) failed in the run: {shown}")
        result = compare_kernel(kernel, base[kernel]["rows"], run[kernel]["rows"])
        gone = sorted(_anchors(base[kernel]["rows"]) - _anchors(run[kernel]["rows"]))
        if gone:  # e.g. a library not installed in this run: its cells use the best anchor left
            report.warnings.append(f"{kernel}: anchors in the baseline but not in this run: {', '.join(gone)}")
        for side, group in itertools.groupby(sorted(result.missing, key=repr), key=lambda m: m[0]):
            group = list(group)
            shown = "; ".join(f"{m} {' '.join(f'{k}={v}' for k, v in c)} {p}" for _, m, c, p in group[:3])
            more = f" and {len(group) - 3} more" if len(group) > 3 else ""
            report.warnings.append(f"{kernel}: {len(group)} kp cell(s) missing from the {side}: {shown}{more}")
        if not result.units:
            report.warnings.append(f"{kernel}: no kp cell with an anchor in both runs (not compared)")
        elif result.no_anchor:
            report.warnings.append(f"{kernel}: {len(result.no_anchor)} kp cell(s) without an anchor in both runs")
        for metric, units in sorted(by_metric(result.units).items()):
            limits, source = threshold_for(thresholds, kernel, metric)
            report.rows.append(Row(kernel, metric, units, limits, source))
    return report


def _pct(x: float) -> str:
    return f"{100 * (x - 1):+.1f}%"


def render(report: Report, run_dir, baseline_dir) -> str:
    """The report as text: the table, then what regressed, then warnings and notes."""
    lines = [f"regression check: {run_dir} against {baseline_dir}, device {report.device}"]
    if report.rows:
        lines += ["", "change: kp/anchor time ratio, run over baseline (+ slower); limits: kernel geomean / any cell"]
    head = ("kernel", "metric", "cells", "geomean", "worst cell", "limits", "verdict")
    table = [head] if report.rows else []
    for r in report.rows:
        w = r.worst
        limits = f"{100 * r.limits['kernel']:.1f}% / {100 * r.limits['cell']:.1f}%"
        if r.source != "derived":
            limits += f" ({r.source})"
        table.append(
            (
                r.kernel,
                r.metric,
                str(len(r.units)),
                _pct(r.geomean),
                f"{_pct(math.exp(w.log_change))} {w.where()}",
                limits,
                r.verdict,
            )
        )
    widths = [max((len(t[i]) for t in table), default=0) for i in range(len(head))]
    for t in table:
        lines.append("  ".join(s.ljust(w) for s, w in zip(t, widths)).rstrip())
    for r in report.regressions:
        lines += ["", f"{r.kernel} {r.metric}: geomean {_pct(r.geomean)} (limit +{100 * r.limits['kernel']:.1f}%)"]
        shown = sorted(r.units, key=lambda u: -u.log_change)
        over = r.cells_over
        count = max(5, min(len(over), 12))
        for u in shown[:count]:
            flag = "  over the cell limit" if u in over else ""
            lines.append(f"  {_pct(math.exp(u.log_change))}  {u.base:.4g} -> {u.run:.4g}  {u.where()}{flag}")
        if len(over) > count:
            lines.append(f"  and {len(over) - count} more cells over the cell limit")
    if report.warnings:
        lines += [""] + [f"warning: {w}" for w in report.warnings]
    if report.notes:
        lines += [""] + [f"note: versions differ: {n}" for n in report.notes]
    faster = [f"{r.kernel} ({r.metric}) {_pct(r.geomean)}" for r in report.rows if r.verdict == "faster"]
    if faster:
        lines += ["", f"faster than the baseline beyond the kernel limit: {', '.join(faster)} (refresh the baseline?)"]
    verdict = (
        f"FAILED: regression in {', '.join(sorted({f'{r.kernel} ({r.metric})' for r in report.regressions}))}"
        if report.regressions
        else f"passed: {len(report.rows)} kernel metric(s) compared, no regression"
        if report.rows
        else "passed: nothing compared"
    )
    return "\n".join(lines + ["", verdict]) + "\n"


# ---- thresholds from repeated runs ----


def spreads(run_dirs: list, device: str) -> dict:
    """Every ordered pair of runs compared as the check compares a run with its baseline: per kernel and metric,
    the largest |log change| of any cell (cell spread) and of the kernel's geomean (kernel spread), and each
    pair's geomean under "<run> vs <baseline>"."""
    runs = [load_results(d, device) for d in run_dirs]
    names = [Path(d).name for d in run_dirs]
    names = names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
    kernels = sorted(set.intersection(*(set(r) for r in runs)))
    out: dict = {}
    for kernel in kernels:
        for i, j in itertools.permutations(range(len(runs)), 2):
            result = compare_kernel(kernel, runs[i][kernel]["rows"], runs[j][kernel]["rows"])
            for metric, units in by_metric(result.units).items():
                s = out.setdefault(kernel, {}).setdefault(metric, {"cell": 0.0, "kernel": 0.0, "cells": 0, "pairs": {}})
                worst = max(units, key=lambda u: abs(u.log_change))
                if abs(worst.log_change) >= s["cell"]:
                    s["cell"], s["worst"] = abs(worst.log_change), worst.where()
                s["kernel"] = max(s["kernel"], abs(geomean_log(units)))
                s["cells"] = max(s["cells"], len(units))
                s["pairs"][f"{names[j]} vs {names[i]}"] = geomean_log(units)
    return out


def _frac(log_x: float) -> float:
    return round(math.expm1(log_x), 4)


def derive(run_dirs: list, device: str | None = None, previous: dict | None = None, date: str | None = None) -> dict:
    """Thresholds from repeated honest runs: kernel limit = max(KERNEL_FLOOR, MULTIPLIER x kernel spread), cell
    limit = max(CELL_FLOOR, MULTIPLIER x cell spread, kernel limit); spreads as max |log| over ordered run pairs.
    Entries of kernels that these runs lack are kept from `previous`; the defaults (kernels without an entry) are
    the largest limits of the entries timed the same way."""
    if len(run_dirs) < 2:
        raise ValueError("--derive needs at least two runs")
    if device is None:
        common = sorted(set.intersection(*(set(devices(d)) for d in run_dirs)))
        if len(common) != 1:
            raise ValueError(f"runs share the device folders {common}: pass --device")
        device = common[0]
    meta = next(iter(load_results(run_dirs[0], device).values()), {})
    source = {
        "device": device,
        "date": date or datetime.date.today().isoformat(),
        "runs": [str(d) for d in run_dirs],
        "torch": meta.get("torch"),
        "triton": meta.get("triton"),
    }
    kernels = dict((previous or {}).get("kernels", {}))
    for kernel, metrics in spreads(run_dirs, device).items():
        entry = {"from": source, "metrics": {}}
        for metric, s in sorted(metrics.items()):
            k_limit = max(KERNEL_FLOOR, _frac(MULTIPLIER * s["kernel"]))
            c_limit = max(CELL_FLOOR, _frac(MULTIPLIER * s["cell"]), k_limit)
            entry["metrics"][metric] = {
                "kernel": k_limit,
                "cell": c_limit,
                "cells": s["cells"],
                "kernel_spread": _frac(s["kernel"]),
                "cell_spread": _frac(s["cell"]),
                "worst_cell": s["worst"],
                "pair_geomeans": {p: _frac(v) for p, v in sorted(s["pairs"].items())},
            }
        kernels[kernel] = entry
    entries = [(timing_of(metric), m) for k in kernels.values() for metric, m in k["metrics"].items()]
    default = {}
    for timing in (*TIMINGS, "other"):
        # graph / eager: the largest limits of that timing method; other: the largest of all (unknown noise)
        chosen = [m for t, m in entries if t == timing or timing == "other"]
        if chosen:
            default[timing] = {"kernel": max(m["kernel"] for m in chosen), "cell": max(m["cell"] for m in chosen)}
    return {
        "method": (
            "Each ordered pair of honest runs of the same code is compared as the check compares a run with the "
            "baseline (kp time / best anchor time per cell, run over baseline). Spread: the largest |log change| "
            "over the pairs, of any cell (cell_spread) and of the kernel's trimmed geomean (kernel_spread; "
            "pair_geomeans: each pair's, as '<run> vs <baseline>'). "
            f"Limits, as slowdown fractions: kernel = max({KERNEL_FLOOR}, {MULTIPLIER:g} x kernel_spread), "
            f"cell = max({CELL_FLOOR}, {MULTIPLIER:g} x cell_spread, kernel), the multiple taken of the log. "
            "default, for kernels without repeated runs: the largest limits of the entries timed the same way "
            "(graph, eager), and of all entries for other metrics. Recompute: python benchmarks/compare.py "
            "--derive RUN_DIR RUN_DIR [...]"
        ),
        "multiplier": MULTIPLIER,
        "kernel_floor": KERNEL_FLOOR,
        "cell_floor": CELL_FLOOR,
        "default": default,
        "kernels": dict(sorted(kernels.items())),
    }


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, help="a run's results folder (KP_RESULTS_DIR of that run)")
    parser.add_argument("--baseline", type=Path, default=RESULTS, help="the committed results (default: %(default)s)")
    parser.add_argument("--device", help="device folder (default: the one device folder in --run)")
    parser.add_argument("--threshold-file", type=Path, default=THRESHOLDS, help="default: %(default)s")
    parser.add_argument("--derive", type=Path, nargs="+", metavar="RUN_DIR", help="recompute the thresholds")
    parser.add_argument("--date", help="with --derive: the runs' date (default: today)")
    args = parser.parse_args(argv)
    if args.derive:
        previous = load_thresholds(args.threshold_file)
        out = derive(args.derive, args.device, previous, args.date)
        args.threshold_file.write_text(json.dumps(out, indent=1) + "\n")
        for kernel, entry in out["kernels"].items():
            for metric, m in entry["metrics"].items():
                print(
                    f"{kernel} {metric}: {m['cells']} cells, spread kernel {100 * m['kernel_spread']:.2f}% "
                    f"cell {100 * m['cell_spread']:.2f}% -> limits {100 * m['kernel']:.1f}% / {100 * m['cell']:.1f}%"
                )
        print(f"wrote {args.threshold_file}")
        return 0
    if args.run is None:
        parser.error("--run DIR (or --derive RUN_DIR ...) is required")
    try:
        report = check(args.run, args.baseline, args.device, load_thresholds(args.threshold_file))
    except NothingToCompare as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(render(report, args.run, args.baseline), end="")
    return 1 if report.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
