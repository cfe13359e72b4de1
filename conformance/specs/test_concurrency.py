"""Ops called from several threads at once (and, on CUDA, from several streams, and on two GPUs in one process)
give bit for bit the results of the same calls made one after another: kp-core's launch path, its caches (tuned
settings, compiled launchers, traced mods), its workspace and the guard hold under concurrency."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import kp_attention
import kp_conformance as kc
import kp_core
import kp_norms
import kp_precision

DEVICE = kc.device()
THREADS = 4

kc.declare(
    kc.Spec(
        name="concurrency",
        package="kp-conformance",
        ops=(),
        reference="the same calls made one after another, in one thread, on one stream",
        dtypes=(torch.float16, torch.float32),
        properties=("threads", "streams", "devices"),
    )
)


def _calls(device) -> list:
    """Calls over several kernels and shapes, each a function returning its tensors (forward, and backward for
    the norm, so autograd's engine runs beside the other threads)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, dtype=torch.float32):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype)

    calls = []
    for i in range(4):
        x, w, gy = r(3 + i, 64), r(64), r(3 + i, 64)

        def norm(x=x, w=w, gy=gy):
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = kp_norms.rms_norm(xl, (64,), wl)
            y.backward(gy)
            return y.detach(), xl.grad, wl.grad

        q = r(1, 8 + 4 * i, 2, 16, dtype=torch.float16)
        gate, up, a = r(2 + i, 32), r(2 + i, 32), r(4 + i, 32)
        calls += [
            norm,
            lambda gate=gate, up=up: (kp_norms.swiglu(gate, up),),
            lambda q=q: (kp_attention.flash_attention(q, q, q, causal=True),),
            lambda q=q: (kp_attention.flex_attention(*(t.transpose(1, 2) for t in (q, q, q))),),
            lambda a=a: (kp_precision.quantize(a, granularity="rowwise").data.view(torch.uint8),),
        ]
    return calls


def _same(serial, concurrent) -> None:
    for i, (a, b) in enumerate(zip(serial, concurrent)):
        assert b is not None, f"call {i} raised in its thread"
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"call {i}: the concurrent result differs"


def _in_threads(calls, run) -> list:
    results, errors = [None] * len(calls), []

    def work(mine):
        try:
            for k in mine:
                results[k] = run(k, calls[k])
        except BaseException as e:  # reported below: an exception in a thread would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=work, args=(range(t, len(calls), THREADS),)) for t in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@contextlib.contextmanager
def _unguarded():
    """Without the spec guard, which makes interpreted launches take turns: kp's own launch path alone."""
    previous = kp_core.set_guard(None)
    try:
        yield
    finally:
        kp_core.set_guard(previous)


@pytest.mark.conformance(kernel="concurrency", prop="threads")
@pytest.mark.parametrize("guarded", [True, False], ids=["guard", "kp_alone"])
def test_threads(guarded):
    calls = _calls(DEVICE)
    with kp_core.record_launches() as rec:
        serial = [c() for c in calls]
    kc.assert_kernel_ran(rec, "kp::norm", "kp::glu", "kp::flash_attention", "kp::flex_attention")
    with contextlib.nullcontext() if guarded else _unguarded():
        _same(serial, _in_threads(calls, lambda k, c: c()))


@pytest.mark.conformance(kernel="concurrency", prop="streams")
def test_streams():
    if DEVICE.type != "cuda" or kc.interpreting():
        pytest.skip("not covered: streams need CUDA (compiled kernels)")
    calls = _calls(DEVICE)
    serial = [c() for c in calls]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(DEVICE) for _ in range(THREADS)]

    def on_stream(k, c):
        with torch.cuda.stream(streams[k % THREADS]):
            out = c()
        streams[k % THREADS].synchronize()
        return out

    _same(serial, _in_threads(calls, on_stream))


@pytest.mark.conformance(kernel="concurrency", prop="devices")
def test_two_devices():
    if DEVICE.type != "cuda" or kc.interpreting() or torch.cuda.device_count() < 2:
        pytest.skip("not covered: needs two CUDA devices")
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    per_device = [_calls(d) for d in devices]
    serial = [[c() for c in calls] for calls in per_device]
    flat = [c for calls in per_device for c in calls]
    concurrent = _in_threads(flat, lambda k, c: c())
    _same([r for rs in serial for r in rs], concurrent)
