"""kp.optimize and kp.check: per layer of the user's model, each applicable kp candidate is checked against a
float64 copy of that layer (the user's weights, the layer's own inputs from the example batch) and timed against
PyTorch's own; the fastest checked one replaces the layer when it is faster by `min_speedup`. Then the whole step
is timed with and without the replacements, and replacements are undone, least useful first, until the step is
faster than PyTorch's by min_speedup. Between the two, fusions across packages (kp.fusions) join a chosen kp norm
to the float8 layers that read its output, where that is bit for bit the same and faster. Last, in training on a
GPU, the whole model replayed from CUDA graphs is checked and timed against the eager step (kp.graphs)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from fnmatch import fnmatch

import torch
from torch import nn

import kp_attention
import kp_core
from kp import cache as disk
from kp import fusions, graphs, loss_site
from kp.candidates import ATTENTION, ATTENTION_BACKEND, Candidate, candidates, kind_of
from kp.env import environment
from kp.measure import (
    WHOLE_STEP,
    Float64,
    Inputs,
    Timer,
    default_timer,
    floats,
    step,
    timer_name,
    trainable,
    upstream,
    whole_step,
)
from kp.measure import check as check_layer
from kp.report import Layer, Report, Tried
from kp.sites import Site, capture

MODES = ("train", "infer")
_UNDO = "_kp_optimize_undo"  # on the model: (name, how to undo it), in the order they were done
ATTENTION_LAYERS = "attention (every layer)"


def _arguments(fn: str, model, example_inputs, mode, allow, deny, loss_budget, rows) -> tuple:
    kp_core.check_module(f"kp.{fn}", "model", model)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        raise TypeError(
            f"kp.{fn}: example_inputs must be a tensor or a tuple of the model's positional arguments, "
            f"got {type(example_inputs).__name__}"
        )
    if mode not in MODES:
        raise ValueError(f"kp.{fn}: mode must be 'train' or 'infer', got {mode!r}")
    for name, value in (("allow", allow), ("deny", deny)):
        if value is not None and (isinstance(value, str) or not all(isinstance(v, str) for v in value)):
            raise TypeError(
                f"kp.{fn}: {name} must be a list of name patterns (candidates, families or layers), got {value!r}"
            )
    if not isinstance(loss_budget, (int, float)) or isinstance(loss_budget, bool) or not loss_budget > 0:
        raise ValueError(f"kp.{fn}: loss_budget must be a number > 0 (a relative error), got {loss_budget!r}")
    if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
        raise ValueError(f"kp.{fn}: check_rows must be an int >= 1, got {rows!r}")
    return tuple(example_inputs)


def _allowed(names: Iterable[str], allow: Iterable[str] | None, deny: Iterable[str] | None) -> bool:
    """Whether allow / deny leave in what these names (a candidate's, its family's, its layer's) name."""
    if deny and any(fnmatch(n, p) for p in deny for n in names):
        return False
    return allow is None or any(fnmatch(n, p) for p in allow for n in names)


def _sites(model: nn.Module, example_inputs: tuple, mode: str, allow, deny) -> list[tuple[Site, list[Candidate]]]:
    """The layers kp has a candidate for that `allow` and `deny` leave in, each with those candidates."""
    kinds = {}
    for name, module in model.named_modules():
        kind = kind_of(module) if name else None
        if kind is not None:
            kinds[name] = kind
    out = []
    for site in capture(model, example_inputs, kinds):
        if mode == "train":  # a causal LM's head: its loss is the site (kp_losses), in place of the bare linear
            site = loss_site.site(model, site, example_inputs) or site
        cands = [c for c in candidates(site.kind, mode) if _allowed((c.name, c.family, site.name), allow, deny)]
        if cands:
            out.append((site, cands))
    return out


def _short(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _timed(site: Site, module: nn.Module, mode: str, label: str, timer: Timer) -> tuple[float, float | None]:
    inputs = Inputs.of(site, mode)
    grads = None
    if mode == "train":
        with torch.no_grad():
            grads = upstream(floats(site.module(*inputs.args, **inputs.kwargs)))
    run = step(module, inputs, mode, trainable(site.module), grads)
    ms = timer(site.name, label, run)
    peak = None
    if torch.cuda.is_available() and any(t.is_cuda for t in inputs.grad_of + floats(inputs.args)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return ms, peak


def _cached(times: dict, name: str) -> tuple | None:
    """A cached [ms, peak MiB], or None when absent or not of that shape (a file from another kp version)."""
    entry = times.get(name)
    ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], (int, float)) and entry[0] > 0
    return tuple(entry) if ok else None


def _checked(site: Site, c: Candidate, mode: str, budget: float, rows: int) -> tuple[nn.Module | None, Tried | str]:
    """(the candidate's module, its check's worst line) when it passes; else (None, a Tried saying why not)."""
    try:
        new = c.build(site.module)
        verdict = check_layer(site, new, mode, c.lossy, budget, rows)
    except Exception as e:  # a candidate that cannot serve this layer here (shape, dtype, device)
        return None, Tried(c.name, "not applicable", note=_short(e))
    if not verdict.ok:
        return None, Tried(c.name, "refused", error=verdict.detail)
    return new, verdict.detail


def _layer(site, cands, mode, timer, times, budget, min_speedup, rows) -> tuple[Layer, dict, dict]:
    """Check and time every candidate on one layer. Returns the report's row, the modules that passed their
    check, and the times (candidate -> [ms, peak MiB], None for one refused or not applicable; `times` holds the
    cached ones; None as timer: check only). With every time cached, only the candidate to be chosen is checked."""
    times = dict(times)
    torch_ms = torch_peak = None
    if timer is not None:
        torch_ms, torch_peak = _cached(times, "torch") or _timed(site, site.module, mode, "torch", timer)
        times["torch"] = [torch_ms, torch_peak]
    # attention is decided for the whole model from every layer's check: always checked
    known = all(c.name in times and (times[c.name] is None or _cached(times, c.name)) for c in cands)
    if timer is not None and site.kind != "attention" and known:
        layer, passed = _layer_from_cache(site, cands, mode, times, budget, min_speedup, rows, torch_ms)
        layer.torch_peak_mib = torch_peak
        return layer, passed, times
    tried, passed = [], {}
    for c in cands:
        new, detail = _checked(site, c, mode, budget, rows)
        if new is None:
            tried.append(detail)
            times[c.name] = None
            continue
        ms = peak = None
        if timer is not None:
            ms, peak = _cached(times, c.name) or _timed(site, new, mode, c.name, timer)
            times[c.name] = [ms, peak]
        tried.append(Tried(c.name, "checked" if timer is None else "slower", ms, peak, detail))
        passed[c.name] = new
    choice, why = "torch", "no candidate passed its check" if not passed else "checked only (kp.check)"
    timed = [t for t in tried if t.name in passed and t.ms is not None]
    if timed:
        best = min(timed, key=lambda t: t.ms)
        speedup = torch_ms / best.ms
        if speedup >= min_speedup:
            best.status, choice, why = "chosen", best.name, f"{best.name} {speedup:.2f}x torch"
        else:
            why = f"fastest checked: {best.name} {speedup:.2f}x, below {min_speedup:.2f}x: kept torch"
    return Layer(site.name, site.kind, torch_ms, tried, choice, why, torch_peak_mib=torch_peak), passed, times


def _layer_from_cache(site, cands, mode, times, budget, min_speedup, rows, torch_ms) -> tuple[Layer, dict]:
    """A layer whose every time is cached: the candidates fast enough to be chosen are checked, fastest first,
    until one passes (the weights may have changed since); the others are listed with their cached times."""
    fast_first = sorted((c for c in cands if _cached(times, c.name)), key=lambda c: _cached(times, c.name)[0])
    tried, passed, choice, why = [], {}, "torch", "no candidate passed its check when measured"
    for c in fast_first:
        ms, peak = _cached(times, c.name)
        speedup = torch_ms / ms
        if choice != "torch" or speedup < min_speedup:
            why = why if choice != "torch" else f"fastest checked: {c.name} {speedup:.2f}x, below {min_speedup:.2f}x"
            tried.append(Tried(c.name, "slower", ms, peak, note="cached time, not checked again"))
            continue
        new, detail = _checked(site, c, mode, budget, rows)
        if new is None:
            detail.ms, detail.peak_mib = ms, peak
            tried.append(detail)
            continue
        tried.append(Tried(c.name, "chosen", ms, peak, detail))
        passed[c.name], choice, why = new, c.name, f"{c.name} {speedup:.2f}x torch"
    for c in cands:
        if times[c.name] is None:
            tried.append(Tried(c.name, "refused", note="refused or not applicable when measured, not checked again"))
    return Layer(site.name, site.kind, torch_ms, tried, choice, why), passed


@dataclasses.dataclass
class Swap:
    """One decision to apply: a layer's module replaced, or the model's attention implementation switched."""

    name: str
    depth: int  # outer layers are applied first: inner ones then land in the new outer module, which holds them
    gain_ms: float  # the layer's (or all attention layers') measured gain over PyTorch's
    apply: Callable[[nn.Module, list], None]  # (model, undo): does it, appending (name, how to undo it) to undo
    family: str = ""  # the chosen candidate's ("norms", "float8", ...): a compiling timer's reverts go by family


def _module_swap(site: Site, new: nn.Module, gain_ms: float, family: str) -> Swap:
    def apply(model: nn.Module, undo: list) -> None:
        # wherever the module is: every name of a shared module, and inside an already replaced outer module
        for name, module in list(model.named_modules(remove_duplicate=False)):
            if module is site.module and name:
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                previous = parent._modules[child]
                parent._modules[child] = new
                undo.append((name, lambda p=parent, c=child, m=previous: p._modules.__setitem__(c, m)))

    return Swap(site.name, site.name.count("."), gain_ms, apply, family)


def _attention_switch(gain_ms: float, backend: str) -> Swap:
    def apply(model: nn.Module, undo: list) -> None:
        root = next(m for m in model.modules() if hasattr(m, "set_attn_implementation"))
        kp_attention.patch(root, backend=backend)  # the implementation kp.optimize measured (Switched's)
        undo.append((ATTENTION_LAYERS, lambda: kp_attention.unpatch(root)))

    return Swap(ATTENTION_LAYERS, -1, gain_ms, apply, "attention")


def restore(model: nn.Module) -> list[str]:
    """Undo what kp.optimize changed in `model`; returns the layers put back (the same module objects).

    Examples:
        >>> import torch
        >>> import kp
        >>> norm = torch.nn.RMSNorm(64)
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), norm)
        >>> report = kp.optimize(model, (torch.randn(8, 64),), report=False)
        >>> restored = kp.restore(model)  # the names of the layers it had changed
        >>> model[1] is norm, kp.restore(model)
        (True, [])
    """
    kp_core.check_module("kp.restore", "model", model)
    undo = model.__dict__.pop(_UNDO, [])
    for _, fn in reversed(undo):
        fn()
    return [name for name, _ in undo]


def _apply(model: nn.Module, swaps: list[Swap]) -> None:
    restore(model)
    undo: list = []
    for swap in sorted(swaps, key=lambda s: s.depth):
        swap.apply(model, undo)
    object.__setattr__(model, _UNDO, undo)  # a plain attribute: not a child, not in state_dict


def optimize(
    model: nn.Module,
    example_inputs,
    *,
    mode: str = "train",
    allow: Iterable[str] | None = None,
    deny: Iterable[str] | None = None,
    cache: bool = True,
    report: bool = True,
    loss_budget: float = 0.1,
    min_speedup: float = 1.03,
    timer: Timer | None = None,
    check_rows: int = 1024,
) -> Report:
    """Make `model` faster in place with kp's kernels where they are faster on this GPU and correct on this model;
    return what was done and why (kp.restore(model) undoes it).

    example_inputs: the model's positional arguments for a representative batch (its shapes are what is timed).
    mode "train": forward and backward are timed and checked (gradients too); "infer": forward only.
    allow / deny: fnmatch patterns over candidate names ("float8 rowwise"), families ("norms", "glu", "float8",
    "sparsity", "losses", "graphs": the whole model from CUDA graphs, kp.graphs) and layer names
    ("model.layers.0.*"); deny wins. loss_budget: the relative error (L2, against float64) that a candidate
    changing the layer's function (float8, 2:4) may have in each output and gradient; lossless candidates must meet
    kp's conformance rule instead.
    min_speedup: how much faster a candidate must be to replace PyTorch's layer, and kp's whole step PyTorch's.
    timer(layer, candidate, fn) -> ms replaces the built-in timing (CUDA events around each call, the host's launch
    cost included); kp.graph_timer times the GPU's work alone, for a model that will be compiled or run from CUDA
    graphs; kp.compiled_timer() also compiles the whole step for the never-slower check, so that kp's layers are
    weighed against what torch.compile makes of PyTorch's; kp.rank0_timer(timer) makes every rank choose alike.
    check_rows: rows of each layer's input used for the float64 check. cache: reuse the times measured for the
    same layers, versions and GPU (file: kp.cache.path()); on a hit only the candidate about to be chosen is
    checked again. report: print the report's table.

    example_inputs are what the model takes (tensors of any dtype it computes in); every layer is checked on
    them against float64, and in "train" mode the model's float outputs are summed for the backward.

    In "train" mode a Hugging Face causal LM whose loss kp_losses can fuse (kp_losses.patchable; its token ids
    the first example input) has a site "<lm_head> + loss" (family "losses") in place of its lm_head: the head and
    transformers' causal-LM loss on the batch's ids shifted by one, checked and timed against
    kp_losses.fused_linear_cross_entropy; chosen, the model is patched (kp_losses.patch), so that its training calls
    with labels never make the logits. The whole-step check runs the model without labels: it does not see that
    site's gain, which stands on the site's own timing.

    Examples:
        >>> import torch
        >>> import kp
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
        >>> report = kp.optimize(model, (torch.randn(8, 64),), report=False)  # in place
        >>> [(layer.name, layer.kind) for layer in report.layers]
        [('0', 'linear'), ('1', 'rms_norm')]
        >>> changed = report.chosen  # layer -> candidate kept: on a GPU, where kp's layer was faster
        >>> undone = kp.restore(model)
    """
    start = time.perf_counter()
    example_inputs = _arguments("optimize", model, example_inputs, mode, allow, deny, loss_budget, check_rows)
    if not isinstance(min_speedup, (int, float)) or min_speedup < 1:
        raise ValueError(f"kp.optimize: min_speedup must be a number >= 1, got {min_speedup!r}")
    if timer is not None and not callable(timer):
        raise TypeError(f"kp.optimize: timer must be callable(layer, candidate, fn) -> ms, got {timer!r}")
    if cache and getattr(timer, "collective", False):
        raise ValueError(
            "kp.optimize: a collective timer (kp.rank0_timer) needs cache=False: a rank's cache hit would skip a "
            "timing the other ranks make"
        )
    timer = timer or default_timer
    restore(model)
    env = environment()
    result = Report(mode, env)
    cached = disk.load() if cache else {}
    fresh, swaps, attention, inputs_of = {}, [], [], {}
    for site, cands in _sites(model, example_inputs, mode, allow, deny):
        if site.kind in ("rms_norm", "layer_norm", "gated_mlp") and site.args:
            inputs_of[site.name] = site.args[0]
        key = disk.key(env, f"{mode} {timer_name(timer)}", site.signature(), [c.name for c in cands])
        layer, passed, times = _layer(
            site, cands, mode, timer, cached.get(key, {}), loss_budget, min_speedup, check_rows
        )
        layer.cached = key in cached
        fresh[key] = times
        result.layers.append(layer)
        if site.kind == "attention":
            attention.append(layer)
        elif layer.choice != "torch":
            gain = layer.torch_ms - next(t.ms for t in layer.tried if t.name == layer.choice)
            family = next(c.family for c in cands if c.name == layer.choice)
            if site.kind == loss_site.KIND:  # the model patched (kp_losses), not a module swapped
                apply = functools.partial(loss_site.apply, name=site.name, float8=passed[layer.choice].float8)
                swaps.append(Swap(site.name, -1, gain, apply, family))
            else:
                swaps.append(_module_swap(site, passed[layer.choice], gain, family))
    if attention:
        swaps += _attention(attention, min_speedup)
    if swaps and _allowed(("fusion",), allow, deny):
        swaps += _fusions(model, example_inputs, swaps, inputs_of, timer, min_speedup, result)
    if swaps:
        swaps = _never_slower(model, example_inputs, mode, timer, min_speedup, swaps, result)
    if _allowed((graphs.CANDIDATE, graphs.FAMILY, graphs.SITE), allow, deny):
        swaps += _graphs(model, example_inputs, mode, timer, min_speedup, swaps, cached, fresh, env, result)
    if cache and fresh:
        disk.store(fresh)
    result.seconds = time.perf_counter() - start
    if report:
        print(result.text())
    return result


FUSION = "fused float8 cast"


def _graphs(model, example_inputs, mode, timer, min_speedup, swaps, cached, fresh, env, result) -> list[Swap]:
    """With the kept swaps in place (as _never_slower leaves them), the whole training step replayed from CUDA
    graphs (kp.graphs), where it is offered; its row is "(whole model)". Returns the swap that installs it, when
    chosen."""
    if graphs.unavailable(example_inputs, mode, timer) is not None:  # not offered here: no row
        return []
    key = disk.key(env, f"{mode} {timer_name(timer)}", graphs.signature(model, example_inputs), [graphs.CANDIDATE])
    eager_ms = result.step["kp_ms"] if result.step else None  # _never_slower timed this very step
    layer, graphed, fresh[key] = graphs.decide(
        model,
        example_inputs,
        timer,
        min_speedup,
        cached.get(key, {}),
        eager_ms,
        reference=lambda: _float64_step(model, example_inputs, swaps),
    )
    layer.cached = key in cached
    result.layers.append(layer)
    if graphed is None:
        return []
    gain = layer.torch_ms - layer.tried[0].ms
    swap = Swap(
        graphs.SITE, 10**6, gain, lambda m, undo: graphs.install(m, graphed, len(example_inputs), undo), graphs.FAMILY
    )
    _apply(model, [*swaps, swap])
    return [swap]


def _float64_step(model: nn.Module, example_inputs: tuple, swaps: list[Swap]) -> list[torch.Tensor | None]:
    """The training step of the model with PyTorch's own layers (kp's choices undone on a float64 copy), in
    float64: its outputs, then a gradient per trainable parameter of the model as it is now, matched by identity
    (None for one of kp's own that the original lacks), the order of kp.graphs' results."""
    order = trainable(model)
    graphed = graphs.uninstall(model)  # kp.graphs' replaying forward, if installed: not copied
    restore(model)
    try:
        originals = {id(p): i for i, p in enumerate(trainable(model))}
        reference = copy.deepcopy(model).to(torch.float64)
    finally:
        _apply(model, swaps)
        if graphed is not None:
            model.__dict__["forward"] = graphed
    inputs = tuple(a.to(torch.float64) if torch.is_tensor(a) and a.is_floating_point() else a for a in example_inputs)
    with Float64():
        outs, grads = whole_step(reference, inputs, "train")()
    del reference
    return [o.detach() for o in outs] + [grads[originals[id(p)]] if id(p) in originals else None for p in order]


def _fusions(model, example_inputs, swaps, inputs_of, timer, min_speedup, result) -> list[Swap]:
    """With the chosen swaps in place, each kp norm that only float8 layers of one recipe read, and each kp gated
    MLP with a float8 down projection, is checked fused (kp.fusions.check: bit for bit) and timed against the
    unfused forward (a norm: with the casts its readers make); the fused one is kept when faster by min_speedup.
    Its row in the report is "<module> -> float8"."""
    _apply(model, swaps)
    try:
        found = fusions.fusable(model, example_inputs)
    finally:
        restore(model)
    out = []
    for f in found:
        x = inputs_of.get(f.name)
        if x is None:
            continue
        name = f"{f.name} -> float8"
        refused = fusions.check(f, x)
        if refused is not None:
            tried = [Tried(FUSION, "refused", error=refused)]
            result.layers.append(Layer(name, "fusion", None, tried, "torch", f"kept unfused: {refused}"))
            continue
        unfused = f"unfused, {len(f.readers)} float8 {f.granularity} reader(s)"
        unfused_ms = timer(name, unfused, fusions.unfused_run(f, x))
        fused_ms = timer(name, FUSION, fusions.fused_run(f.fused(), x))
        speedup = unfused_ms / fused_ms
        readers = ", ".join(r.rpartition(".")[2] for r in f.readers)
        tried = [Tried(FUSION, "slower", fused_ms, note=f"read by {readers}")]
        choice, why = "torch", f"{FUSION} {speedup:.2f}x, below {min_speedup:.2f}x: kept unfused"
        if speedup >= min_speedup:
            tried[0].status, choice, why = "chosen", FUSION, f"{FUSION} {speedup:.2f}x the unfused forward"
            out.append(_fusion_swap(f, name, unfused_ms - fused_ms))
        result.layers.append(Layer(name, "fusion", unfused_ms, tried, choice, why))
    return out


def _fusion_swap(f: fusions.Fusable, name: str, gain_ms: float) -> Swap:
    """The fused module replaces f.module after every other swap inside it (a depth below its children's), built
    then, so that it holds the children the other swaps chose (an MLP's float8 projections)."""

    def apply(model: nn.Module, undo: list) -> None:
        _module_swap(Site(f.name, f.module, "fusion"), f.fused(), gain_ms, "fusion").apply(model, undo)

    return Swap(name, f.name.count(".") + 1.5, gain_ms, apply, "fusion")


def _attention(layers: list[Layer], min_speedup: float) -> list[Swap]:
    """The attention implementation is the model's (one config for every layer): of the attention candidates that
    passed their check on every attention layer, the one with the least summed time is chosen where it beats
    PyTorch's summed time by min_speedup."""
    torch_total = sum(layer.torch_ms for layer in layers)
    totals, failed = {}, {}
    for c in ATTENTION:
        ms = [next((t.ms for t in layer.tried if t.name == c.name and t.ms is not None), None) for layer in layers]
        tried = any(t.name == c.name for layer in layers for t in layer.tried)
        bad = [layer.name for layer, m in zip(layers, ms) if m is None]
        if tried and bad:
            failed[c.name] = bad
        elif tried:
            totals[c.name] = sum(ms)
    best = min(totals, key=totals.get) if totals else None
    chosen = best is not None and torch_total / totals[best] >= min_speedup
    speeds = [f"{name} {torch_total / total:.2f}x" for name, total in sorted(totals.items(), key=lambda i: i[1])]
    whys = [f"{', '.join(speeds)} over the {len(layers)} attention layers"] if speeds else []
    whys += [f"{name} not usable on {', '.join(bad)}" for name, bad in failed.items()]
    verdict = f"{best} chosen for" if chosen else f"below {min_speedup:.2f}x: kept torch in"
    why = f"{'; '.join(whys)}: {verdict} every layer (one setting per model)"
    for layer in layers:
        for t in layer.tried:
            if t.name in totals and t.status in ("chosen", "slower"):
                t.status = "chosen" if chosen and t.name == best else "slower"
        layer.choice, layer.why = (best if chosen else "torch"), why
    if not chosen:
        return []
    return [_attention_switch(torch_total - totals[best], ATTENTION_BACKEND[best])]


def _never_slower(model, example_inputs, mode, timer, min_speedup, swaps: list[Swap], result: Report) -> list[Swap]:
    """Time the whole step with PyTorch's layers and with kp's; undo the least useful swap (with a compiling
    timer, kp.compiled_timer: the least useful family of swaps) until kp's step is faster by min_speedup, as a
    layer must be: a change within the timings' noise is not kept (nothing is, if none is left). Returns the swaps
    kept (in place in the model)."""
    run = whole_step(model, example_inputs, mode)
    torch_ms = timer(WHOLE_STEP, "torch", run)
    _apply(model, swaps)
    kp_ms = timer(WHOLE_STEP, "kp", run)
    by_family = getattr(timer, "compiles", False)
    if not by_family:  # (a compiling timer's timing is a compile each: one round)
        # a second round, each side keeping its least: the first timing of a step can pay one-off work (lazy
        # initialisation, cuDNN's plan for a new shape) and a host-bound step (a decode step) drifts between calls
        restore(model)
        torch_ms = min(torch_ms, timer(WHOLE_STEP, "torch", run))
        _apply(model, swaps)
        kp_ms = min(kp_ms, timer(WHOLE_STEP, "kp", run))
    reverted, undone = [], []
    while swaps and kp_ms * min_speedup > torch_ms:
        units: dict[str, list[Swap]] = {}
        for s in swaps:
            units.setdefault(s.family if by_family else s.name, []).append(s)
        unit = min(units, key=lambda u: sum(s.gain_ms for s in units[u]))
        gone = {id(s) for s in units[unit]}
        swaps = [s for s in swaps if id(s) not in gone]
        reverted += [s.name for s in units[unit]]
        undone.append(unit)
        _apply(model, swaps)
        kp_ms = timer(WHOLE_STEP, f"kp without {', '.join(undone)}", run)
    result.step = {"torch_ms": torch_ms, "kp_ms": kp_ms, "reverted": reverted}
    for layer in result.layers:
        unit = ATTENTION_LAYERS if layer.kind == "attention" else layer.name
        if unit in reverted and layer.choice != "torch":
            for t in layer.tried:
                if t.name == layer.choice:
                    t.status = "reverted"
            layer.why = f"{layer.why}; reverted: the whole step was not {min_speedup:.2f}x faster with it"
            layer.choice = "torch"
    return swaps


def check(
    model: nn.Module,
    example_inputs,
    *,
    mode: str = "train",
    allow: Iterable[str] | None = None,
    deny: Iterable[str] | None = None,
    loss_budget: float = 0.1,
    check_rows: int = 1024,
    report: bool = True,
) -> Report:
    """kp.optimize's checks alone: every candidate on every layer against float64, nothing timed, the model left
    as it is. A candidate's row says "checked" (it passes), "refused" (with its error) or "not applicable".

    The arguments are kp.optimize's.

    Examples:
        >>> import torch
        >>> import kp
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
        >>> report = kp.check(model, (torch.randn(8, 64),), report=False)
        >>> [(t.name, t.status) for t in report.layers[1].tried]  # the RMSNorm: kp's passes the rule
        [('kp_norms.RMSNorm', 'checked')]
        >>> [t.name for t in report.layers[0].tried]  # the Linear: float8 candidates, within loss_budget or refused
        ['float8 tensorwise', 'float8 rowwise']
    """
    start = time.perf_counter()
    example_inputs = _arguments("check", model, example_inputs, mode, allow, deny, loss_budget, check_rows)
    result = Report(mode, environment(), action="check")
    for site, cands in _sites(model, example_inputs, mode, allow, deny):
        result.layers.append(_layer(site, cands, mode, None, {}, loss_budget, 1.0, check_rows)[0])
    result.seconds = time.perf_counter() - start
    if report:
        print(result.text())
    return result
