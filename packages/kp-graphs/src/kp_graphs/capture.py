"""One capture into a CUDA graph, and what a failed one means.

torch.cuda.graph's context manager leaves the process half in capture when the body fails: its capture_end
raises before it stops routing the stream's allocations to the pool and before the random-number generators
leave capture mode, and the current stream stays the capture stream. So a failed capture here is ended by hand,
those two steps are redone, and the error becomes a CaptureError that names the cause and the line: the one
that failed in the capture, or, when CUDA only refuses at the capture's end, the first line that synchronises in
one eager run with CUDA's sync check set to error.
"""

from __future__ import annotations

import gc
import os
import traceback

import torch


class CaptureError(RuntimeError):
    """The function cannot be captured into a CUDA graph; the message names the cause.

    Raised by a graphed callable's call that captures (a RuntimeError); the process stays usable afterwards.

    Examples:
        >>> import torch
        >>> import kp_graphs
        >>> g = kp_graphs.graphed(lambda x: x * x.sum().item(), buckets=[4])  # .item() syncs: needs a GPU
        >>> with torch.no_grad():
        ...     g(torch.randn(4, 8, device="cuda"))
        Traceback (most recent call last):
            ...
        kp_graphs.capture.CaptureError: ...host synchronisation...
    """


# What torch's errors during capture mean, by a phrase in them
_SYNC = (
    "a host synchronisation (.item(), .cpu(), print of a CUDA tensor, torch.nonzero, a data-dependent shape) "
    "or a blocking call during capture"
)
_CAUSES = (
    ("operation not permitted when stream is capturing", _SYNC),
    ("cudaErrorStreamCaptureUnsupported", _SYNC),
    ("cudaErrorStreamCaptureImplicit", "work on the legacy default stream during capture"),
    ("cudaErrorStreamCaptureInvalidated", "the capture was invalidated by a synchronisation or another stream"),
    ("previous error during capture", "the capture was invalidated by a synchronisation or another stream"),
    ("cudaErrorStreamCaptureIsolation", "work on another stream joined the capture without being forked from it"),
    ("capturable is False", "an optimizer built without capturable=True"),
    ("CUDAGeneratorImpl during CUDA graph capture", "a random-number generator made during capture"),
    ("current_seed during CUDA graph capture", "a random-number generator not registered with the graph"),
    ("generator expects graph capture to be underway", "a random-number generator not registered with the graph"),
    ("Attempt to increase offset for a CUDA generator not in capture mode", "a generator not registered"),
)
# frames of these folders are not the user's line
_INTERNAL = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


_STREAMS: dict = {}


def stream() -> torch.cuda.Stream:
    """The current device's stream for warmup and capture, one per process: cuBLAS keeps a workspace per stream
    (32 MiB on Hopper), made on a stream's first use; warming up on the capture stream makes it there, outside
    any graph, rather than inside the first capture's pool."""
    device = torch.cuda.current_device()
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream()
    return _STREAMS[device]


def warm_up(run, times: int) -> None:
    """run() `times` times on the warmup stream (lazy initialisation and autotuning happen there, not in the
    capture, as torch.cuda.make_graphed_callables does)."""
    side = stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(times):
            run()
    torch.cuda.current_stream().wait_stream(side)


def is_capture_error(err: BaseException) -> bool:
    """Whether err is CUDA refusing the capture (a bug of fn's own, a shape error say, is raised as it is)."""
    text = str(err)
    return any(phrase in text for phrase, _ in _CAUSES) or "captur" in text.lower()


def _cause(err: BaseException) -> str:
    for phrase, cause in _CAUSES:
        if phrase in str(err):
            return cause
    return "an operation that failed under capture"


def _end_failed(graph: torch.cuda.CUDAGraph, pool) -> None:
    """Undo what a failed capture_end skipped (module docstring); best effort, each step on its own."""
    try:
        graph.capture_end()  # ends the stream's capture; raises for an invalidated one
    except Exception:
        pass
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(
        torch._C, "_cuda_endAllocateCurrentStreamToPool", None
    )
    if end is not None:
        try:
            end(torch.cuda.current_device(), pool)
        except Exception:
            pass
    try:  # an empty capture takes the generators into capture mode and out again
        empty = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream()):
            empty.capture_begin()
            empty.capture_end()
    except Exception:
        pass


def _user_line(err: BaseException) -> str | None:
    """The innermost frame of err's traceback outside torch and kp_graphs: the caller's line that failed."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(_INTERNAL)]
    return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else None


def sync_line(fn, args, kwargs) -> str | None:
    """The user's line that synchronises with the host, from one eager run with the sync check set to error."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            fn(*args, **kwargs)
    except RuntimeError as err:
        return _user_line(err)
    finally:
        torch.cuda.set_sync_debug_mode(before)
    return None


def kept_bytes(pool, outputs) -> int:
    """Bytes allocated in `pool` beyond the storages of `outputs` (the live graphs' static outputs): what a
    function kept from its capture in a global, an attribute or a cache. Fast path: torch's exact check; only
    when it fails, a memory snapshot says how much."""
    expected = {t.untyped_storage().data_ptr() for t in outputs}
    device = torch.cuda.current_device()
    if torch._C._cuda_checkPoolLiveAllocations(device, pool, expected):
        return 0
    gc.collect()  # a dead tensor not yet collected is no leak
    extra = 0
    for segment in torch.cuda.memory._snapshot()["segments"]:
        if tuple(segment.get("segment_pool_id", ())) != tuple(pool):
            continue
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and address not in expected:
                extra += block["size"]
            address += block["size"]
    return extra


def capture(graph: torch.cuda.CUDAGraph, pool, body, name: str, where: str, rerun=None):
    """body() captured into graph (allocations from pool) on a side stream; its result. CaptureError on
    CUDA's refusal, the process left usable; rerun=(fn, args, kwargs) locates a synchronising line."""
    torch.cuda.synchronize()  # as torch.cuda.graph: nothing of the warmup still running into the capture
    torch.clear_autocast_cache()  # casts cached by the warmup would be read, not captured, and go stale
    line = None
    with torch.cuda.stream(stream()):
        graph.capture_begin(pool=pool)
        try:
            out = body()
        except Exception as err:
            _end_failed(graph, pool)
            failed = err
            line = _user_line(err)  # the line that failed in the capture itself
        else:
            try:
                graph.capture_end()
                return out
            except Exception as err:
                _end_failed(graph, pool)
                failed = err
    if not is_capture_error(failed):
        raise failed
    cause = _cause(failed)
    if line is None and rerun is not None and (cause == _SYNC or "invalidated" in cause):
        line = sync_line(*rerun)  # the capture failed at its end: the first line that syncs in an eager run
    first = str(failed).splitlines()[0] if str(failed) else ""
    raise CaptureError(
        f"graphed {name}: cannot capture {where}: {cause} ({type(failed).__name__}: {first})"
        + (f"; at {line}" if line else "")
        + "; run it eagerly or move that operation out"
    ) from failed
