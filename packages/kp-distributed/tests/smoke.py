"""Release smoke test (nox -s release runs it in a clean venv, against the installed wheel): one process of a
gloo group shards a two-block model with FSDP2 and takes a training step as the unsharded copy does."""

import copy
import os
import socket

import torch

import kp_distributed

with socket.socket() as s:  # a free port for the rendezvous
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
kp_distributed.init("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
plain = copy.deepcopy(model)
sharded = kp_distributed.shard(model, mixed_precision=None)
assert kp_distributed.find_blocks(plain) == list(plain)
x = torch.randn(4, 8)
for m in (sharded, plain):
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(x).square().sum().backward()
    opt.step()
torch.testing.assert_close(sharded(x).detach(), plain(x).detach())
torch.distributed.destroy_process_group()
