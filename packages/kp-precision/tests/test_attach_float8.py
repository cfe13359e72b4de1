"""attach_float8: a float8 layer takes the float8 copy made with its input instead of casting the input again,
only when the copy is the cast it would make, and never after the input changed or the copy's uses ran out."""

import pytest
import torch

import kp_core
import kp_precision

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCKS = {"tensorwise": (0, 0), "rowwise": (1, 0)}


def _casts(layer, x) -> tuple[torch.Tensor, int]:
    """The layer's output on x, and the kp::quantize launches it made."""
    with kp_core.record_launches() as record, torch.no_grad():
        y = layer(x)
    return y, sum(1 for launch in record.launches if launch.op == "kp::quantize")


def _copy(x, granularity, power_of_2=False):
    q = kp_precision.quantize(x, granularity=granularity, power_of_2=power_of_2)
    return kp_precision.Float8Tensor(q.data, q.scale, q.amax, BLOCKS[granularity])


def _layers(recipe):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32, bias=False, device=DEVICE)
    return (
        kp_precision.Float8Linear.from_linear(linear, config=kp_precision.Float8Config(recipe)),
        kp_precision.Float8InferenceLinear.from_linear(linear, recipe=recipe),
    )


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_layer_takes_the_copy_of_its_recipe_and_gives_the_same_output(recipe):
    x = torch.randn(2, 16, 64, device=DEVICE)
    for layer in _layers(recipe):
        plain, plain_casts = _casts(layer, x)
        pow2 = getattr(layer, "config", None) is not None and layer.config.pow2
        attached = kp_precision.attach_float8(x.clone(), _copy(x, recipe, pow2), power_of_2=pow2)
        y, casts = _casts(layer, attached)
        assert torch.equal(y, plain)
        # the input's cast is left out: one launch rowwise, two tensorwise (the amax, then the cast)
        assert plain_casts - casts == (2 if recipe == "tensorwise" else 1), (plain_casts, casts)


def test_a_copy_of_another_cast_a_changed_input_or_a_spent_copy_is_not_taken():
    layer = _layers("tensorwise")[0]
    x = torch.randn(32, 64, device=DEVICE)
    plain, full = _casts(layer, x)
    for granularity, pow2 in (("rowwise", False), ("tensorwise", True)):  # another granularity, power-of-two scales
        other = kp_precision.attach_float8(x.clone(), _copy(x, granularity, pow2), power_of_2=pow2)
        assert _casts(layer, other)[1] == full
    changed = kp_precision.attach_float8(x.clone(), _copy(x, "tensorwise"))
    changed.mul_(2.0)  # in place: the copy no longer is this tensor's
    y, casts = _casts(layer, changed)
    assert casts == full and torch.equal(y, _casts(layer, x * 2.0)[0])
    twice = kp_precision.attach_float8(x.clone(), _copy(x, "tensorwise"), uses=2)
    assert [_casts(layer, twice)[1] for _ in range(3)] == [full - 2, full - 2, full]
    assert torch.equal(_casts(layer, twice)[0], plain)


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        ((None,), {}, TypeError, "x must be a tensor"),
        ((torch.ones(4, 16),), dict(cast=(1, 2)), TypeError, "cast must be a tensorwise or rowwise"),
        ((torch.ones(4, 16),), dict(shape=(4, 8)), ValueError, "cast's data must have x's shape"),
        ((torch.ones(4, 16),), dict(uses=0), ValueError, "uses must be a positive int"),
    ],
)
def test_bad_arguments(args, kwargs, error, match):
    shape = kwargs.pop("shape", (4, 16))
    copy = kwargs.pop("cast", _copy(torch.ones(shape, device=DEVICE), "tensorwise"))
    with pytest.raises(error, match=match):
        kp_precision.attach_float8(*args, copy, **kwargs)
