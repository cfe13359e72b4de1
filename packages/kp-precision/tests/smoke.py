"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): rowwise float8
quantisation by its kernel, bit for bit torch's own cast of x * (448 / amax of its row)."""

import torch

import kp_core
import kp_precision

x = torch.randn(8, 64)
with kp_core.record_launches() as record:
    q = kp_precision.quantize(x, torch.float8_e4m3fn, granularity="rowwise")
assert record.count() and kp_core.REFERENCE not in record.backends(), record.launches
want = (x * (448 / x.abs().amax(-1, keepdim=True))).clamp(-448, 448).to(torch.float8_e4m3fn)
assert torch.equal(q.data.view(torch.uint8), want.view(torch.uint8))
torch.testing.assert_close(kp_precision.dequantize(q), x, rtol=2**-4, atol=0)  # e4m3: 3 mantissa bits
