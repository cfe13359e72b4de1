"""kp-distributed: FSDP2 training in a few lines, on PyTorch's own engine (fully_shard, DeviceMesh, DCP, torchrun).

kp_distributed.init()                                   # the process group torchrun describes
model = kp_distributed.shard(model, strategy="hybrid")  # per block, then the root
ckpt = kp_distributed.Checkpointer("ckpt")
step, extra = ckpt.load(model, optimizer)               # resume (any number of ranks)
...
ckpt.save(step, model, optimizer)
"""

from kp_distributed.checkpoint import Checkpointer, export, fingerprint
from kp_distributed.comm import compress, kernel_intervals, overlap
from kp_distributed.mesh import STRATEGIES, init, make_mesh
from kp_distributed.shard import find_blocks, shard

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "Checkpointer",
    "compress",
    "export",
    "find_blocks",
    "fingerprint",
    "init",
    "kernel_intervals",
    "make_mesh",
    "overlap",
    "shard",
]
