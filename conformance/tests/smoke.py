"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): the tolerance rule
passes torch's own bfloat16 result and fails one off by far more than bfloat16 rounding."""

import torch

import kp_conformance

x = torch.randn(64, 64)
ref64, lowp = x.double().softmax(-1), x.bfloat16().softmax(-1)
kp_conformance.check_close("softmax", lowp, ref64, lowp, torch.bfloat16)
try:
    kp_conformance.check_close("softmax", lowp + 0.1, ref64, lowp, torch.bfloat16)
except AssertionError:
    pass
else:
    raise AssertionError("check_close passed an output 0.1 off")
