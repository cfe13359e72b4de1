"""graphed(): one CUDA graph per shape bucket, inputs padded up to the bucket, outputs cut back.

Per bucket (and per input signature: dtypes, devices, the shapes' other dimensions, non-tensor arguments) the
first call captures a graph: static input buffers of the bucket's shape, `warmup` eager runs on a side stream
(as torch.cuda.make_graphed_callables does, so lazy initialisation and autotuning happen outside the capture),
then the capture into a memory pool every bucket of this callable shares. Later calls copy their inputs into the
static buffers (the padding filled with `pad`), replay, and return the outputs cut back to the call's sizes.
Calls outside every bucket run eagerly, counted per reason (a warning once per reason). Calls whose tensors
are not on a GPU are counted too, without a warning, and their eager run still pads and cuts back, so the bucket
logic is the same everywhere. Under autograd each bucket gets a forward and a backward graph instead
(kp_graphs.autograd).
"""

from __future__ import annotations

import logging
import time
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from kp_graphs import stats as stats_mod
from kp_graphs.autograd import TrainGraph
from kp_graphs.buckets import Buckets, fill_into, pad_to, trim, unflatten
from kp_graphs.capture import CaptureError, capture, kept_bytes, warm_up

__all__ = ["CaptureError", "Graphed", "graphed"]

_LOG = logging.getLogger("kp.graphs")


# Parameters, buffers or submodules registered anywhere in the process (a module attribute replaced) since
# import: while the count stands still, a graphed module's tensors can only have changed storage (.data = ...,
# .to()), which the per-call check of data pointers sees. A full look at the module runs only when it moves.
_REGISTRATIONS = [0]
_HOOKED = []


def _count_registration(*_):
    _REGISTRATIONS[0] += 1


def _watch_registrations() -> None:
    if not _HOOKED:
        m = torch.nn.modules.module
        m.register_module_parameter_registration_hook(_count_registration)
        m.register_module_buffer_registration_hook(_count_registration)
        m.register_module_module_registration_hook(_count_registration)
        _HOOKED.append(True)


# torch's C++ check of a list of data pointers (CUDA builds): the per-call stale check of a large model in ~1 us
_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


class Graphed:
    """What kp_graphs.graphed returns: call it as fn is called (see graphed's docstring); `.stats` counts
    captures, replays per bucket and eager fallbacks.

    Made by `kp_graphs.graphed(fn, ...)`, whose arguments it keeps as attributes (fn, buckets, pad, pool, warmup,
    copy_outputs, training_step).

    Examples:
        >>> import torch
        >>> import kp_graphs
        >>> g = kp_graphs.graphed(torch.nn.Linear(64, 64), buckets=[8, 16], name="proj")
        >>> g(torch.randn(5, 64)).shape  # a CPU tensor: run eagerly (padded to 8 and cut back), and counted
        torch.Size([5, 64])
        >>> g.stats.calls, g.stats.eager
        (1, {'not on a CUDA device': 1})
    """

    def __init__(self, fn, buckets, pad, pool, warmup, copy_outputs, name, training_step=False):
        if not callable(fn):
            raise TypeError(f"graphed: fn must be callable, got {type(fn).__name__}")
        for arg, flag in (("copy_outputs", copy_outputs), ("training_step", training_step)):
            if not isinstance(flag, bool):  # kp-graphs needs no kp-core: its own check
                raise TypeError(f"graphed: {arg} must be a bool, got {flag!r}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"graphed: warmup must be an int >= 1 (the runs before capture), got {warmup!r}")
        if not _is_number(pad) and not (isinstance(pad, (tuple, list)) and all(_is_number(p) for p in pad)):
            raise TypeError(f"graphed: pad must be a number or a tuple of one per positional argument, got {pad!r}")
        self.training_step = bool(training_step)
        self.fn = fn
        self.buckets = Buckets(buckets)
        self.pad = pad
        self.pool = pool
        self.warmup = warmup
        self.copy_outputs = copy_outputs
        self.stats = stats_mod.Stats(name or getattr(fn, "__name__", type(fn).__name__))
        self._graphs: dict = {}
        self._retired: list = []
        self._warm: dict = {}  # key -> a training step's warmup calls so far
        self._own_pool = False  # a pool given by the caller may hold other callables' graphs
        self._tensors, self._ptrs, self._params, self._indices, self._seen = [], [], [], [], 0
        if isinstance(fn, torch.nn.Module):
            _watch_registrations()
        self._state = self._module_state()
        self._warned: set = set()
        stats_mod.register(self)

    # ---- what a call is ----

    def _module_state(self):
        """The identity, storage, shape and dtype of a module's parameters and buffers: a graph reads them at
        the addresses it was captured with, so a replaced or resized one makes every graph stale."""
        if not isinstance(self.fn, torch.nn.Module):
            return None
        self._seen = _REGISTRATIONS[0]
        params = list(self.fn.named_parameters())
        named = [*params, *self.fn.named_buffers()]
        self._params = [t for _, t in params]
        self._tensors = [t for _, t in named]
        self._ptrs = [t.data_ptr() for t in self._tensors]
        self._indices = list(range(len(self._tensors)))
        return tuple((n, id(t), t.data_ptr(), tuple(t.shape), t.dtype) for n, t in named)

    def _stale(self) -> bool:
        """Whether the module's tensors moved since the graphs were captured (then the state is renewed)."""
        if self._state is None:
            return False
        if self._seen == _REGISTRATIONS[0]:
            if _PTRS_EQUAL is not None:
                if _PTRS_EQUAL(self._tensors, self._ptrs, self._indices):
                    return False
            elif [t.data_ptr() for t in self._tensors] == self._ptrs:
                return False
        state = self._module_state()
        if state == self._state:
            return False
        self._state = state
        return True

    def _eager(self, reason: str, detail: str, args, kwargs):
        """Run fn as called, counted under `reason`; a warning the first time per reason."""
        self.stats.count_eager(reason)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"graphed {self.stats.name}: running eagerly: {reason} ({detail})", stacklevel=3)
            _LOG.warning("graphed %s: running eagerly: %s (%s)", self.stats.name, reason, detail)
        return self.fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            leaves, spec = args, len(args)  # the common call, without pytree's cost (~5 us)
        else:
            leaves, spec = tree_flatten((args, kwargs))
        cuda = [isinstance(x, torch.Tensor) and x.is_cuda for x in leaves]
        if not any(isinstance(x, torch.Tensor) for x in leaves):
            raise ValueError("graphed: a call needs at least one tensor input (the buckets are read from them)")
        actual = self.buckets.actual(leaves)
        bucket = self.buckets.choose(actual)
        if bucket is None:
            detail = f"sizes {actual}, the largest bucket {self.buckets.largest()}"
            return self._eager("sizes beyond the largest bucket", detail, args, kwargs)
        dims = self.buckets.dims
        signature = [self._signature(x, dims) for x in leaves]
        if not any(cuda) or not torch.cuda.is_available():
            # the same padding and cutting back as a replay, run eagerly (CPU tensors, or no CUDA); padding and
            # slicing are differentiable, so autograd sees the same computation a graph would run
            self.stats.count_eager("not on a CUDA device")  # counted, not warned: CPU runs are expected (CI)
            if self.stats.eager["not on a CUDA device"] == 1:  # said once, in kp-graphs' log
                _LOG.info("graphed %s: CPU inputs (or no CUDA): runs eagerly, no graphs", self.stats.name)
            p_args, p_kwargs = unflatten(self._padded(leaves, self._pads(args, kwargs, len(leaves)), bucket), spec)
            out = self.fn(*p_args, **p_kwargs)
            return tree_map(lambda o: trim(o, dims, bucket, actual) if isinstance(o, torch.Tensor) else o, out)
        if not all(c for c, x in zip(cuda, leaves) if isinstance(x, torch.Tensor)):
            detail = "a graph reads its inputs from GPU memory; move the tensor to the GPU first"
            return self._eager("a CPU tensor among CUDA inputs", detail, args, kwargs)
        device = next(x for x in leaves if isinstance(x, torch.Tensor)).get_device()
        if device != torch.cuda.current_device():  # capture and replay on the inputs' GPU, with its stream
            with torch.cuda.device(device):
                return self(*args, **kwargs)
        if self._stale():
            self._retired = list(self._graphs.values())  # alive until the next capture: the pool stays in use
            self._graphs.clear()
            self._warm.clear()
            self.stats.invalidations += 1
        training = (
            not self.training_step
            and torch.is_grad_enabled()
            and (
                any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)
                or any(p.requires_grad for p in self._params)
            )
        )
        key = (bucket, spec, training, *signature)
        if training:
            graph = self._graphs.get(key)
            if graph is not None and graph.busy():
                detail = "its graphs hold one step; run the first call's backward before the next forward"
                return self._eager("a forward of a bucket whose previous backward has not run", detail, args, kwargs)
            if graph is None:
                pads = self._pads(args, kwargs, len(leaves))
                graph = self._graphs[key] = self._timed_capture(
                    bucket, lambda: self._train_graph(leaves, spec, bucket, pads)
                )
            self.stats.replays[bucket] = self.stats.replays.get(bucket, 0) + 1
            return graph(leaves, actual)
        entry = self._graphs.get(key)
        if entry is None:
            pads = self._pads(args, kwargs, len(leaves))
            if self.training_step and self._warm.get(key, 0) < self.warmup:
                # a whole step's warmup runs are the calls' own steps, on their padded batches: training takes no
                # step an eager loop would not, and the capture comes at the bucket's call warmup + 1
                self._warm[key] = self._warm.get(key, 0) + 1
                self.stats.count_eager("warming up a training step's bucket")  # counted, not warned: expected
                p_args, p_kwargs = unflatten(self._padded(leaves, pads, bucket), spec)
                out = []
                with torch.enable_grad():
                    warm_up(lambda: out.append(self.fn(*p_args, **p_kwargs)), 1)
                return tree_map(
                    lambda o: trim(o.detach(), dims, bucket, actual) if isinstance(o, torch.Tensor) else o, out[0]
                )
            entry = self._graphs[key] = self._capture(leaves, spec, bucket, pads)
        graph, static_in, static_out, pads = entry
        for s, x, p in zip(static_in, leaves, pads):
            if isinstance(x, torch.Tensor):
                if s.shape == x.shape:
                    s.copy_(x)
                else:
                    fill_into(s, x, p)
        graph.replay()
        self.stats.replays[bucket] = self.stats.replays.get(bucket, 0) + 1
        if isinstance(static_out, torch.Tensor):
            out = static_out if actual == bucket else trim(static_out, dims, bucket, actual)
            return out.clone() if self.copy_outputs else out

        def back(o):
            if not isinstance(o, torch.Tensor):
                return o
            o = trim(o, dims, bucket, actual)
            return o.clone() if self.copy_outputs else o

        return tree_map(back, static_out)

    @staticmethod
    def _signature(x, dims):
        if isinstance(x, torch.Tensor):
            shape = x.shape if not dims else tuple(-1 if d in dims else n for d, n in enumerate(x.shape))
            return (x.dtype, x.device, shape, x.requires_grad)
        try:
            hash(x)
        except TypeError:
            raise TypeError(f"graphed: non-tensor arguments must be hashable (they key graphs), got {x!r}") from None
        return (type(x), x)

    # ---- capture ----

    def _timed_capture(self, bucket, make):
        """make() with the pool made on first use and the time and pool growth counted."""
        if self.pool is None:
            self.pool, self._own_pool = torch.cuda.graph_pool_handle(), True
        start, before = time.perf_counter(), torch.cuda.memory_allocated()
        made = make()
        torch.cuda.synchronize()
        self._retired = []
        self.stats.captured[bucket] = self.stats.captured.get(bucket, 0) + 1
        self.stats.capture_seconds += time.perf_counter() - start
        self.stats.pool_bytes = max(self.stats.pool_bytes, torch.cuda.memory_allocated() - before)
        return made

    def _pads(self, args, kwargs, n_leaves) -> list:
        """The padding value of each flattened input: pad, or pad[i] for every tensor of positional argument i
        (keyword arguments' tensors get 0)."""
        if _is_number(self.pad):
            return [self.pad] * n_leaves
        if len(self.pad) != len(args):
            raise ValueError(
                f"graphed: pad has {len(self.pad)} values, one per positional argument, but the call has {len(args)}"
            )
        pads = []
        for a, p in zip(args, self.pad):
            pads += [p] * (1 if isinstance(a, torch.Tensor) else len(tree_flatten(a)[0]))
        return pads + [0] * (n_leaves - len(pads))

    def _padded(self, leaves, pads, bucket) -> list:
        """The flattened inputs with each tensor padded up to the bucket (a tensor that fits is itself)."""
        dims = self.buckets.dims
        return [pad_to(x, dims, bucket, p) if isinstance(x, torch.Tensor) else x for x, p in zip(leaves, pads)]

    def _capture(self, leaves, spec, bucket, pads):
        def make():
            static_in = [x.clone() if isinstance(x, torch.Tensor) else x for x in self._padded(leaves, pads, bucket)]
            s_args, s_kwargs = unflatten(static_in, spec)
            # a whole training step runs its own backward: captured with grad on; anything else without
            # (its warmup ran as the bucket's first calls, and no diagnostic rerun: that would be one more step)
            mode = torch.enable_grad if self.training_step else torch.no_grad
            if not self.training_step:
                with mode():
                    warm_up(lambda: self.fn(*s_args, **s_kwargs), self.warmup)
            graph = torch.cuda.CUDAGraph()
            with mode():
                static_out = capture(
                    graph,
                    self.pool,
                    lambda: self.fn(*s_args, **s_kwargs),
                    self.stats.name,
                    f"bucket {bucket}",
                    rerun=None if self.training_step else (self.fn, s_args, s_kwargs),
                )
            static_out = tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, static_out)
            if self._own_pool and not self.training_step:  # (a step's gradients are its graph's own, by design)
                self._check_pool(static_out, bucket)
            return graph, static_in, static_out, pads

        return self._timed_capture(bucket, make)

    def _check_pool(self, new_out, bucket) -> None:
        """CaptureError when fn kept a tensor allocated during capture beyond its outputs: it lives in the pool,
        where another bucket's capture may reuse the memory and its replay overwrite it."""
        outputs = [o for o in tree_flatten(new_out)[0] if isinstance(o, torch.Tensor)]
        for entry in [*self._graphs.values(), *self._retired]:
            if isinstance(entry, tuple):
                outputs += [o for o in tree_flatten(entry[2])[0] if isinstance(o, torch.Tensor)]
        extra = kept_bytes(self.pool, outputs)
        if extra:
            raise CaptureError(
                f"graphed {self.stats.name}: cannot capture bucket {bucket}: fn keeps {extra} bytes allocated "
                "during capture beyond its outputs (a tensor stored in a global, an attribute or a cache); they "
                "live in the graph's pool, where another bucket's replay may overwrite them. Return the tensor, "
                "or allocate it before the first call"
            )

    def _train_graph(self, leaves, spec, bucket, pads):
        params = [p for p in self._params if p.requires_grad]
        return TrainGraph(
            self.fn, list(leaves), spec, bucket, self.buckets.dims, pads, self.warmup, params, self.stats.name
        )

    def capture_all(self, *example_args, **example_kwargs):
        """Capture every bucket now, largest first (so the smaller graphs reuse the largest one's pool memory),
        from an example call whose tensors are padded up to each bucket."""
        leaves, spec = tree_flatten((example_args, example_kwargs))
        pads = self._pads(example_args, example_kwargs, len(leaves))
        dims = self.buckets.dims
        combos = [()]
        for d in dims:
            combos = [c + (s,) for c in combos for s in self.buckets.sizes[d]]
        for bucket in sorted(combos, reverse=True):
            shaped = []
            for x, p in zip(leaves, pads):
                if isinstance(x, torch.Tensor):
                    idx = tuple(
                        slice(0, min(n, bucket[dims.index(d)])) if d in dims else slice(None)
                        for d, n in enumerate(x.shape)
                    )
                    x = pad_to(x[idx], dims, bucket, p)
                shaped.append(x)
            a, k = tree_unflatten(shaped, spec)
            self(*a, **k)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def graphed(
    fn,
    *,
    buckets,
    pad=0,
    pool=None,
    warmup: int = 3,
    copy_outputs: bool = True,
    name=None,
    training_step: bool = False,
) -> Graphed:
    """fn (a function or nn.Module of tensors) replayed from one CUDA graph per shape bucket (module docstring).

    buckets: sizes of dimension 0 of every tensor input, or {dim: sizes}. pad: the value padding fills, or a
    tuple of one value per positional argument (labels padded with an ignore index, say; keyword arguments'
    tensors get 0).
    pool: a graph memory pool to share (torch.cuda.graph_pool_handle()); by default one per callable.
    copy_outputs: return copies (True) or views of the graph's static outputs, which the next replay
    overwrites (False: faster, for callers that consume each output before the next call).
    training_step: fn is a whole training step (forward, its own backward, optimizer step with a capturable
    optimizer, grad scaler) captured as one graph per bucket with grad on; its outputs come back detached. A
    bucket's first `warmup` calls run the step eagerly (on their padded batches, on the warmup stream) and its
    next call captures it, so training takes exactly the steps it is called for.
    name: the name the stats and `kp_graphs.report()` show (fn's name by default).

    Tensor inputs may have any dtype; their bucketed dimension is padded up to the next bucket, and outputs with
    that dimension are cut back to the call's size. Graphs are captured and replayed on CUDA tensors only.

    Examples:
        >>> import torch
        >>> import kp_graphs
        >>> model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU()).cuda()  # needs a GPU
        >>> step = kp_graphs.graphed(model, buckets=[16, 32, 64])
        >>> with torch.no_grad():
        ...     y = step(torch.randn(20, 512, device="cuda"))  # captured for bucket 32, padded, cut back to 20
        ...     y = step(torch.randn(30, 512, device="cuda"))  # replayed
        >>> y.shape, step.stats.replays
        (torch.Size([30, 512]), {32: 2})
    """
    return Graphed(fn, buckets, pad, pool, warmup, copy_outputs, name, training_step)
