"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): the 2:4 mask of its
kernel keeps the two largest |w| of every group of four."""

import torch

import kp_core
import kp_sparsity

w = torch.randn(8, 64)
with kp_core.record_launches() as record:
    mask = kp_sparsity.mask_2_4(w)
assert record.count() and kp_core.REFERENCE not in record.backends(), record.launches
groups = w.abs().reshape(8, 16, 4)
want = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, groups.topk(2, dim=-1).indices, True)
assert torch.equal(mask, want.reshape(8, 64))
