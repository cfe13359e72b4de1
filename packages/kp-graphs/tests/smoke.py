"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): a graphed module
with shape buckets; on a CPU it pads to the bucket, runs eagerly and cuts back."""

import torch

import kp_graphs

model = torch.nn.Linear(16, 16)
fn = kp_graphs.graphed(model, buckets=[4, 8])
x = torch.randn(3, 16)
torch.testing.assert_close(fn(x), model(x))
assert fn.stats.calls == 1 and "| graphed |" in kp_graphs.report()
