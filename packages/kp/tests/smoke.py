"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): kp.check runs kp's
RMSNorm candidate on a model's norm layer against its float64 copy, and it passes."""

import torch

import kp

model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.RMSNorm(64))
report = kp.check(model, (torch.randn(4, 64),))
statuses = [t.status for layer in report.layers for t in layer.tried]
assert "checked" in statuses and "refused" not in statuses, statuses
