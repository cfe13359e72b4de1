"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): rms_norm's kernel
against a float64 reference."""

import torch

import kp_core
import kp_norms

x, w = torch.randn(4, 64), torch.randn(64)
with kp_core.record_launches() as record:
    y = kp_norms.rms_norm(x, (64,), w, eps=1e-6)
want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
assert record.count() and kp_core.REFERENCE not in record.backends(), record.launches
torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
