"""kp_precision.auto_filter: float8 only for the layers measured faster, one measurement per shape."""

import warnings

import pytest
import torch
from torch import nn

import kp_precision
from kp_precision import auto


def model(device=None, dtype=None):
    kw = dict(device=device, dtype=dtype)
    return nn.Sequential(
        nn.Linear(256, 512, bias=False, **kw),  # measured "fast" below
        nn.Linear(512, 256, bias=False, **kw),  # measured "slow"
        nn.Linear(256, 512, bias=False, **kw),  # same shape as the first: no second measurement
        nn.Linear(512, 40, **kw),  # not a multiple of 16: the conversion keeps it and says why
    )


def test_keeps_float8_where_it_was_measured_faster(monkeypatch):
    calls = []

    def fake(linear, config, tokens, compiled):
        calls.append((linear.in_features, linear.out_features, config.recipe, tokens, compiled))
        return (1.0, 0.5) if linear.in_features == 256 else (1.0, 0.99)  # 2x faster; 1 % faster

    monkeypatch.setattr(auto, "_on_gpu", lambda module: True)
    monkeypatch.setattr(auto, "_measure", fake)
    monkeypatch.setattr(auto, "_MEASURED", {})
    net = model()
    keep = kp_precision.auto_filter("rowwise", tokens=4096, min_speedup=1.05)
    with pytest.warns(UserWarning, match="3 \\(512 -> 40"):
        kp_precision.convert_to_float8_training(net, recipe="rowwise", module_filter_fn=keep)
    assert [type(m).__name__ for m in net] == ["Float8Linear", "Linear", "Float8Linear", "Linear"]
    assert calls == [(256, 512, "rowwise", 4096, True), (512, 256, "rowwise", 4096, True)]
    # "auto" is the same filter with the conversion's config; skip names layers never converted
    net = model()
    monkeypatch.setattr(auto, "_measure", lambda *a: (1.0, 0.5))
    monkeypatch.setattr(auto, "_MEASURED", {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kp_precision.convert_to_float8_training(net, module_filter_fn=kp_precision.auto_filter(skip="2"))
    assert [type(m).__name__ for m in net] == ["Float8Linear", "Float8Linear", "Linear", "Linear"]


def test_off_gpu_converts_nothing_and_says_so():
    net = model(device="cpu")
    with pytest.warns(UserWarning, match="measures on a CUDA device"):
        kp_precision.convert_to_float8_training(net, module_filter_fn="auto")
    assert all(type(m) is nn.Linear for m in net)


@pytest.mark.parametrize(
    "call,words",
    [
        (lambda: kp_precision.auto_filter(tokens=0), "tokens"),
        (lambda: kp_precision.auto_filter(min_speedup=0), "min_speedup"),
        (lambda: kp_precision.auto_filter("columnwise"), "recipe"),
        (lambda: kp_precision.convert_to_float8_training(model(), module_filter_fn="fast"), "'auto'"),
    ],
)
def test_bad_arguments(call, words):
    with pytest.raises(ValueError, match=words):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU only: the filter times float8 on a GPU")
def test_measured_on_the_gpu():
    """On a GPU both forms of each shape are timed on it, once, and each layer's fate follows its own timing.
    (Which one wins is a speed result: benchmarks/bench_float8_model.py reports it at model shapes; a unit test
    run beside other GPU tests cannot time reliably.)"""
    auto._MEASURED.clear()
    net = nn.Sequential(nn.Linear(4096, 8192, bias=False), nn.Linear(64, 64, bias=False)).cuda().bfloat16()
    kp_precision.convert_to_float8_training(net, module_filter_fn=kp_precision.auto_filter(tokens=8192))
    timings = {key[:2]: ms for key, ms in auto._MEASURED.items()}
    assert set(timings) == {(4096, 8192), (64, 64)}
    for layer, shape in zip(net, ((4096, 8192), (64, 64))):
        dense_ms, float8_ms = timings[shape]
        assert dense_ms > 0 and float8_ms > 0
        kept = float8_ms * 1.05 <= dense_ms
        assert type(layer).__name__ == ("Float8Linear" if kept else "Linear"), (shape, timings[shape])
