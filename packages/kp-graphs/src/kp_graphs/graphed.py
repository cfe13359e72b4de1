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

import time
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from kp_graphs import stats as stats_mod
from kp_graphs.autograd import TrainGraph
from kp_graphs.buckets import Buckets, fill_into, pad_to, trim


class CaptureError(RuntimeError):
    """The function cannot be captured into a CUDA graph; the message names the cause."""


# What torch's errors during capture mean, by a phrase in them
_CAUSES = (
    (
        "operation not permitted when stream is capturing",
        "a host synchronisation (.item(), .cpu(), print of a "
        "CUDA tensor, torch.nonzero, a data-dependent shape) or a blocking call during capture",
    ),
    ("cudaErrorStreamCaptureUnsupported", "a host synchronisation or an operation CUDA cannot capture"),
    ("cudaErrorStreamCaptureInvalidated", "the capture was invalidated by a synchronisation or another stream"),
    (
        "Cannot call CUDAGeneratorImpl::current_seed during CUDA graph capture",
        "a random-number generator not registered with the graph",
    ),
    ("CUDA generator expects graph capture to be underway", "a random-number generator not registered with the graph"),
)


def _is_capture_error(err: BaseException) -> bool:
    """Whether err is CUDA refusing the capture (a bug of fn's own, a shape error say, is raised as it is)."""
    text = str(err)
    return any(phrase in text for phrase, _ in _CAUSES) or "captur" in text.lower()


def _explain(err: BaseException) -> str:
    text = str(err)
    for phrase, cause in _CAUSES:
        if phrase in text:
            return cause
    return "an operation that failed under capture"


class Graphed:
    def __init__(self, fn, buckets, pad, pool, warmup, copy_outputs, name):
        if not callable(fn):
            raise TypeError(f"graphed: fn must be callable, got {type(fn).__name__}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 1:
            raise ValueError(f"graphed: warmup must be an int >= 1 (the runs before capture), got {warmup!r}")
        if not isinstance(pad, (int, float)) or isinstance(pad, bool):
            raise TypeError(f"graphed: pad must be a number (the padding's value), got {pad!r}")
        self.fn = fn
        self.buckets = Buckets(buckets)
        self.pad = pad
        self.pool = pool
        self.warmup = warmup
        self.copy_outputs = copy_outputs
        self.stats = stats_mod.Stats(name or getattr(fn, "__name__", type(fn).__name__))
        self._graphs: dict = {}
        self._state = self._module_state()
        self._warned: set = set()
        stats_mod.register(self)

    # ---- what a call is ----

    def _module_state(self):
        """The identity, storage, shape and dtype of a module's parameters and buffers: a graph reads them at
        the addresses it was captured with, so a replaced or resized one makes every graph stale."""
        if not isinstance(self.fn, torch.nn.Module):
            return None
        named = [*self.fn.named_parameters(), *self.fn.named_buffers()]
        return tuple((n, id(t), t.data_ptr(), tuple(t.shape), t.dtype, t.requires_grad) for n, t in named)

    def _eager(self, reason: str, detail: str, args, kwargs):
        """Run fn as called, counted under `reason`; a warning the first time per reason."""
        self.stats.count_eager(reason)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"graphed {self.stats.name}: running eagerly: {reason} ({detail})", stacklevel=3)
        return self.fn(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [(f"#{i}", t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        if not tensors:
            raise ValueError("graphed: a call needs at least one tensor input (the buckets are read from them)")
        actual = self.buckets.actual(tensors)
        bucket = self.buckets.choose(actual)
        if bucket is None:
            detail = f"sizes {actual}, the largest bucket {self.buckets.largest()}; warned once"
            return self._eager("sizes beyond the largest bucket", detail, args, kwargs)
        state = self._module_state()
        training = torch.is_grad_enabled() and (
            any(t.requires_grad for _, t in tensors) or any(s[-1] for s in state or ())
        )
        dims = self.buckets.dims
        key = (bucket, spec, training, tuple(self._signature(x, dims) for x in leaves))
        if not all(t.is_cuda for _, t in tensors) or not torch.cuda.is_available():
            # the same padding and cutting back as a replay, run eagerly (CPU, or tensors off the GPU); padding
            # and slicing are differentiable, so autograd sees the same computation a graph would run
            self.stats.count_eager("not on a CUDA device")  # counted, not warned: CPU runs are expected (CI)
            padded = [pad_to(x, dims, bucket, self.pad) if isinstance(x, torch.Tensor) else x for x in leaves]
            p_args, p_kwargs = tree_unflatten(padded, spec)
            out = self.fn(*p_args, **p_kwargs)
            return tree_map(lambda o: trim(o, dims, bucket, actual) if isinstance(o, torch.Tensor) else o, out)
        if state != self._state:
            self._graphs.clear()
            self.stats.invalidations += 1
            self._state = state
        if training:
            graph = self._graphs.get(key)
            if graph is not None and graph.busy():
                detail = "its graphs hold one step; run the first call's backward before the next forward"
                return self._eager("a forward of a bucket whose previous backward has not run", detail, args, kwargs)
            if graph is None:
                graph = self._graphs[key] = self._timed_capture(bucket, lambda: self._train_graph(leaves, spec, bucket))
            self.stats.replays[bucket] = self.stats.replays.get(bucket, 0) + 1
            return graph(leaves, actual)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture(leaves, spec, bucket)
        graph, static_in, static_out = entry
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                fill_into(static_in[i], x, self.pad)
        graph.replay()
        self.stats.replays[bucket] = self.stats.replays.get(bucket, 0) + 1

        def back(o):
            if not isinstance(o, torch.Tensor):
                return o
            o = trim(o, dims, bucket, actual)
            return o.clone() if self.copy_outputs else o

        return tree_map(back, static_out)

    @staticmethod
    def _signature(x, dims):
        if isinstance(x, torch.Tensor):
            shape = tuple(-1 if d in dims else n for d, n in enumerate(x.shape))
            return ("tensor", x.dtype, x.device, shape, x.requires_grad)
        try:
            hash(x)
        except TypeError:
            raise TypeError(f"graphed: non-tensor arguments must be hashable (they key graphs), got {x!r}") from None
        return ("value", type(x), x)

    # ---- capture ----

    def _timed_capture(self, bucket, capture):
        """capture() with the pool made on first use, the time and pool growth counted, and torch's capture
        errors turned into CaptureError naming the cause."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        start, before = time.perf_counter(), torch.cuda.memory_allocated()
        try:
            made = capture()
        except CaptureError:
            raise
        except Exception as err:
            if not _is_capture_error(err):
                raise
            raise CaptureError(
                f"graphed {self.stats.name}: cannot capture bucket {bucket}: {_explain(err)} ({type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}); run it eagerly or move that operation out"
            ) from err
        torch.cuda.synchronize()
        self.stats.captures += 1
        self.stats.capture_seconds += time.perf_counter() - start
        self.stats.pool_bytes = max(self.stats.pool_bytes, torch.cuda.memory_allocated() - before)
        return made

    def _capture(self, leaves, spec, bucket):
        def capture():
            dims = self.buckets.dims
            static_in = [
                pad_to(x, dims, bucket, self.pad).clone() if isinstance(x, torch.Tensor) else x for x in leaves
            ]
            s_args, s_kwargs = tree_unflatten(static_in, spec)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                for _ in range(self.warmup):
                    self.fn(*s_args, **s_kwargs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
                static_out = self.fn(*s_args, **s_kwargs)
            return graph, static_in, static_out

        return self._timed_capture(bucket, capture)

    def _train_graph(self, leaves, spec, bucket):
        params = [p for p in self.fn.parameters() if p.requires_grad] if isinstance(self.fn, torch.nn.Module) else []
        return TrainGraph(self.fn, leaves, spec, bucket, self.buckets.dims, self.pad, self.pool, self.warmup, params)

    def capture_all(self, *example_args, **example_kwargs):
        """Capture every bucket now, largest first (so the smaller graphs reuse the largest one's pool memory),
        from an example call whose tensors are padded up to each bucket."""
        leaves, spec = tree_flatten((example_args, example_kwargs))
        dims = self.buckets.dims
        combos = [()]
        for d in dims:
            combos = [c + (s,) for c in combos for s in self.buckets.sizes[d]]
        for bucket in sorted(combos, reverse=True):
            shaped = []
            for x in leaves:
                if isinstance(x, torch.Tensor):
                    idx = tuple(
                        slice(0, min(n, bucket[dims.index(d)])) if d in dims else slice(None)
                        for d, n in enumerate(x.shape)
                    )
                    x = pad_to(x[idx], dims, bucket, self.pad)
                shaped.append(x)
            a, k = tree_unflatten(shaped, spec)
            self(*a, **k)


def graphed(fn, *, buckets, pad=0, pool=None, warmup: int = 3, copy_outputs: bool = True, name=None) -> Graphed:
    """fn (a function or nn.Module of tensors) replayed from one CUDA graph per shape bucket (module docstring).

    buckets: sizes of dimension 0 of every tensor input, or {dim: sizes}. pad: the value padding fills.
    pool: a graph memory pool to share (torch.cuda.graph_pool_handle()); by default one per callable.
    copy_outputs: return copies (True) or views of the graph's static outputs, which the next replay
    overwrites (False: faster, for callers that consume each output before the next call).
    """
    return Graphed(fn, buckets, pad, pool, warmup, copy_outputs, name)
