"""kp_distributed on 1 and 2 GPUs, one run: examples/train_llama.py under torchrun (NCCL), bf16 parameters with
fp32 reduction, the same per-GPU batch; tokens/s, scaling, peak memory and per-GPU parameter + optimizer state;
the 2-GPU loss curve against 1 GPU at the same global batch; a plain fully_shard loop on the same model; and a rank
killed with SIGKILL mid-run, resumed by torchrun's restart from the last checkpoint.

    python benchmarks/bench_distributed.py     # writes results/<device>/distributed.{json,md,png}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
import torch

TRAINER = Path(__file__).resolve().parent.parent / "examples" / "train_llama.py"
MODEL = "--vocab 32000 --dim 2048 --layers 8 --heads 16 --kv-heads 4 --hidden 5632 --seq 2048"
STEPS = 30


def run(gpus: int, batch: int, *extra, restarts=0, tmp: Path) -> tuple[list[dict], str]:
    log = tmp / f"log-{len(list(tmp.iterdir()))}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", f"--max-restarts={restarts}"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(TRAINER), *MODEL.split()]
    cmd += ["--steps", str(STEPS), "--batch", str(batch), "--log-every", "5", "--log-file", str(log), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=os.environ)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return [json.loads(line) for line in log.read_text().splitlines()], out.stdout


def summary(records: list[dict]) -> dict:
    steps = [r for r in records if "step" in r]
    warm = [r for r in steps if r["step"] > 10]  # after compilation of kernels and the allocator's warm-up
    return {
        "tokens_per_s": sum(r["tokens_per_s"] for r in warm) / len(warm),
        "memory_gib": max(r["memory_gib"] for r in steps),
        "state_gib": next(r["state_gib"] for r in records if "state_gib" in r),
        "losses": [(r["step"], r["loss"]) for r in steps],
    }


def main() -> None:
    harness.require_gpu()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_distributed: needs 2 GPUs")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases = [
            ("1 GPU, batch 4", 1, 4, ()),
            ("2 GPUs, batch 4 each (kp shard)", 2, 4, ()),
            ("2 GPUs, batch 4 each (plain fully_shard)", 2, 4, ("--baseline",)),
            ("1 GPU, batch 8 (2-GPU global batch)", 1, 8, ()),
        ]
        for name, gpus, batch, extra in cases:
            records, _ = run(gpus, batch, *extra, tmp=tmp)
            rows.append(dict(provider=name, gpus=gpus, batch=batch, **summary(records)))
            print(name, {k: v for k, v in rows[-1].items() if k != "losses"}, flush=True)
        ck = tmp / "ckpt"
        try:
            records, stdout = run(
                2, 4, "--ckpt", str(ck), "--save-every", "10", "--resume", "--die-at", "15", restarts=1, tmp=tmp
            )
            resumed = [line for line in stdout.splitlines() if line.startswith("resumed from")]
            losses = [(r["step"], r["loss"], r["attempt"]) for r in records if "step" in r]
            rows.append(dict(provider="2 GPUs, rank 1 killed at step 15", resumed=resumed, losses=losses))
        except RuntimeError as err:  # reported, not dropped: the other rows still get written
            rows.append(dict(provider="2 GPUs, rank 1 killed at step 15", failed=str(err)[-1500:]))
        print(rows[-1], flush=True)
    meta = {"kernel": "distributed", "model": MODEL, "steps": STEPS, "dtype": "bf16 params, fp32 reduce"}
    harness.publish("distributed", meta, rows, render, plot)


def render(meta: dict, rows: list[dict]) -> str:
    one = rows[0]["tokens_per_s"]
    lines = [
        f"# kp_distributed, {meta['device']} x 2",
        "",
        f"torch {meta['torch']}; examples/train_llama.py {meta['model']}, {meta['steps']} steps, AdamW, "
        f"{meta['dtype']}. tokens/s: mean of the logged windows after step 10, all ranks together. state: one "
        "rank's parameters and AdamW state (gradients take as much as the parameters).",
        "",
        "| run | tokens/s | x 1 GPU | peak memory GiB | state GiB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "tokens_per_s" in r:
            lines.append(
                f"| {r['provider']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / one:.2f}x | "
                f"{r['memory_gib']:.2f} | {r['state_gib']:.3f} |"
            )
    two = dict(map(tuple, rows[1]["losses"]))
    big = dict(map(tuple, rows[3]["losses"]))
    lines += ["", "Loss, 2 GPUs x batch 4 against 1 GPU x batch 8 (the same global batch):", ""]
    lines += ["| step | 2 GPUs | 1 GPU | difference |", "|---|---|---|---|"]
    lines += [f"| {s} | {two[s]:.4f} | {big[s]:.4f} | {two[s] - big[s]:+.4f} |" for s in two if s in big]
    kill = rows[4]
    if "failed" in kill:
        return "\n".join(lines + ["", "Killed run: failed:", "", "```", kill["failed"], "```"]) + "\n"
    lines += ["", f"Killed run: {'; '.join(kill['resumed'])}", "", "| step | loss | attempt |", "|---|---|---|"]
    lines += [f"| {s} | {loss:.4f} | {a} |" for s, loss, a in kill["losses"]]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    speed = [dict(r, group="tokens/s") for r in rows if "tokens_per_s" in r]
    harness.plot_grouped(speed, path, "group", "tokens_per_s", "tokens/s", f"kp_distributed, {meta['device']}")


if __name__ == "__main__":
    main()
