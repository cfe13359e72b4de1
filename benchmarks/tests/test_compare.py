"""benchmarks/compare.py on the committed results and on three honest H200 runs (tests/data/run1..3: bench_quantize.py
and bench_sparsity.py, torch 2.11, triton 3.6, 2026-11-28). CPU only, JSON only."""

from __future__ import annotations

import copy
import itertools
import json
import math
import shutil
from pathlib import Path

import compare
import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
DATA = Path(__file__).resolve().parent / "data"
RUNS = [DATA / f"run{i}" for i in (1, 2, 3)]
H200 = "nvidia-h200"
KERNELS = ("quantize", "sparsity")


def load(root: Path, kernel: str, device: str = H200) -> dict:
    return json.loads((root / device / f"{kernel}.json").read_text())


def scaled(doc: dict, kernel: str, factor: float, who: str = "kp") -> dict:
    """doc with the times of kp's providers (who="kp"), of the anchors ("anchors") or of all ("all") multiplied by
    factor, and their rates divided by it: the same machine, that much slower."""
    out = copy.deepcopy(doc)

    def chosen(is_kp: bool) -> bool:
        return who == "all" or (who == "kp") == is_kp

    for row in out["rows"]:
        provider = next((row[k] for k in compare.PROVIDER_KEYS if isinstance(row.get(k), str)), None)
        if provider is not None:
            if chosen(compare.is_kp(provider)):
                for k, v in row.items():
                    if compare._number(v) and compare.metric_kind(k) == "time":
                        row[k] = v * factor
                    elif compare._number(v) and compare.metric_kind(k) == "rate":
                        row[k] = v / factor
            continue
        pairs = compare.PAIRS.get(kernel, ())
        fields = {f: True for f, _ in pairs} | {a: False for _, a in pairs}  # an anchor can serve two pairs
        for name, is_kp in fields.items():
            if name in row and chosen(is_kp):
                row[name] *= factor
    return out


def write(root: Path, docs: dict, device: str = H200) -> Path:
    (root / device).mkdir(parents=True, exist_ok=True)
    for kernel, doc in docs.items():
        (root / device / f"{kernel}.json").write_text(json.dumps(doc))
    return root


def run_check(run: Path, baseline: Path, capsys, *extra: str) -> tuple[int, str]:
    rc = compare.main(["--run", str(run), "--baseline", str(baseline), *extra])
    return rc, capsys.readouterr().out


def failed_line(out: str) -> str:
    return out.strip().splitlines()[-1]


@pytest.mark.parametrize("kernel", KERNELS)
def test_planted_slowdown_in_the_run_fails(kernel, tmp_path, capsys):
    """The committed results as the run, kp 10 % slower in one kernel: that kernel fails, the other passes."""
    docs = {k: load(RESULTS, k) for k in KERNELS}
    docs[kernel] = scaled(docs[kernel], kernel, 1.10)
    rc, out = run_check(write(tmp_path, docs), RESULTS, capsys)
    assert rc == 1, out
    last = failed_line(out)
    assert last.startswith("FAILED") and kernel in last, out
    assert [k for k in KERNELS if k != kernel][0] not in last, out


@pytest.mark.parametrize("kernel", KERNELS)
def test_planted_speedup_in_the_baseline_fails(kernel, tmp_path, capsys):
    """The committed baseline's kp 10 % faster, the committed results as the run: the kernel fails."""
    base = write(tmp_path / "base", {kernel: scaled(load(RESULTS, kernel), kernel, 1 / 1.10)})
    run = write(tmp_path / "run", {kernel: load(RESULTS, kernel)})
    rc, out = run_check(run, base, capsys)
    assert rc == 1 and kernel in failed_line(out), out


@pytest.mark.parametrize("i,j", list(itertools.permutations(range(3), 2)))
def test_honest_reruns_pass(i, j, capsys):
    rc, out = run_check(RUNS[j], RUNS[i], capsys)
    assert rc == 0, out
    assert failed_line(out).startswith("passed"), out


@pytest.mark.parametrize("i,j", list(itertools.permutations(range(3), 2)))
def test_planted_slowdown_against_an_honest_rerun_fails(i, j, tmp_path, capsys):
    """Real run-to-run noise in both files, and kp 10 % slower in the run: both kernels fail."""
    docs = {k: scaled(load(RUNS[j], k), k, 1.10) for k in KERNELS}
    rc, out = run_check(write(tmp_path, docs), RUNS[i], capsys)
    assert rc == 1, out
    assert all(k in failed_line(out) for k in KERNELS), out


def test_machine_noise_cancels(tmp_path, capsys):
    """Every provider 20 % slower (a slower machine of the same kind): no change at all."""
    docs = {k: scaled(load(RESULTS, k), k, 1.2, who="all") for k in KERNELS}
    run = write(tmp_path, docs)
    rc, out = run_check(run, RESULTS, capsys)
    assert rc == 0, out
    report = compare.check(run, RESULTS, H200, compare.load_thresholds(compare.THRESHOLDS))
    assert report.rows and all(abs(math.log(r.geomean)) < 1e-9 for r in report.rows)


def test_an_anchor_slowing_down_alone_passes(tmp_path, capsys):
    docs = {k: scaled(load(RESULTS, k), k, 1.2, who="anchors") for k in KERNELS}
    rc, out = run_check(write(tmp_path, docs), RESULTS, capsys)
    assert rc == 0, out
    assert "faster than the baseline" in out


def test_missing_cells_and_kernels_warn_but_pass(tmp_path, capsys):
    doc = load(RESULTS, "quantize")
    rows = [r for r in doc["rows"] if not (r["provider"] == "kp" and r["mode"] == "delayed")]
    extra = dict(rows[0], provider="kp new variant")  # a kp provider the baseline lacks
    failed = {k: v for k, v in rows[0].items() if compare.metric_kind(k) is None} | {"failed": "RuntimeError: x"}
    run = write(tmp_path, {"quantize": dict(doc, rows=[*rows, extra, failed])})
    rc, out = run_check(run, RESULTS, capsys)
    assert rc == 0, out
    assert "missing from the run" in out and "mode=delayed" in out, out
    assert "missing from the baseline" in out and "kp new variant" in out, out
    assert "not in this run" in out and "sparsity" in out, out
    assert "1 kp row(s) failed in the run: kp: RuntimeError: x" in out, out


def test_versions_differ_are_noted(tmp_path, capsys):
    docs = {k: dict(load(RESULTS, k), torch="2.12.0+cu130", triton="3.7.0") for k in KERNELS}
    rc, out = run_check(write(tmp_path, docs), RESULTS, capsys)
    assert rc == 0, out
    assert "versions differ: quantize: torch 2.11.0+cu130 (baseline) vs 2.12.0+cu130 (run)" in out, out
    assert "triton 3.6.0 (baseline) vs 3.7.0 (run)" in out, out


def test_a_kernel_with_rates_only(tmp_path, capsys):
    """layer_norm on the H100 has GB/s and no times: checked on the rates, inverted."""
    device = "nvidia-h100-80gb-hbm3"
    doc = load(RESULTS, "layer_norm", device)
    assert not any(compare.metric_kind(k) == "time" for r in doc["rows"] for k in r)
    run = write(tmp_path, {"layer_norm": scaled(doc, "layer_norm", 1.10)}, device)
    rc, out = run_check(run, RESULTS, capsys)
    assert rc == 1 and "layer_norm (gbps_graph)" in failed_line(out), out


@pytest.mark.parametrize("device", compare.devices(RESULTS))
def test_every_committed_result_against_itself(device, tmp_path, capsys):
    """Every committed schema is read: a copy of a device's results passes with no change in any kernel."""
    shutil.copytree(RESULTS / device, tmp_path / device)
    rc, out = run_check(tmp_path, RESULTS, capsys)
    assert rc == 0, out
    report = compare.check(tmp_path, RESULTS, device, {})
    assert len(report.rows) >= 5 and all(r.geomean == 1 for r in report.rows), out


def test_no_results_is_an_error(tmp_path, capsys):
    """A run that wrote nothing is no pass: exit status 2."""
    assert compare.main(["--run", str(tmp_path / "absent")]) == 2
    (tmp_path / H200).mkdir()
    assert compare.main(["--run", str(tmp_path)]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_anchor_is_fixed_by_name_from_the_baseline():
    def rows(kp, a, b):
        return [dict(M=1, provider="kp", ms=kp), dict(M=1, provider="a", ms=a), dict(M=1, provider="b", ms=b)]

    # "a" is the best anchor in the baseline; in the run "b" is faster, but "a" is still the one used
    result = compare.compare_kernel("k", rows(1.0, 2.0, 3.0), rows(1.0, 2.0, 1.5))
    (unit,) = result.units
    assert unit.anchor == "a" and unit.log_change == 0


def test_one_outlier_cell_does_not_move_the_kernel():
    def units(changes):
        return [compare.Unit("ms", (("i", i),), "kp", "a", 1.0, c) for i, c in enumerate(changes)]

    assert compare.geomean_log(units([1.0] * 19 + [2.1])) == 0
    assert compare.geomean_log(units([1.1] * 20)) == pytest.approx(math.log(1.1))


def test_derive_reproduces_the_committed_thresholds(monkeypatch):
    """The quantize and sparsity limits are those the tests' data give (re-deriving them from other runs means
    replacing tests/data with those runs' JSON files)."""
    committed = json.loads(compare.THRESHOLDS.read_text())
    monkeypatch.chdir(ROOT)
    runs = [Path(r) for r in committed["kernels"]["quantize"]["from"]["runs"]]
    assert [ROOT / r for r in runs] == RUNS
    derived = compare.derive(runs, previous=committed, date=committed["kernels"]["quantize"]["from"]["date"])
    assert json.loads(json.dumps(derived)) == committed
    # the limits catch the planted 10 % on CUDA-graph timings, and the floors hold
    for kernel in KERNELS:
        for m in committed["kernels"][kernel]["metrics"].values():
            assert m["kernel"] >= compare.KERNEL_FLOOR and m["cell"] >= max(compare.CELL_FLOOR, m["kernel"])
    assert committed["kernels"]["quantize"]["metrics"]["ms_graph"]["kernel"] < 0.10
    assert committed["kernels"]["sparsity"]["metrics"]["ms"]["kernel"] < 0.10
