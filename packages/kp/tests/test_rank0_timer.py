"""kp.rank0_timer: kp.optimize on two ranks (gloo, CPU processes; the kernels under Triton's interpreter) whose own
timings disagree still makes one choice on both, rank 0's; with the disk cache on it is refused, not a hang."""

import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from optimize_models import FixedTimer, block

import kp

NORMS = ["norms"]  # kp's norm candidates only: quick under the interpreter


def _choose(rank: int, world: int, port: int, out: str) -> None:
    os.environ["KP_CACHE_DIR"] = str(Path(out) / f"cache{rank}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, x = block("cpu")
        ms = 0.5 if rank == 0 else 2.0  # rank 0 finds kp's norms faster than torch's (1.0), rank 1 slower
        timer = kp.rank0_timer(FixedTimer({("*", "kp_norms.RMSNorm"): ms, ("*", "kp_norms.LayerNorm"): ms}))
        try:
            kp.optimize(model, (x,), allow=NORMS, timer=timer, report=False)
            refused = ""
        except ValueError as e:
            refused = str(e)
        report = kp.optimize(model, (x,), allow=NORMS, timer=timer, cache=False, report=False)
        result = {"chosen": report.chosen, "refused": refused, "modules": [type(m).__name__ for m in model.modules()]}
    except Exception as e:  # reported to the test, not lost in a child's stderr
        result = {"error": f"{type(e).__name__}: {e}"}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    # No destroy_process_group: torch 2.6's gloo destructor joins its worker threads holding the GIL while one of
    # them waits for it to free a broadcast tensor, a deadlock now and then (fixed by pytorch/pytorch#154976). The
    # result is written and no collective is left, so the rank leaves without the interpreter's teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_every_rank_takes_rank_0s_times():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_choose, (2, port, out), nprocs=2, start_method="spawn", join=True)
        results = [torch.load(Path(out) / f"rank{r}.pt") for r in range(2)]
    for r in results:
        assert "error" not in r, r
        assert "cache=False" in r["refused"]
    both = {"norm": "kp_norms.RMSNorm", "out_norm": "kp_norms.LayerNorm"}
    assert results[0]["chosen"] == results[1]["chosen"] == both
    assert results[0]["modules"] == results[1]["modules"]
