"""Shared setup for every spec: the device, the interpreter switch, Hypothesis tiers, the report plugin, and the
attention specs' backends."""

import os

# Off-GPU the kernels run under Triton's interpreter, which must be on before any kernel is defined.
if "TRITON_INTERPRET" not in os.environ and os.environ.get("KP_DEVICE", "") != "cuda":
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import kp_conformance  # noqa: E402
import kp_core  # noqa: E402

pytest_plugins = ["kp_conformance.plugin"]

kp_conformance.register_profiles()

# The specs check kp's kernels: kp_attention's backend="auto" (its default) must not hand a call to torch's SDPA.
kp_core.pin("attention_backend", backend="kp")

# Canary-guarded kernel arguments and checksummed op inputs for every spec (KP_GUARD=0: off).
kp_conformance.guard.install()

# Under compute-sanitizer (kp_conformance.memcheck sets KP_MEMCHECK=1, with the guard off): PyTorch's reference
# SDPA stays off cuDNN, whose fused attention kernel reads past a 10-byte allocation of its own under memcheck
# (torch 2.11, cuDNN 9, H100): a report about PyTorch, not about the kernels under test.
if os.environ.get("KP_MEMCHECK") == "1":
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


# The attention, varlen, SDPA and decode cells run once per implementation kp_attention routes to (its "auto"
# picks among them): kp's kernels, torch's cuDNN and FlashAttention-2 kernels, FlashAttention-4. Their cells are
# named "<kernel> [<backend>]" in the report (kp's keep the plain name); one not on this machine is not covered.
ATTENTION_BACKENDS = ("kp", "torch:cudnn", "torch:flash", "fa4")


@pytest.fixture(params=ATTENTION_BACKENDS)
def attention_backend(request):
    """The backend a test's kp_attention calls are pinned to (kp_core.pin("attention_backend")), or the test is
    not covered here, with the reason."""
    name = request.param
    why = None
    if name.startswith("torch") and kp_conformance.device().type != "cuda":
        why = "torch's fused SDPA kernels run on a CUDA device"
    elif name == "fa4":
        from kp_attention.ops import attention_fa4

        why = attention_fa4.unavailable(kp_conformance.device())
        why = why and f"FlashAttention-4: {why}"
    if why:
        pytest.skip(f"not covered: {why}")
    with kp_core.pinned("attention_backend", backend=name):
        yield name
