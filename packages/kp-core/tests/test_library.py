"""kp_core.op: one declaration gives a custom op (opcheck, compile), its backward op, autograd and the registry."""

from typing import Optional

import pytest
import torch

import kp_core

OP = "kp_core_test::axpy"


def _forward(x: torch.Tensor, y: Optional[torch.Tensor], a: float, stats: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * x + y, x * x): a differentiable output and a statistic."""
    kp_core.note_launch(OP, "torch", kp_core.REFERENCE)
    out = a * x if y is None else a * x + y
    return out, x * x


def _backward(
    dout: Optional[torch.Tensor], x: torch.Tensor, a: float, stats: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    kp_core.note_launch(f"{OP}_backward", "torch", kp_core.REFERENCE)
    if dout is None:
        dout = torch.zeros_like(x)
    return a * dout, dout.clone()


AXPY = kp_core.op(
    OP,
    _forward,
    lambda x, y, a, stats: (torch.empty_like(x), torch.empty_like(x)),
    backward=_backward,
    backward_fake=lambda dout, x, a, stats: (torch.empty_like(x), torch.empty_like(x)),
    save=lambda args, outputs: (args[0],),
    grad_inputs=("x", "y"),
    differentiable_outputs=1,
    package="kp-core-tests",
    spec="axpy",
    dtypes=(torch.float32,),
)


def test_declaration_registers_both_ops():
    reg = kp_core.registered_kernels()
    for name in (OP, f"{OP}_backward"):
        info = reg[name]
        assert info.package == "kp-core-tests" and info.spec == "axpy" and info.dtypes == (torch.float32,)
    assert reg[OP].op is AXPY.op and reg[f"{OP}_backward"].op is AXPY.backward_op


@pytest.mark.parametrize("with_y", [True, False])
def test_eager_autograd_matches_the_formula_and_skips_absent_inputs(with_y):
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(5, requires_grad=True) if with_y else None
    with kp_core.record_launches() as rec:
        out, sq = AXPY(x, y, 3.0, True)
        out.sum().backward()
    assert not sq.requires_grad  # a statistic: marked non-differentiable
    assert rec.count(op=OP) == 1 and rec.count(op=f"{OP}_backward") == 1
    assert torch.equal(x.grad, torch.full((5,), 3.0))
    if with_y:
        assert torch.equal(y.grad, torch.ones(5))


def test_no_grad_calls_the_launcher_alone():
    x = torch.randn(5)
    with kp_core.record_launches() as rec:
        out, _ = AXPY(x, None, 2.0, False)
    assert torch.equal(out, 2 * x) and rec.count() == 1 and not out.requires_grad


def test_only_needed_gradients_are_returned():
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(5)  # needs no gradient
    AXPY(x, y, 2.0, True)[0].sum().backward()
    assert y.grad is None and torch.equal(x.grad, torch.full((5,), 2.0))


def test_custom_op_passes_opcheck_and_compiles_without_graph_breaks():
    x = torch.randn(4, 3, requires_grad=True)
    y = torch.randn(4, 3, requires_grad=True)
    torch.library.opcheck(AXPY.op, (x, y, 2.0, True))
    torch.library.opcheck(AXPY.op, (x.t(), None, 2.0, True))
    compiled = torch.compile(lambda t, u: AXPY(t, u, 2.0, True)[0] + 1, fullgraph=True)
    out = compiled(x, y)
    out.sum().backward()
    assert torch.equal(out, 2 * x + y + 1) and torch.equal(x.grad, torch.full((4, 3), 2.0))


def test_a_declaration_names_only_real_arguments():
    with pytest.raises(TypeError, match="not arguments"):
        kp_core.op(
            "kp_core_test::bad",
            _forward,
            lambda x, y, a, stats: (x, x),
            backward=_backward,
            backward_fake=lambda *a: a,
            save=lambda args, outputs: (),
            grad_inputs=("z",),
            package="p",
            spec="s",
            dtypes=(torch.float32,),
        )
    with pytest.raises(TypeError, match="declared together"):
        kp_core.op("kp_core_test::bad2", _forward, lambda *a: a, backward=_backward, package="p", spec="s", dtypes=())


def test_mutating_op_bumps_the_version_counter_in_eager_mode():
    def fill_(t: torch.Tensor, value: float) -> None:
        t.data.fill_(value)  # a write autograd does not see, as a Triton kernel's

    fill = kp_core.op(
        "kp_core_test::fill_", fill_, lambda t, value: None, mutates_args=("t",), package="p", spec="s", dtypes=()
    )
    t = torch.zeros(3)
    before = t._version
    fill(t, 2.0)
    assert t._version > before and torch.equal(t, torch.full((3,), 2.0))


def _twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return 2 * x, None  # the second output carries nothing in this call


def _twice_backward(dy: Optional[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return 2 * dy


TWICE = kp_core.op(
    "kp_core_test::twice",
    _twice,
    lambda x: (torch.empty_like(x), None),
    backward=_twice_backward,
    backward_fake=lambda dy, x: torch.empty_like(x),
    save=lambda args, outputs: (args[0],),
    grad_inputs=("x",),
    differentiable_outputs=1,
    package="kp-core-tests",
    spec="twice",
    dtypes=(torch.float32,),
)


def test_none_outputs_stay_none_in_eager_mode_and_become_empty_tensors_in_the_custom_op():
    x = torch.randn(3, requires_grad=True)
    out, nothing = TWICE(x)  # the autograd path
    assert nothing is None
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    with torch.no_grad():
        assert TWICE(x)[1] is None  # the plain path
    out, empty = TWICE.op(x)
    assert empty.shape == (0,) and empty.dtype == x.dtype
    torch.library.opcheck(TWICE.op, (x,))  # schema, fake and autograd registration agree


def test_workspace_is_reused_per_key_and_not_past_its_limits(monkeypatch):
    from kp_core import scratch

    x = torch.empty(4)
    a = kp_core.workspace(x, (2, 3), torch.float64)
    assert a.shape == (2, 3) and a.dtype == torch.float64
    assert kp_core.workspace(x, (2, 3), torch.float64) is a
    assert kp_core.workspace(x, (3, 2), torch.float64) is not a  # another shape, another buffer
    assert kp_core.workspace(x, (2, 3), torch.float32) is not a
    monkeypatch.setattr(scratch, "MAX_BYTES", 8)
    big = kp_core.workspace(x, (5,), torch.float64)
    assert kp_core.workspace(x, (5,), torch.float64) is not big  # over MAX_BYTES: never cached
    scratch.clear()
    assert kp_core.workspace(x, (2, 3), torch.float64) is not a


class _RecordingGuard:
    """A guard that notes what passes through it and changes nothing."""

    def __init__(self):
        self.calls = []

    def launch(self, op, kernel, args, consts, go):
        go(args)

    def call(self, name, fn, args, mutated):
        self.calls.append((name, mutated))
        return fn(*args)


def test_a_guard_sees_every_forward_and_backward_call_on_each_path():
    guard = _RecordingGuard()
    previous = kp_core.set_guard(guard)
    try:
        x = torch.randn(4, requires_grad=True)
        AXPY(x, None, 2.0, False)[0].sum().backward()  # the eager autograd.Function path
        with torch.no_grad():
            AXPY(x, None, 2.0, False)  # the launcher alone
        AXPY.op(x, None, 2.0, False)[0].sum().backward()  # the custom op (dispatcher) path
    finally:
        assert kp_core.set_guard(previous) is guard
    assert guard.calls == [(OP, ()), (f"{OP}_backward", ()), (OP, ()), (OP, ()), (f"{OP}_backward", ())]
