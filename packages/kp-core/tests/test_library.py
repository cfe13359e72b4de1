import torch

import kp_core


def _fake(x, factor):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.factor = inputs[1]


def _backward(ctx, grad):
    return _scale(grad, ctx.factor), None


@kp_core.custom_op(
    "kp_core_test::scale",
    package="kp-core-tests",
    spec="scale",
    dtypes=(torch.float32,),
    fake=_fake,
    backward=_backward,
    setup_context=_setup,
)
def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    kp_core.note_launch("kp_core_test::scale", "torch", kp_core.REFERENCE)
    return x * factor


def test_custom_op_registers_runs_and_differentiates():
    info = kp_core.registered_kernels()["kp_core_test::scale"]
    assert info.package == "kp-core-tests" and info.spec == "scale" and info.dtypes == (torch.float32,)
    x = torch.randn(5, requires_grad=True)
    with kp_core.record_launches() as rec:
        _scale(x, 3.0).sum().backward()
    assert rec.count(op="kp_core_test::scale") == 2  # forward and backward
    assert torch.equal(x.grad, torch.full((5,), 3.0))


def test_custom_op_passes_opcheck_and_compiles():
    x = torch.randn(4, 3, requires_grad=True)
    torch.library.opcheck(_scale, (x, 2.0))
    torch.library.opcheck(_scale, (x.t(), 2.0))
    compiled = torch.compile(lambda t: _scale(t, 2.0) + 1, fullgraph=True)
    assert torch.equal(compiled(x), x * 2 + 1)
