"""The example trainer (examples/train_llama.py) under torchrun on CPU processes: a rank killed with SIGKILL
mid-run, torchrun's restart resumes from the last complete checkpoint, and the losses go on exactly as in an
uninterrupted run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TRAINER = Path(__file__).resolve().parents[3] / "examples" / "train_llama.py"
SMALL = "--batch 2 --seq 16 --vocab 64 --dim 32 --layers 2 --heads 4 --kv-heads 2 --hidden 64 --mp none"


def torchrun(tmp, name, *extra, restarts=0):
    log = tmp / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--max-restarts={restarts}"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(TRAINER), "--steps", "8"]
    cmd += [*SMALL.split(), "--log-every", "1", "--log-file", str(log), "--save-every", "2"]
    cmd += ["--ckpt", str(tmp / name), *extra]
    # CPU processes on a GPU machine too: the exact loss equality below needs deterministic kernels
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in records if "step" in r], out.stdout  # (the last line: the state's size)


@pytest.mark.skipif(not TRAINER.is_file(), reason="the example trainer lives in the repository, not the wheel")
def test_a_killed_rank_resumes_from_the_last_checkpoint(tmp_path):
    whole, whole_out = torchrun(tmp_path, "whole", "--profile", "2")
    # the overlap report of the profiled last 2 steps runs; CPU processes have no GPU kernels to put in it
    assert "overlap comm 0 compute 0 overlapped 0 hidden 1" in whole_out
    killed, stdout = torchrun(tmp_path, "killed", "--resume", "--die-at", "5", restarts=1)
    assert [r["step"] for r in whole] == list(range(1, 9))
    first = [r for r in killed if r["attempt"] == 0]
    again = [r for r in killed if r["attempt"] == 1]
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]  # rank 1 died before the 6th step
    assert "resumed from step 4" in stdout  # the last checkpoint (every 2 steps) before the kill
    assert [r["step"] for r in again] == [5, 6, 7, 8]
    by_step = {r["step"]: r["loss"] for r in whole}
    assert [r["loss"] for r in first + again] == [by_step[r["step"]] for r in first + again]
