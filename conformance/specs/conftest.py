"""Shared setup for every spec: the device, the interpreter switch, Hypothesis tiers, the report plugin."""

import os

# Off-GPU the kernels run under Triton's interpreter, which must be on before any kernel is defined.
if "TRITON_INTERPRET" not in os.environ and os.environ.get("KP_DEVICE", "") != "cuda":
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import kp_conformance  # noqa: E402

pytest_plugins = ["kp_conformance.plugin"]

kp_conformance.register_profiles()

# Canary-guarded kernel arguments and checksummed op inputs for every spec (KP_GUARD=0: off).
kp_conformance.guard.install()
