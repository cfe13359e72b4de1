"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): rowwise float8
quantisation by its kernel, bit for bit torch's own cast of x * (448 / amax of its row)."""

import torch

import kp_core
import kp_precision

x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
with kp_core.record_launches() as record:
    q = kp_precision.quantize(x, torch.float8_e4m3fn, granularity="rowwise")
assert record.count() and kp_core.REFERENCE not in record.backends(), record.launches
want = (x * (448 / x.abs().amax(-1, keepdim=True))).clamp(-448, 448).to(torch.float8_e4m3fn)
assert torch.equal(q.data.view(torch.uint8), want.view(torch.uint8))
# e4m3: 3 mantissa bits (half an ulp: 2**-4 relative), and below 2**-6 its subnormals' fixed step 2**-9 (half of
# it absolute, in the row's scale): an unseeded draw once put one element there
step = 2**-10 * x.abs().amax(-1, keepdim=True) / 448
assert ((kp_precision.dequantize(q) - x).abs() <= 2**-4 * x.abs() + step).all()
