"""kp.optimize's last candidate: the whole training forward and backward replayed from CUDA graphs
(kp_graphs.graphed, one bucket: the example batch's size), with the layer choices already in place.

A graph replays the step's kernels with one launch, so it removes the host's cost of launching them, which bounds a
small model's eager step. It is checked against the eager step it replaces, run on the stream the graph is captured
on (outputs and gradients; mostly the same kernels, so they should agree to within the eager step's own run-to-run
spread, which is zero unless a kernel adds with atomics; where they do not, as when PyTorch's attention picks
another kernel or mask path while a stream captures, each must meet the conformance rule against a float64 step of
the original model instead), timed against it with the same timer, and kept when faster by
min_speedup. Not offered: off a GPU; in inference (a decode step's KV cache is state a graph would freeze:
kp_graphs' decode loops serve that); with a timer of the GPU's work alone (kp.graph_timer: a graph saves nothing it
counts); with a collective timer (a model sharded after kp.optimize is not graphed whole). The model's forward
becomes the graphed callable for calls shaped as the example batch (positional tensors; an instance attribute, which
kp.restore removes), and stays its own for any other call (keyword arguments, a KV cache); a call of another size
runs eagerly (kp_graphs counts it). A model that will be compiled afterwards should deny "graphs": each candidate is
timed eagerly.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import kp_graphs
from kp.measure import rule_ratio, timer_name, whole_step
from kp.report import Layer, Tried
from kp.sites import Site

CANDIDATE = "kp_graphs.graphed"
FAMILY = "graphs"
SITE = "(whole model)"


class _Forward(nn.Module):
    """The model's own forward as a module, so that kp_graphs finds its parameters (the model's forward attribute
    is then the graphed callable, which calls this)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return type(self.model).forward(self.model, *args, **kwargs)


def unavailable(example_inputs: tuple, mode: str, timer) -> str | None:
    """Why the candidate is not offered here, or None."""
    if mode != "train":
        return "training only: a decode step's KV cache is state a whole-model graph would freeze"
    if not any(getattr(a, "is_cuda", False) for a in example_inputs):
        return "CUDA graphs need the example inputs on a GPU"
    if "graph_timer" in timer_name(timer):
        return "timed by the GPU's work alone (graph_timer), where a graph saves nothing"
    if getattr(timer, "collective", False):
        return "a model sharded after kp.optimize (collective timer) is not graphed whole"
    return None


def build(model: nn.Module, example_inputs: tuple) -> kp_graphs.Graphed:
    batch = next(a for a in example_inputs if getattr(a, "dim", lambda: 0)() > 0).shape[0]
    return kp_graphs.graphed(_Forward(model), buckets=[batch], name=f"kp.optimize {type(model).__name__}")


def install(model: nn.Module, graphed, n_args: int, undo: list | None = None) -> None:
    """The model's forward becomes: the graphed callable for calls shaped as the example (n_args positional
    tensors, no keyword), its own forward for any other (generate's calls with a KV cache, labels=...)."""
    previous = model.__dict__.get("forward")  # an instance's own forward (kp_losses.patch's): kept under the graph
    own = previous or functools.partial(type(model).forward, model)

    def forward(*args, **kwargs):
        if kwargs or len(args) != n_args or not all(isinstance(a, torch.Tensor) for a in args):
            return own(*args, **kwargs)
        return graphed(*args)

    forward.previous = previous
    model.__dict__["forward"] = forward
    if undo is not None:
        undo.append((SITE, lambda: uninstall(model)))


def uninstall(model: nn.Module):
    """Take install's forward off the model (the instance forward it covered, if any, back in place); returns it,
    or None when it was not installed."""
    forward = model.__dict__.get("forward")
    if not hasattr(forward, "previous"):
        return None
    del model.__dict__["forward"]
    if forward.previous is not None:
        model.__dict__["forward"] = forward.previous
    return forward


def spread(a: list, b: list) -> list[float]:
    """Per tensor, the largest difference between two runs' results."""
    return [float((x.float() - y.float()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True)]


def signature(model: nn.Module, example_inputs: tuple) -> str:
    """What the decision depends on: the model with the layer choices in place (its repr names them), its
    parameters' and the inputs' shapes and dtypes."""
    return Site(SITE, model, FAMILY, example_inputs).signature()


def decide(
    model, example_inputs: tuple, timer, min_speedup: float, cached: dict, eager_ms=None, reference=None
) -> tuple:
    """(the report's row for the whole-model graph, the graphed callable when chosen else None, the times to
    cache: {"eager": [ms, None], CANDIDATE: [ms, None] or None}). eager_ms: the eager step's time when the
    caller has just taken it with this timer. With both times cached, an unchosen graph is not built again, and a
    chosen one is checked again but not timed. reference() -> the step's results in float64 (as _results orders
    them, None where there is none): when the graph's results are not eager's within its own spread (a library
    may pick another kernel while a stream captures: PyTorch's attention does), they must meet the conformance
    rule against it instead, at most twice the eager step's error plus an ulp."""
    run = whole_step(model, example_inputs, "train")
    ms = None
    if "eager" in cached and CANDIDATE in cached:
        if cached[CANDIDATE] is None:
            note = "refused or not applicable when measured, not checked again"
            return _row(cached["eager"][0], Tried(CANDIDATE, "refused", note=note), note), None, cached
        eager_ms, ms = cached["eager"][0], cached[CANDIDATE][0]
        if eager_ms / ms < min_speedup:
            why = f"{CANDIDATE} {eager_ms / ms:.2f}x the eager step, below {min_speedup:.2f}x: kept eager"
            tried = Tried(CANDIDATE, "slower", ms, note="cached time, not checked again")
            return _row(eager_ms, tried, why), None, cached
    times = {"eager": [eager_ms, None], CANDIDATE: None}
    try:
        if eager_ms is None:
            eager_ms = timer(SITE, "eager", run)
            times["eager"][0] = eager_ms
        eager = _on_capture_stream(run)
        noise = spread(eager, _on_capture_stream(run))
        graphed = build(model, example_inputs)
        install(model, graphed, len(example_inputs))
        try:
            for _ in range(graphed.warmup + 2):  # warm-up runs, the capture, then a replay
                got = _results(run)
            diff = spread(eager, got)
            bad = [(i, d, n) for i, (d, n) in enumerate(zip(diff, noise, strict=True)) if d > 2 * n]
            detail = (
                f"outputs and gradients within eager's own spread (largest difference {max(diff, default=0.0):.3g})"
            )
            rule = None  # the float64 verdict's line, when eager's spread was not enough
            if bad and reference is not None:
                meets, rule = _against_float64(eager, got, reference)
                if meets:
                    bad = []
                    detail = f"differs from eager by up to {max(diff):.3g}, within the rule against float64: {rule}"
            if bad:
                i, d, n = bad[0]
                uninstall(model)  # eager again, on the default stream, for the report only
                default = spread(eager, _results(run))[i]
                error = (
                    f"result {i} differs from eager's by {d:.3g} (eager's own run-to-run spread: {n:.3g}; eager on "
                    f"the default stream differs by {default:.3g})" + (f"; against float64, {rule}" if rule else "")
                )
                tried = Tried(CANDIDATE, "refused", error=error)
                return _row(eager_ms, tried, "the graphed step did not match eager"), None, times
            ms = ms or timer(SITE, CANDIDATE, run)
        finally:
            uninstall(model)
    except Exception as e:  # a model a graph cannot hold (a host sync inside, an op that cannot be captured)
        note = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return _row(eager_ms, Tried(CANDIDATE, "not applicable", note=note), note), None, times
    times[CANDIDATE] = [ms, None]
    speedup = eager_ms / ms
    tried = Tried(CANDIDATE, "slower", ms, note=detail)
    if speedup >= min_speedup:
        tried.status = "chosen"
        why = f"{CANDIDATE} {speedup:.2f}x the eager step"
        return _row(eager_ms, tried, why, CANDIDATE), graphed, times
    why = f"{CANDIDATE} {speedup:.2f}x the eager step, below {min_speedup:.2f}x: kept eager"
    return _row(eager_ms, tried, why), None, times


def _row(eager_ms: float | None, tried: Tried, why: str, choice: str = "torch") -> Layer:
    return Layer(SITE, FAMILY, eager_ms, [tried], choice, why)


def _on_capture_stream(run) -> list:
    """_results(run) computed on the stream kp_graphs captures on (the graph replays what ran there; a library
    may choose its kernels per stream), waited for by the current stream."""
    if not torch.cuda.is_available():
        return _results(run)
    out = []
    kp_graphs.capture.warm_up(lambda: out.extend(_results(run)), 1)
    for t in out:
        t.record_stream(torch.cuda.current_stream())  # read and freed on the current stream
    return out


def _results(run) -> list:
    """The step's float outputs and gradients, as detached copies (an empty tensor for a parameter's gradient that
    is None: every run lists the same parameters in the same places)."""
    outs, grads = run()
    none = torch.zeros(0)
    return [t.detach().clone() for t in (*outs, *(none if g is None else g for g in grads))]


def _against_float64(eager: list, got: list, reference) -> tuple[bool, str]:
    """Whether every result of the graph is within the rule's bound against the float64 step (2x the eager
    step's own error plus an ulp), and the worst result's line."""
    try:
        refs = reference()
    except torch.OutOfMemoryError:
        return False, "no memory for the float64 reference of the step"
    worst, line = -1.0, "no result to compare"
    for i, (low, ours, ref) in enumerate(zip(eager, got, refs, strict=True)):
        if ref is None or ours.numel() == 0:
            continue
        ratio, err, bound = rule_ratio(ours, ref, low)
        if ratio > worst:
            worst, line = ratio, f"result {i}: error {err:.3g}, bound {bound:.3g} (2x eager's + 1 ulp)"
    return 0 <= worst <= 1, line
