"""The tiers' Hypothesis draws depend on the test alone: not on which modules a worker happened to import before
it (kp_conformance.tiers turns off Hypothesis' constants taken from local modules), so a tier's examples, and the
suite's run time, are the same in every run and every order. A tier run in parts (KP_REPORT_RESUME, for a GPU
sitting too short for it) reports what one run would."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings

import kp_conformance as kc

kc.declare(
    kc.Spec(
        name="tiers",
        package="kp-conformance",
        ops=(),
        reference="the same strategy's draws before and after a local module full of literals is imported; "
        "the report of one run over the same files; a stand-in for Triton's compile that does or does not run "
        "its front end",
        dtypes=(),
        properties=("reproducible_draws", "report_in_parts", "longest_first", "compile_log", "progress"),
    )
)


def _draws():
    seen = []

    @settings(max_examples=30, derandomize=True, database=None)
    @given(kc.row_shapes(kc.current()))
    def run(shape):
        seen.append(shape)

    run()
    return seen


@pytest.mark.conformance(kernel="tiers", prop="reproducible_draws")
def test_draws_do_not_depend_on_loaded_modules(tmp_path, monkeypatch):
    before = _draws()
    # A module outside site-packages, as a conftest, a helper on PYTHONPATH or torch.compile's generated code is.
    path = tmp_path / "kp_local_literals.py"
    path.write_text("SIZES = (" + ", ".join(str(7 * i + 3) for i in range(400)) + ")\n")
    spec = importlib.util.spec_from_file_location("kp_local_literals", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "kp_local_literals", module)  # taken out again after the test
    assert _draws() == before, "the tier's draws changed when a local module was imported"


# A kernels module of two launchable kernels with a bool switch, and spec files that note launches of them.
_FILES = {
    "kp_fake_kernels.py": """
        class _Jit:  # what the census takes for a Triton kernel: .fn and .arg_names
            def __init__(self, fn):
                self.fn, self.arg_names = fn, ["SWITCH"]

        def _a(SWITCH):
            pass

        def _b(SWITCH):
            pass

        _a, _b = _Jit(_a), _Jit(_b)  # named as their functions, as @triton.jit leaves them
    """,
    "conftest.py": """
        pytest_plugins = ["kp_conformance.plugin"]
    """,
    "test_first.py": """
        import os
        import pytest
        import kp_fake_kernels as k
        from kp_conformance import census

        @pytest.mark.conformance(kernel="fake", prop="one")
        def test_one():
            census.note(k._a, {"SWITCH": True})
            assert os.environ.get("KP_FAKE_FAIL") != "1"
    """,
    "test_second.py": """
        import pytest
        import torch
        import kp_fake_kernels as k
        from kp_conformance import census

        @pytest.mark.conformance(kernel="fake", prop="two")
        @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
        def test_two(dtype):
            census.note(k._a, {"SWITCH": False})
            census.note(k._b, {"SWITCH": dtype == torch.float16})
    """,
}


def _run(tmp_path, reports, *files, **env):
    own = ("KP_REPORT_RESUME", "KP_CENSUS", "PYTEST_XDIST_WORKER")  # this run's settings are not the part's
    env = {**{k: v for k, v in os.environ.items() if k not in own}, "KP_REPORT_DIR": str(tmp_path / reports), **env}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *files]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    paths = list((tmp_path / reports).glob("*.json"))
    return done, json.loads(paths[0].read_text()) if paths else None


def _cells(report):
    return sorted((c["kernel"], c["property"], c["dtype"], c["status"], c["tests"]) for c in report["cells"])


@pytest.mark.conformance(kernel="tiers", prop="report_in_parts")
def test_report_in_parts_is_one_runs_report(tmp_path, monkeypatch):
    for name, text in _FILES.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    # What one run over both files reports (and does, run so): every cell passes, and so does the census.
    whole = [
        ("fake", "one", "-", "pass", 1),
        ("fake", "two", "float16", "pass", 1),
        ("fake", "two", "float32", "pass", 1),
        ("kp_fake_kernels", "every_branch", "-", "pass", 1),
    ]
    done, part = _run(tmp_path, "parts", "test_first.py", KP_CENSUS="defer", KP_FAKE_FAIL="1")
    assert done.returncode == 1 and ("fake", "one", "-", "fail", 1) in _cells(part)  # the planted failure
    assert not any(c["property"] == "every_branch" for c in part["cells"])
    # The first file again, now passing: its cell replaces the failed one. Alone it leaves _b unlaunched, which
    # fails only once the census is no longer deferred.
    done, part = _run(tmp_path, "parts", "test_first.py", KP_REPORT_RESUME="1", KP_CENSUS="defer")
    assert done.returncode == 0 and ("fake", "one", "-", "pass", 1) in _cells(part), done.stdout + done.stderr
    # The last part launches _a only with SWITCH False: the census passes over both parts' launches.
    done, part = _run(tmp_path, "parts", "test_second.py", KP_REPORT_RESUME="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert _cells(part) == whole

    # A report from another run (here: another torch) is refused, not mixed in.
    from kp_conformance import plugin

    path = tmp_path / "parts" / next((tmp_path / "parts").glob("*.json")).name
    path.write_text(json.dumps({**json.loads(path.read_text()), "torch": "0.0"}))
    monkeypatch.setenv("KP_REPORT_DIR", str(tmp_path / "parts"))
    with pytest.raises(pytest.UsageError, match="is not an earlier part of this run"):
        plugin._resume()


@pytest.mark.conformance(kernel="tiers", prop="longest_first")
def test_a_run_starts_its_longest_tests_first(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from kp_conformance import plugin

    items = [SimpleNamespace(nodeid=n) for n in ("a", "b", "c", "new", "d", "new2")]
    monkeypatch.setenv("KP_REPORT_DIR", str(tmp_path))
    path = plugin._report_path(plugin._identity())
    plugin.pytest_collection_modifyitems(None, None, items)  # no report yet: the collected order
    assert [i.nodeid for i in items] == ["a", "b", "c", "new", "d", "new2"]
    path.write_text(json.dumps({"durations": {"a": 0.5, "b": 30.0, "c": 2.0, "d": 2.0, "gone": 99.0}}))
    plugin.pytest_collection_modifyitems(None, None, items)
    # unrecorded tests first (they may be long), then slowest first; ties keep the collected order
    assert [i.nodeid for i in items] == ["new", "new2", "b", "c", "d", "a"]


@pytest.mark.conformance(kernel="tiers", prop="compile_log")
def test_compile_log_marks_disk_cache_misses(tmp_path, monkeypatch):
    """KP_COMPILES=FILE: a request that runs Triton's front end is a miss, one that does not a disk-cache hit."""
    from types import SimpleNamespace

    pytest.importorskip("triton")
    import triton.compiler as front
    import triton.compiler.compiler as compiler

    from kp_conformance import compiles

    log = tmp_path / "compiles.tsv"
    monkeypatch.delenv("KP_COMPILES", raising=False)  # a run logging its own compiles
    assert not compiles.install()  # off unless asked for
    monkeypatch.setattr(compiler.ASTSource, "make_ir", lambda self: "ir")

    def compile_(src, target=None, options=None):  # a stand-in: the front end runs on a miss only
        return SimpleNamespace(hash=src.name, made=src.make_ir() if src.miss else "loaded")

    monkeypatch.setattr(compiler, "compile", compile_)
    monkeypatch.setattr(front, "compile", compile_)
    monkeypatch.setenv("KP_COMPILES", str(log))
    assert compiles.install()
    cold = SimpleNamespace(name="_cold", miss=True, make_ir=lambda: compiler.ASTSource.make_ir(None))
    warm = SimpleNamespace(name="_warm", miss=False)
    compiles.running("spec.py::test_a")
    assert front.compile(cold).made == "ir" and front.compile(warm).made == "loaded"
    compiles.running("spec.py::test_b")
    assert compiler.compile(cold, options={}).made == "ir"
    rows = [[*line.split("\t")[2:5], line.split("\t")[6]] for line in log.read_text().splitlines()]
    assert rows == [
        ["spec.py::test_a", "_cold", "miss", "_cold"],
        ["spec.py::test_a", "_warm", "hit", "_warm"],
        ["spec.py::test_b", "_cold", "miss", "_cold"],
    ]
    first, most = compiles.summary(str(log))
    assert first.startswith(f"kp compiles ({log}): 2 missed the disk cache")
    assert "1 of them a variant compiled already" in first and "1 loaded from it" in first
    assert most == "kp compiles, most missed: _cold 2"


@pytest.mark.conformance(kernel="tiers", prop="progress")
def test_progress_names_the_failing_case(tmp_path):
    """KP_PROGRESS's line for a failure carries the assertion and Hypothesis' failing case, as it happens (a run
    killed at its time limit prints no summary)."""
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["kp_conformance.plugin"]\n')
    test = """
        import pytest
        from hypothesis import given, settings, strategies as st

        @pytest.mark.conformance(kernel="fake", prop="drawn")
        @settings(max_examples=20, derandomize=True, database=None)
        @given(c=st.fixed_dictionaries({"d": st.sampled_from((64, 80)), "sk": st.integers(1, 9)}))
        def test_drawn(c):
            assert c["d"] != 80, "dk: max err 0.25 > bound 0.01"
    """
    (tmp_path / "test_drawn.py").write_text(textwrap.dedent(test))
    progress = tmp_path / "progress.tsv"
    done, _ = _run(tmp_path, "reports", "test_drawn.py", KP_PROGRESS=str(progress))
    lines = [line.split("\t") for line in progress.read_text().splitlines()]
    failed = [fields for fields in lines if fields[1] == "failed"]
    assert done.returncode == 1 and len(failed) == 1, done.stdout + done.stderr
    assert "dk: max err 0.25" in failed[0][3] and "'d': 80" in failed[0][3], failed
