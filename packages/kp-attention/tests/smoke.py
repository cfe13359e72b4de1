"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): causal GQA
flash_attention's kernel against torch's scaled_dot_product_attention."""

import torch

import kp_attention
import kp_core

q, k, v = torch.randn(1, 16, 4, 32), torch.randn(1, 16, 2, 32), torch.randn(1, 16, 2, 32)  # (B, S, H, D)
with kp_core.record_launches() as record:
    out = kp_attention.flash_attention(q, k, v, causal=True, backend="kp")
want = torch.nn.functional.scaled_dot_product_attention(
    *(t.transpose(1, 2).double() for t in (q, k, v)), is_causal=True, enable_gqa=True
).transpose(1, 2)
assert record.count() and kp_core.REFERENCE not in record.backends(), record.launches
torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
