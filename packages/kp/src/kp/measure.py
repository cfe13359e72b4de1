"""Running one layer the way a step does, timing it, and checking it against a float64 copy of the original."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

import kp_core
from kp.sites import Site

# timer(site name, candidate name, fn) -> milliseconds per call of fn. kp.optimize's `timer=` replaces the default
# (below) with any callable of this shape: a profiler's, or fixed numbers in a test.
Timer = Callable[[str, str, Callable[[], object]], float]


WHOLE_STEP = "(whole step)"  # the site name kp.optimize's never-slower check times the whole step under


def timer_name(timer: Timer) -> str:
    """What kp.optimize's cache keys times by (times taken by one timer are not served to another)."""
    return getattr(timer, "__qualname__", type(timer).__qualname__)


def default_timer(site: str, candidate: str, fn: Callable[[], object]) -> float:
    """kp_core.median_ms: CUDA events on a GPU, wall time elsewhere (there the figure only orders candidates).

    A timer: (layer name, candidate name, fn) -> ms, what kp.optimize's `timer` takes (its default).

    Examples:
        >>> import torch
        >>> import kp
        >>> x = torch.randn(256, 256)
        >>> kp.default_timer("model.layers.0.mlp", "torch", lambda: x @ x) > 0
        True
    """
    return kp_core.median_ms(fn)


def graph_timer(site: str, candidate: str, fn: Callable[[], object]) -> float:
    """The GPU's time for fn alone: fn captured in a CUDA graph and the replays timed as default_timer times calls.
    For a model that will run under torch.compile or CUDA graphs and keep the GPU busy, where the host's cost of
    launching each kernel (kp's ops are launched from Python) overlaps the GPU's work instead of adding to it;
    default_timer counts it. Falls back to default_timer off a GPU and when fn cannot be captured (a host sync
    inside, an op that cannot be captured), for that call only.

    Examples:
        >>> import torch
        >>> import kp
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
        >>> report = kp.optimize(model, (torch.randn(8, 64),), timer=kp.graph_timer, report=False)
        >>> kp.graph_timer("layer", "torch", lambda: model(torch.randn(8, 64))) > 0  # off a GPU: default_timer
        True
    """
    if not torch.cuda.is_available():
        return default_timer(site, candidate, fn)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture: lazy initialisation, autotuning, allocations
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        del graph
        torch.cuda.synchronize()
        return default_timer(site, candidate, fn)
    try:
        return default_timer(site, candidate, graph.replay)
    finally:
        del graph  # its memory pool back before the next candidate


def compiled_timer(timer: Timer | None = None, step_timer: Timer | None = None, **compile_options) -> Timer:
    """A timer for a model that will run under torch.compile: each layer alone is timed by `timer` (default
    graph_timer: compiling every candidate would cost a compile each), and the whole step (kp.optimize's
    never-slower check, with and without kp's layers) is compiled with torch.compile(**compile_options) and timed
    by `step_timer` (default default_timer: what the compiled step costs, the host's share included: dynamo's
    guards, which grow with the modules kp puts in, and inductor's launches or, with mode="reduce-overhead", one
    graph replay). So kp's layers are weighed against what inductor makes of PyTorch's, fusions and host costs
    included. Every whole-step timing compiles afresh, under its own code object: no entry of dynamo's cache is
    reused or counted against its recompile limit. kp.optimize undoes its choices family by family with this timer
    (norms, glu, float8, ...), not layer by layer: each timing is a compile.

    Pass what it returns as kp.optimize's `timer`.

    Examples:
        >>> import kp
        >>> timer = kp.compiled_timer(mode="max-autotune-no-cudagraphs")
        >>> timer.__qualname__
        "compiled_timer(graph_timer, default_timer, mode='max-autotune-no-cudagraphs')"
    """
    inner, outer = timer or graph_timer, step_timer or default_timer
    for name, value in (("timer", inner), ("step_timer", outer)):
        if not callable(value):
            raise TypeError(f"kp.compiled_timer: {name} must be callable(layer, candidate, fn) -> ms, got {value!r}")

    def timed(site: str, candidate: str, fn: Callable[[], object]) -> float:
        if site != WHOLE_STEP:
            return inner(site, candidate, fn)

        def step():
            return fn()

        step.__code__ = step.__code__.replace()  # a new code object: a cache of dynamo's of its own
        return outer(site, candidate, torch.compile(step, **compile_options))

    options = "".join(f", {k}={v!r}" for k, v in sorted(compile_options.items()))
    timed.__qualname__ = f"compiled_timer({timer_name(inner)}, {timer_name(outer)}{options})"
    timed.compiles = True
    return timed


def rank0_timer(timer: Timer | None = None, group=None) -> Timer:
    """A timer for kp.optimize run on every rank of a job (torch.distributed initialised, the same model and
    example batch on each): every rank times fn with `timer` (default_timer) on its own device, and every rank
    takes rank 0's figure (a broadcast), so every rank makes the same choices and keeps the same model, as
    sharding it afterwards needs. Collective: kp.optimize refuses it with its disk cache on (a rank's cache hit
    would skip a timing the other ranks make).

    Examples:
        In a script started with `torchrun --nproc-per-node 2 train.py` (here two CPU processes, gloo), before
        sharding the model:

        >>> import torch
        >>> import torch.distributed as dist
        >>> import kp
        >>> dist.init_process_group("gloo")
        >>> _ = torch.manual_seed(0)  # the same model and batch on every rank
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
        >>> report = kp.optimize(model, (torch.randn(8, 64),), timer=kp.rank0_timer(), cache=False, report=False)
        >>> chosen = [report.chosen]
        >>> dist.broadcast_object_list(chosen, src=0)  # rank 0's choices
        >>> chosen[0] == report.chosen  # every rank chose alike
        True
    """
    import torch.distributed as dist

    inner = timer or default_timer

    def timed(site: str, candidate: str, fn: Callable[[], object]) -> float:
        ms = inner(site, candidate, fn)
        nccl = dist.get_backend(group) == "nccl"
        value = torch.tensor([ms], dtype=torch.float64, device="cuda" if nccl else "cpu")
        dist.broadcast(value, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return float(value.item())

    timed.__qualname__ = f"rank0_timer({timer_name(inner)})"
    timed.collective = True
    return timed


def floats(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


@dataclasses.dataclass
class Inputs:
    """A site's arguments for one kind of run: the first floating tensor argument (the activation) requires grad
    in training, as it does inside the model. For a cheaper float64 check, `rows` keeps that many leading rows
    of a layer that treats rows independently, or the batch's first sequence of an attention layer."""

    args: tuple
    kwargs: dict
    grad_of: list[torch.Tensor]  # the activation, when training

    @classmethod
    def of(cls, site: Site, mode: str, dtype: torch.dtype | None = None, rows: int | None = None) -> Inputs:
        def prepare(t):
            if not isinstance(t, torch.Tensor):
                return t
            if rows is not None and t.dim() >= 2:
                # rows of a per-row layer; for attention, the first sequence of the batch (and its mask)
                t = t.reshape(-1, t.shape[-1])[:rows] if site.per_row else t[:1]
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()

        args, kwargs = list(tree_map(prepare, site.args)), tree_map(prepare, site.kwargs)
        grad_of = []
        if mode == "train":  # the activation: the first floating tensor argument, by position or else by keyword
            for holder, key in [*((args, i) for i in range(len(args))), *((kwargs, k) for k in kwargs)]:
                if isinstance(holder[key], torch.Tensor) and holder[key].is_floating_point():
                    grad_of.append(holder[key].requires_grad_())
                    break
        return cls(tuple(args), kwargs, grad_of)


def step(module: nn.Module, inputs: Inputs, mode: str, params: list, grads: list | None = None) -> Callable:
    """The layer's share of a step: forward, and in training the gradients of its input and parameters for the
    upstream gradients `grads` (None: `upstream`'s, made per call). torch.autograd.grad leaves .grad alone."""
    wrt = [*inputs.grad_of, *params]

    def run():
        if mode == "infer":
            with torch.no_grad():
                return floats(module(*inputs.args, **inputs.kwargs)), []
        outs = floats(module(*inputs.args, **inputs.kwargs))
        return outs, list(torch.autograd.grad(outs, wrt, grads or upstream(outs), allow_unused=True))

    return run


def whole_step(model: nn.Module, example_inputs: tuple, mode: str) -> Callable:
    """The model's whole step as kp.optimize times it: in training, forward, the sum of the float outputs and its
    gradients with respect to the trainable parameters, returning (outputs, gradients); in inference, the
    forward without gradients."""
    params = trainable(model)

    def run():
        if mode == "infer":
            with torch.no_grad():
                return model(*example_inputs)
        outs = floats(model(*example_inputs))
        return outs, torch.autograd.grad(sum(t.float().sum() for t in outs), params, allow_unused=True)

    return run


def upstream(outs: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float32).to(o.device, o.dtype) for o in outs]


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def _float64(value):
    lower = isinstance(value, torch.dtype) and value.is_floating_point and value != torch.float64
    return torch.float64 if lower else value


class Float64(TorchFunctionMode):
    """The float64 reference run: a layer's own casts to a lower float precision stay in float64 (Hugging Face's
    RMSNorms compute in float32 whatever their input: a float64 copy of one would be only as exact as float32)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _CASTS and isinstance(args[0], torch.Tensor):  # integers too: a rotary's position ids
            return args[0].to(torch.float64)
        args = tuple(_float64(a) for a in args)
        return func(*args, **{k: _float64(v) for k, v in (kwargs or {}).items()})


_CASTS = (torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16)


@dataclasses.dataclass
class Check:
    ok: bool
    worst: float  # lossless: max error / the rule's bound; lossy: relative error / budget (ok when <= 1)
    detail: str


def _relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    ref_norm = ref.norm().item()
    return (a.to(torch.float64) - ref).norm().item() / ref_norm if ref_norm else float(a.abs().max().item() > 0)


def rule_ratio(ours: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor) -> tuple[float, float, float]:
    """(error / the conformance rule's bound, the error, the bound) of `ours` against the float64 `ref64`, the
    bound being twice `lowp`'s error plus an ulp; an error with a zero bound is infinitely over it."""
    err, bound = kp_core.rule_bound(ours, ref64, lowp, lowp.dtype)
    return (err / bound if bound else (0.0 if err == 0 else float("inf"))), err, bound


def check(site: Site, candidate: nn.Module, mode: str, lossy: bool, budget: float, rows: int) -> Check:
    """The candidate against a float64 copy of the original layer, on the site's own inputs (their first `rows`
    rows) and the layer's own weights: outputs and, in training, the input's and every parameter's gradient.
    Lossless candidates obey the rule (at most twice PyTorch's own error in the model's precision, plus an
    ulp); lossy ones (float8, 2:4) a relative error of at most `budget` in each of them."""
    ref_module = copy.deepcopy(site.module).to(torch.float64)
    inputs = Inputs.of(site, "infer", None, rows)
    with torch.no_grad():  # the upstream gradients, made outside Float64 (which would draw them in float64)
        grads = upstream(floats(site.module(*inputs.args, **inputs.kwargs))) if mode == "train" else None
    with Float64():
        grads64 = [g.to(torch.float64) for g in grads] if grads else None
        ref_in = Inputs.of(site, mode, torch.float64, rows)
        refs = step(ref_module, ref_in, mode, trainable(ref_module), grads64)()
    low = step(site.module, Inputs.of(site, mode, None, rows), mode, trainable(site.module), grads)()
    ours = step(candidate, Inputs.of(site, mode, None, rows), mode, trainable(site.module), grads)()
    names = [f"output {i}" for i in range(len(refs[0]))]
    if mode == "train":
        names += ["grad input"] * (len(refs[1]) - len(trainable(ref_module)))
        names += [f"grad {n}" for n, p in site.module.named_parameters() if p.requires_grad]
    worst, detail, ok = 0.0, "", True
    for name, ref, lowp, mine in zip(names, [*refs[0], *refs[1]], [*low[0], *low[1]], [*ours[0], *ours[1]]):
        if ref is None:
            continue
        if mine is None or mine.shape != ref.shape:
            got = "none" if mine is None else f"shape {tuple(mine.shape)}"
            return Check(False, float("inf"), f"{name}: {got}, the original's is {tuple(ref.shape)}")
        if lossy:
            rel, rel_torch = _relative(mine, ref), _relative(lowp, ref)
            ratio = rel / budget
            line = f"{name}: relative error {rel:.2e} (torch {rel_torch:.2e}, budget {budget:.0e})"
        else:
            ratio, err, bound = rule_ratio(mine, ref, lowp)
            line = f"{name}: error {err:.2e}, bound {bound:.2e} (2x torch's + 1 ulp)"
        if ratio > worst or not detail:
            worst, detail = ratio, line
        ok = ok and ratio <= 1.0
    return Check(ok, worst, detail)
