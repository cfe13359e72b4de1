"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): one Triton kernel
launched through kp_core.launch, on the backend kp-core chooses, and recorded."""

import torch
import triton
import triton.language as tl

import kp_core


@triton.jit
def _double(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


x = torch.randn(100)
y = torch.empty_like(x)
backend = kp_core.choose_backend("smoke::double", x)
with kp_core.record_launches() as record:
    kp_core.launch("smoke::double", backend, _double, (kp_core.cdiv(100, 64),), (x, y, 100), {"BLOCK": 64})
assert backend != kp_core.REFERENCE and record.count("smoke::double", backend) == 1, (backend, record.launches)
torch.testing.assert_close(y, 2 * x, rtol=0, atol=0)
