import logging
import os
import subprocess
import sys

import pytest
import torch

import kp_core


def test_cpu_tensor_picks_interpreter_or_reference(monkeypatch):
    x = torch.ones(2)
    monkeypatch.delenv("KP_BACKEND", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert kp_core.choose_backend("op", x) == kp_core.REFERENCE
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    expected = kp_core.INTERPRET if kp_core.has_triton() else kp_core.REFERENCE
    assert kp_core.choose_backend("op", x) == expected


def test_kp_backend_forces_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("KP_BACKEND", "reference")
    assert kp_core.choose_backend("op", torch.ones(1)) == kp_core.REFERENCE


def test_forcing_triton_without_a_way_to_run_it_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("KP_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="my_op: KP_BACKEND=triton"):
        kp_core.choose_backend("my_op", torch.ones(1))


def test_unknown_kp_backend_is_an_error(monkeypatch):
    monkeypatch.setenv("KP_BACKEND", "fast")
    with pytest.raises(ValueError, match="KP_BACKEND must be one of"):
        kp_core.choose_backend("op", torch.ones(1))


def test_launch_record_counts_and_nests():
    with kp_core.record_launches() as outer:
        kp_core.note_launch("kp::a", "_k1", "triton")
        with kp_core.record_launches() as inner:
            kp_core.note_launch("kp::b", "_k2", "reference")
    kp_core.note_launch("kp::c", "_k3", "triton")  # no active record: not kept anywhere
    assert outer.count() == 2 and inner.count() == 1
    assert outer.count(op="kp::a", backend="triton") == 1
    assert outer.count(kernel="_k2") == 1
    assert outer.backends() == {"triton", "reference"}
    assert inner.backends("kp::a") == set()


def test_launch_record_sees_other_threads():
    # CUDA autograd runs backward on a device thread: its launches must land in the caller's record.
    import threading

    with kp_core.record_launches() as rec:
        t = threading.Thread(target=kp_core.note_launch, args=("kp::bwd", "_k", "triton"))
        t.start()
        t.join()
    assert rec.count(op="kp::bwd") == 1


def test_direct_launch_key_separates_what_triton_specialises_on():
    """The key of kp_core.launch's compiled-kernel cache: tensors by dtype and 16-byte alignment, ints by range,
    == 1 and divisibility by 16, floats all alike, bools and None by value."""
    from kp_core.launches import _spec

    x = torch.zeros(64)
    key = _spec((x, 16, 17, 1, 2**40, 0.5, True, None))
    assert key == _spec((torch.ones(64), 32, 33, 1, 2**41, 3.0, True, None))
    assert key != _spec((x[1:], 16, 17, 1, 2**40, 0.5, True, None))  # misaligned data pointer
    assert key != _spec((x.double(), 16, 17, 1, 2**40, 0.5, True, None))  # dtype
    for changed in ((1, 17), (2, 16), (3, 2), (4, 7), (6, False), (7, 0)):
        args = [x, 16, 17, 1, 2**40, 0.5, True, None]
        args[changed[0]] = changed[1]
        assert _spec(tuple(args)) != key, changed


def test_constexprs_key_is_equal_exactly_when_names_types_and_values_are():
    a = kp_core.Constexprs(BLOCK=64, RMS=True, OFFSET=1.0, ACC=torch.float32)
    assert dict(a) == {"BLOCK": 64, "RMS": True, "OFFSET": 1.0, "ACC": torch.float32}
    assert kp_core.Constexprs(BLOCK=64, RMS=True, OFFSET=1.0, ACC=torch.float32).key == a.key
    for other in (
        dict(BLOCK=128, RMS=True, OFFSET=1.0, ACC=torch.float32),
        dict(BLOCK=64, RMS=1, OFFSET=1.0, ACC=torch.float32),  # True and 1 compare equal; the kernel sees them apart
        dict(BLOCK=64, RMS=True, OFFSET=0.0, ACC=torch.float32),
        dict(BLOCK=64, RMS=True, OFFSET=1.0, ACC=torch.float64),
        dict(BLOCKS=64, RMS=True, OFFSET=1.0, ACC=torch.float32),
    ):
        assert kp_core.Constexprs(**other).key != a.key, other


def test_launch_refuses_arguments_out_of_the_kernels_order(monkeypatch):
    triton = pytest.importorskip("triton")
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "1")

    @triton.jit
    def _kernel(X, n, BLOCK: tl.constexpr, SCALE: tl.constexpr):
        pass

    x = torch.zeros(4)
    with pytest.raises(TypeError, match="_kernel takes"):
        kp_core.launch("op", kp_core.INTERPRET, _kernel, (1,), (x, 4), dict(SCALE=2, BLOCK=4))


def _skip_where_the_interpreter_cannot_run() -> None:
    problem = kp_core.interpreter_problem()
    if problem is not None:
        pytest.skip(problem)


def test_a_guard_launches_with_the_arguments_it_passes_on(monkeypatch):
    triton = pytest.importorskip("triton")
    import triton.language as tl

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _skip_where_the_interpreter_cannot_run()

    @triton.jit
    def _ones(X, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(X + i, tl.full((BLOCK,), 1.0, tl.float32), mask=i < n)

    x, elsewhere = torch.zeros(4), torch.zeros(4)

    class Redirect:
        def launch(self, op, kernel, args, consts, go):
            self.seen = (op, kernel.fn.__name__, dict(consts))
            go((elsewhere, *args[1:]))

    guard = Redirect()
    previous = kp_core.set_guard(guard)
    try:
        kp_core.launch("op", kp_core.INTERPRET, _ones, (1,), (x, 4), dict(BLOCK=4))
    finally:
        kp_core.set_guard(previous)
    assert guard.seen == ("op", "_ones", {"BLOCK": 4})
    assert not x.any() and elsewhere.eq(1).all()


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
else:

    @triton.jit
    def _twice(x):
        return x * 2.0

    @triton.jit
    def _loop(X, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), tl.float32)  # Triton's own helper: it sees triton.language.core
        for _ in range(0, n):
            acc = _twice(acc + 1.0)
        tl.store(X + i, acc)


def test_helpers_inside_an_interpreted_kernel_do_not_patch_the_language_again(monkeypatch):
    """Triton's interpreter re-patched triton.language on every call of a @triton.jit helper; inside kp's launch
    the launch's patch serves its helpers (kp_core.launches._patch_lang_once). The results stay Triton's."""
    if triton is None or not kp_core.interpreter_enabled():
        pytest.skip("needs Triton's interpreter on when this module was imported")
    from triton.runtime import interpreter

    if not hasattr(interpreter, "_LangPatchScope"):
        pytest.skip("Triton < 3.6: its interpreter is shaped otherwise, and kp leaves it as it is")
    x = torch.zeros(4)
    kp_core.launch("op", kp_core.INTERPRET, _loop, (1,), (x, 6), dict(BLOCK=4))  # Triton's first-time imports
    assert x.eq(126.0).all()  # ((((((0+1)2+1)2+1)2+1)2+1)2+1)2
    calls = []
    real = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: calls.append(1) or real(*a))
    counts = []
    for n in (1, 12):  # the launch's patch and tl.zeros' (it sees triton.language.core), whatever n is
        calls.clear()
        kp_core.launch("op", kp_core.INTERPRET, _loop, (1,), (x, n), dict(BLOCK=4))
        counts.append(len(calls))
    assert counts[0] == counts[1], f"helper calls patched the language again: {counts}"
    assert x.eq(2.0**13 - 2).all()


def test_interpreter_switched_on_after_the_kernels_were_defined_names_the_fix(tmp_path):
    """Triton decides interpreted or compiled when a kernel is decorated; TRITON_INTERPRET=1 set later gave
    Triton's own "0 active drivers" error on CPU tensors. kp says what to do instead."""
    pytest.importorskip("triton")
    script = tmp_path / "late.py"
    script.write_text(
        "import os, torch, triton, kp_core\n"
        "@triton.jit\n"
        "def _kernel(X):\n"
        "    pass\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "x = torch.ones(1)\n"
        "try:\n"
        "    kp_core.launch('my_op', kp_core.choose_backend('my_op', x), _kernel, (1,), (x,), {})\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert "my_op: TRITON_INTERPRET=1 was set after kp's kernels were defined" in out.stdout, out.stderr


@pytest.mark.parametrize(
    "triton_version,numpy_version,broken",
    [("3.6.0", "2.4.6", True), ("3.2.0", "2.4.0", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False)],
)
def test_an_interpreter_that_cannot_run_is_named_before_a_launch(monkeypatch, triton_version, numpy_version, broken):
    """Triton < 3.7's interpreter fails inside any kernel with a runtime loop bound under NumPy >= 2.4; kp raises
    the fix instead, before the kernel runs."""
    triton = pytest.importorskip("triton")
    import numpy

    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    kp_core.interpreter_problem.cache_clear()
    try:
        problem = kp_core.interpreter_problem()
        assert (problem is not None) == broken
        if broken:
            assert f"Triton {triton_version}'s interpreter" in problem and "pip install 'numpy<2.4'" in problem
            if kp_core.interpreter_enabled():
                x = torch.zeros(4)
                with pytest.raises(RuntimeError, match="op: Triton .* does not run with NumPy"):
                    kp_core.launch("op", kp_core.INTERPRET, _loop, (1,), (x, 4), dict(BLOCK=4))
                assert not x.any()
    finally:
        kp_core.interpreter_problem.cache_clear()


def test_the_reference_path_is_said_once_in_the_package_log(caplog):
    with caplog.at_level(logging.INFO, logger="kp"):
        kp_core.reference("kp::made_up_op")
        kp_core.reference("kp::made_up_op")
    lines = [r for r in caplog.records if "kp::made_up_op" in r.getMessage()]
    assert len(lines) == 1 and lines[0].name == "kp.core" and "reference path" in lines[0].getMessage()


@pytest.mark.parametrize("value,words", [("launches", "_kernel on interpret, grid (1,)"), ("loud", "KP_LOG must be")])
def test_kp_log_switch(tmp_path, value, words):
    """KP_LOG=launches logs every launch (op, kernel, grid, shapes) to stderr; an unknown value is an error."""
    pytest.importorskip("triton")
    if value == "launches":
        _skip_where_the_interpreter_cannot_run()
    script = tmp_path / "logged.py"
    script.write_text(
        "import torch, triton, kp_core\n"
        "@triton.jit\n"
        "def _kernel(X):\n"
        "    pass\n"
        "x = torch.ones(3)\n"
        "kp_core.launch('kp::logged', kp_core.choose_backend('kp::logged', x), _kernel, (1,), (x,), {})\n"
    )
    env = dict(os.environ, KP_LOG=value, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert words in out.stderr, out.stderr
