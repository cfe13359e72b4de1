"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): cross_entropy's kernels
and the fused linear loss against float64 references."""

import torch
import torch.nn.functional as F

import kp_core
import kp_losses

x, t = torch.randn(5, 300, dtype=torch.float64), torch.tensor([0, 299, -100, 7, 150])
with kp_core.record_launches() as record:
    loss = kp_losses.cross_entropy(x, t, label_smoothing=0.1)
assert record.count() and kp_core.REFERENCE not in record.backends(), record.launches
torch.testing.assert_close(loss, F.cross_entropy(x, t, label_smoothing=0.1))
h, w = torch.randn(5, 16, dtype=torch.float64), torch.randn(300, 16, dtype=torch.float64)
torch.testing.assert_close(kp_losses.fused_linear_cross_entropy(h, w, t, chunk_size=2), F.cross_entropy(h @ w.T, t))
