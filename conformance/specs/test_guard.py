"""The guard itself (kp_conformance.guard): planted stray writes, gap writes, stray reads and input writes are
caught on this device, and a correct launch's results reach the caller's tensors."""

import pytest
import torch
import triton
import triton.language as tl

import kp_conformance
import kp_core
from kp_conformance.guard import Guard, GuardError

pytestmark = pytest.mark.skipif(kp_core.launches._guard is None, reason="KP_GUARD=0: the guard is off")

kp_conformance.declare(
    kp_conformance.Spec(
        name="guard",
        package="kp-conformance",
        ops=(),
        reference="small kernels of its own, each with a planted bug the guard must report",
        dtypes=(),
        properties=(
            "correct_launch_untouched",
            "catches_stray_writes",
            "catches_stray_reads",
            "catches_discarded_stray_reads",
            "catches_input_writes",
        ),
    )
)


@triton.jit
def _copy(X, Y, n, sx, sy, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Y[i * sy + SHIFT] = X[i * sx] for i < n: SHIFT plants the bug."""
    i = tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(X + i * sx, mask=ok)
    tl.store(Y + i * sy + SHIFT, x, mask=ok)


@triton.jit
def _sum_unmasked(X, Y, n, BLOCK: tl.constexpr):
    """Y[0] = sum of X[0 : BLOCK], reading past n: the planted stray read."""
    i = tl.arange(0, BLOCK)
    tl.store(Y, tl.sum(tl.load(X + i).to(tl.float32), axis=0))


def _launch(kernel, args, plain=False, **consts):
    kp_core.launch("guard_test", kp_conformance.kernel_backend(), kernel, (1,), args, consts, plain=plain)


def _copy_launch(x, y, shift=0):
    _launch(_copy, (x, y, x.numel(), x.stride(0), y.stride(0)), SHIFT=shift, BLOCK=64)


@pytest.mark.conformance(kernel="guard", prop="correct_launch_untouched")
def test_a_correct_launch_passes_and_its_results_reach_the_caller():
    x = torch.arange(40, dtype=torch.float32, device=kp_conformance.device())
    y = torch.zeros_like(x)
    _copy_launch(x, y)
    assert torch.equal(y, x)
    wide = torch.zeros(40, 2, device=x.device)
    _copy_launch(x, wide[:, 0])  # a strided output: only its column is written, the gaps keep zeros
    assert torch.equal(wide[:, 0], x) and not wide[:, 1].any()
    inplace = x.clone()
    _copy_launch(inplace, inplace)  # one storage passed twice
    assert torch.equal(inplace, x)


@pytest.mark.conformance(kernel="guard", prop="catches_stray_writes")
def test_a_write_past_the_end_is_caught():
    x = torch.arange(40, dtype=torch.float32, device=kp_conformance.device())
    y = torch.zeros_like(x)
    with pytest.raises(GuardError, match=r"guard_test: kernel _copy: wrote 4 byte\(s\) outside argument 'Y'.*after"):
        _copy_launch(x, y, shift=1)


@pytest.mark.conformance(kernel="guard", prop="catches_stray_writes")
def test_a_write_into_a_gap_of_a_strided_view_is_caught():
    x = torch.arange(40, dtype=torch.float32, device=kp_conformance.device())
    wide = torch.zeros(40, 2, device=x.device)
    with pytest.raises(GuardError, match="in a gap of"):
        _copy_launch(x, wide[:, 0], shift=1)  # lands on wide[:, 1]
    assert not wide.any(), "a caught launch must not copy its stray bytes back"


@triton.jit
def _copy_tile(X, Y, BLOCK: tl.constexpr):
    """Y's first (BLOCK, BLOCK) tile = X's, through TMA tensor descriptors."""
    Y.store([0, 0], X.load([0, 0]))


@pytest.mark.conformance(kernel="guard", prop="catches_stray_writes")
def test_tensor_descriptors_are_guarded_like_pointers():
    """A descriptor's tensor is re-homed like a pointer's: a correct copy reaches the caller, and a descriptor
    claiming more rows than its tensor has writes past it and is caught."""
    descriptor = pytest.importorskip("triton.tools.tensor_descriptor", reason="Triton < 3.4").TensorDescriptor
    x = torch.arange(256, dtype=torch.float32, device=kp_conformance.device()).reshape(16, 16)
    y = torch.zeros_like(x)
    _launch(_copy_tile, (descriptor.from_tensor(x, [16, 16]), descriptor.from_tensor(y, [16, 16])), True, BLOCK=16)
    assert torch.equal(y, x)
    short = torch.zeros(8, 16, device=x.device)
    lying = descriptor(short, [16, 16], [16, 1], [16, 16])  # 16 rows claimed, 8 there
    with pytest.raises(GuardError, match=r"kernel _copy_tile: wrote .* outside argument 'Y'"):
        _launch(_copy_tile, (descriptor.from_tensor(x, [16, 16]), lying), True, BLOCK=16)


@triton.jit
def _copy_reading_past(X, Y, n, BLOCK: tl.constexpr):
    """Y[:n] = X[:n], loading all BLOCK lanes: the stray lanes never reach Y (the store is masked)."""
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i), mask=i < n)


@pytest.mark.conformance(kernel="guard", prop="catches_stray_reads")
def test_a_read_past_the_end_is_caught():
    x = torch.ones(40, dtype=torch.float32, device=kp_conformance.device())
    y = torch.zeros(1, device=x.device)
    if kp_conformance.interpreting():  # each load is checked as it runs
        with pytest.raises(GuardError, match=r"kernel _sum_unmasked: read 24 element\(s\) outside argument 'X'.*after"):
            _launch(_sum_unmasked, (x, y, 40), BLOCK=64)
    else:  # the GPU's loads are not seen: the canary (NaN) they read poisons the output
        _launch(_sum_unmasked, (x, y, 40), BLOCK=64)
        assert torch.isnan(y).all(), f"the stray read summed real memory: {y}"


@pytest.mark.conformance(kernel="guard", prop="catches_discarded_stray_reads")
def test_a_stray_read_that_reaches_no_output_is_caught():
    if not kp_conformance.interpreting():
        pytest.skip("not covered on GPU: loads are checked under the interpreter; kp_conformance.memcheck covers them")
    x = torch.ones(40, dtype=torch.float32, device=kp_conformance.device())
    y = torch.zeros_like(x)
    with pytest.raises(GuardError, match=r"kernel _copy_reading_past: read 24 element\(s\) outside argument 'X'"):
        _launch(_copy_reading_past, (x, y, 40), BLOCK=64)


@pytest.mark.conformance(kernel="guard", prop="catches_input_writes")
def test_a_call_that_writes_its_input_is_caught():
    def scale(x: torch.Tensor, out: torch.Tensor):
        x.mul_(2)
        return out

    x = torch.ones(8, device=kp_conformance.device())
    with pytest.raises(GuardError, match=r"op: the call wrote to its input 'x'.*flat index 0"):
        Guard().call("op", scale, (x, torch.empty(0)), ())
    Guard().call("op", scale, (x, torch.empty(0)), (0,))  # declared as mutated: allowed
