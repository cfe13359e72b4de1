import os

# Without a GPU the kernels run under Triton's interpreter, which must be on before kp_attention imports.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import kp_core  # noqa: E402


@pytest.fixture(autouse=True)
def kp_kernels():
    """The tests check kp's kernels: backend="auto", the default, must not hand a call to torch's SDPA (the
    backend tests lift this pin)."""
    with kp_core.pinned("attention_backend", backend="kp"):
        yield


@pytest.fixture
def accepted(monkeypatch, tmp_path):
    """torch's SDPA may stand for every call (backend="auto"'s choice, unpinned), FlashAttention-4 for none;
    timings from a table: {"kp": ms, "torch": ms, "fa4": ms}; the names timed. Decisions go to a file of the
    test's own."""
    from kp_attention import backend
    from kp_attention.ops import attention_fa4

    times, timed = {"kp": 1.0, "torch": 2.0, "fa4": 3.0}, []

    def fake_timer(name, fn):
        fn()  # the call runs, as a real measurement's would
        timed.append(name)
        return times[name.rsplit(" ", 1)[1].split(":")[0]]

    monkeypatch.setenv("KP_CACHE_DIR", str(tmp_path))
    # torch's own pick of kernel on any device (its cuDNN and FlashAttention-2 kernels alone would turn down the
    # tiny float32 models and calls these tests make)
    monkeypatch.setattr(backend, "candidates", lambda device: ("kp", "torch", "fa4"))
    monkeypatch.setattr(backend, "torch_refuses", lambda *a, **kw: None)
    monkeypatch.setattr(attention_fa4, "refuses", lambda *a, **kw: "left out by the test")
    monkeypatch.setattr(backend, "timer", fake_timer)
    backend.forget()
    kp_core.unpin("attention_backend")  # kp_kernels pins "kp" for every other test
    yield times, timed
    backend.forget()
