"""kp_distributed on 1 and 2 GPUs: examples/train_llama.py under torchrun (NCCL), bf16 parameters with fp32
reduction unless said otherwise, the same per-GPU batch. Three parts, each its own results:

    python benchmarks/bench_distributed.py scaling   # results/<device>/distributed.{json,md,png}
    python benchmarks/bench_distributed.py compose   # results/<device>/distributed-compose.{json,md,png}
    python benchmarks/bench_distributed.py versus    # results/<device>/distributed-versus.{json,md,png}
    python benchmarks/bench_distributed.py e2e       # results/<device>/distributed-e2e.{json,md,png}

scaling: tokens/s, scaling, peak memory and per-GPU parameter + optimizer state on 1 and 2 GPUs; a plain
fully_shard loop on the same model; the 2-GPU loss curve against 1 GPU at the same global batch, with a float32
run as the yardstick of bf16's own deviation; the communication hidden behind compute (a profile of the 2-GPU
run's last steps); and a rank killed with SIGKILL mid-run, resumed by torchrun's restart from the last checkpoint.
compose: 2 GPUs with kp's kernels (--kernels), float8 linears (--fp8 tensorwise) and float8 all-gather.
versus: kp's shard (explicit prefetch of 1 block, the default, and 0) against torchtitan's recipe and the plain
fully_shard loop, written out by hand, on 2 GPUs; 80 steps each, interleaved over 4 rounds (`versus N`: N rounds,
`versus N quick`: without prefetch 0): the spread between 30-step runs of one setup (up to 9 % on 2 x H200) was
larger than the differences in question.
e2e: torchtitan's recipe (FSDP2 + each block compiled + torchao float8 tensorwise with float8 all-gather, the head
in bf16), the same without float8, and kp: kp_distributed.shard of the model kp.optimize chose for (every rank with
rank 0's timings), eager, compiled, and compiled with its choices timed by kp.graph_timer; on 2 GPUs, or
KP_E2E_GPUS.
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
STEPS = {"versus": 80}
RUN_STEPS = 30  # the other parts'


def run(gpus: int, batch: int, *extra, restarts=0, tmp: Path, steps=RUN_STEPS) -> tuple[list[dict], str]:
    log = tmp / f"log-{len(list(tmp.iterdir()))}.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", f"--max-restarts={restarts}"]
    cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(TRAINER), *MODEL.split()]
    cmd += ["--steps", str(steps), "--batch", str(batch), "--log-every", "5", "--log-file", str(log), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=os.environ)
    if out.returncode != 0:
        raise RuntimeError(out.stdout[-2000:] + out.stderr[-2000:])
    return [json.loads(line) for line in log.read_text().splitlines()], out.stdout


PROFILED = 3  # the last steps of each run, under torch.profiler (the overlap report)


def summary(records: list[dict], total: int) -> dict:
    steps = [r for r in records if "step" in r]
    # after the kernels' compilation and the allocator's warm-up, and before the profiled last steps
    timed = [r for r in steps if 10 < r["step"] <= total - PROFILED]
    out = {
        "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
        "memory_gib": max(r["memory_gib"] for r in steps),
        "state_gib": next(r["state_gib"] for r in records if "state_gib" in r),
        "losses": [(r["step"], r["loss"]) for r in steps],
    }
    overlap = [r["overlap"] for r in records if "overlap" in r]
    if overlap:
        out["overlap"] = overlap[0]
    return out


PARTS = {
    "scaling": [
        ("1 GPU, batch 4", 1, 4, ()),
        ("2 GPUs, batch 4 each (kp shard)", 2, 4, ()),
        ("2 GPUs, batch 4 each (plain fully_shard)", 2, 4, ("--baseline",)),
        ("1 GPU, batch 8 (2-GPU global batch)", 1, 8, ()),
        ("1 GPU, batch 8, float32", 1, 8, ("--mp", "none")),
    ],
    "compose": [
        ("2 GPUs, bf16", 2, 4, ()),
        ("2 GPUs, kp kernels", 2, 4, ("--kernels",)),
        ("2 GPUs, kp kernels + float8", 2, 4, ("--kernels", "--fp8", "tensorwise")),
        ("2 GPUs, kp kernels + float8, float8 all-gather", 2, 4, ("--kernels", "--fp8-all-gather")),
    ],
    "versus": [
        ("kp shard, prefetch 1 (default)", 2, 4, ()),
        ("kp shard, prefetch 0", 2, 4, ("--prefetch", "0")),
        ("torchtitan's recipe", 2, 4, ("--baseline", "torchtitan")),
        ("plain fully_shard", 2, 4, ("--baseline",)),
    ],
}
E2E_GPUS = int(os.environ.get("KP_E2E_GPUS", "2"))  # 4 where the device lends them
TORCHTITAN_FP8 = ("--baseline", "torchtitan", "--compile", "--fp8", "tensorwise", "--fp8-impl", "torchao")
PARTS["e2e"] = [
    ("torchtitan's recipe: FSDP2 + compile + torchao float8", E2E_GPUS, 4, (*TORCHTITAN_FP8, "--fp8-all-gather")),
    ("torchtitan's recipe without float8: FSDP2 + compile", E2E_GPUS, 4, ("--baseline", "torchtitan", "--compile")),
    ("kp shard + kp.optimize", E2E_GPUS, 4, ("--optimize",)),
    ("kp shard + kp.optimize + compile", E2E_GPUS, 4, ("--optimize", "--compile")),
    ("kp shard + kp.optimize (graph_timer) + compile", E2E_GPUS, 4, ("--optimize", "graph", "--compile")),
]
STEPS["e2e"] = 40
ROUNDS = {"versus": 4}
KILLED = "2 GPUs, rank 1 killed at step 15"


def main() -> None:
    part = sys.argv[1] if len(sys.argv) > 1 else "scaling"
    if part not in PARTS:
        raise SystemExit(f"bench_distributed: the part is one of {sorted(PARTS)}, got {part!r}")
    harness.require_gpu()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_distributed: needs 2 GPUs")
    rows, steps = [], STEPS.get(part, RUN_STEPS)
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else ROUNDS.get(part, 1)
    setups = [s for s in PARTS[part] if not ("quick" in sys.argv[3:] and "prefetch 0" in s[0])]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for round_ in range(rounds):
            # each round starts one setup further on, so that no setup always runs first (after the idle gap)
            for name, gpus, batch, extra in setups[round_ % len(setups) :] + setups[: round_ % len(setups)]:
                row = dict(provider=name, gpus=gpus, batch=batch, flags=" ".join(extra), round=round_)
                try:
                    records, _ = run(gpus, batch, "--profile", str(PROFILED), *extra, tmp=tmp, steps=steps)
                except (RuntimeError, subprocess.TimeoutExpired) as err:  # reported: the other rows still count
                    rows.append(dict(row, failed=str(err)[-1500:]))
                    print(name, "failed:", str(err)[-600:], flush=True)
                    continue
                rows.append(dict(row, **summary(records, steps)))
                print(name, {k: v for k, v in rows[-1].items() if k != "losses"}, flush=True)
        if part == "scaling":
            ck = tmp / "ckpt"
            try:
                records, stdout = run(
                    2, 4, "--ckpt", str(ck), "--save-every", "10", "--resume", "--die-at", "15", restarts=1, tmp=tmp
                )
                resumed = [line for line in stdout.splitlines() if line.startswith("resumed from")]
                losses = [(r["step"], r["loss"], r["attempt"]) for r in records if "step" in r]
                rows.append(dict(provider=KILLED, resumed=resumed, losses=losses))
            except RuntimeError as err:  # reported, not dropped: the other rows still get written
                rows.append(dict(provider=KILLED, failed=str(err)[-1500:]))
            print(rows[-1], flush=True)
    meta = {"kernel": "distributed", "part": part, "model": MODEL, "steps": steps}
    name = "distributed" if part == "scaling" else f"distributed-{part}"
    if part == "e2e" and E2E_GPUS != 2:  # the 2-GPU table keeps its own file
        name += f"-{E2E_GPUS}gpu"
    harness.publish(name, meta, rows, render, plot)


def render(meta: dict, rows: list[dict]) -> str:
    one = next(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)
    lines = [
        f"# kp_distributed ({meta['part']}), {meta['device']}",
        "",
        f"torch {meta['torch']}; examples/train_llama.py {meta['model']}, {meta['steps']} steps, AdamW, bf16 "
        "parameters with fp32 reduction unless said otherwise. tokens/s: mean of the logged windows after step 10 "
        f"and before the last {PROFILED} steps (profiled), all ranks together. state: one rank's parameters and "
        "AdamW state (gradients take as much as the parameters). hidden: the share of NCCL kernel time that ran "
        "while a compute kernel ran, in the profiled steps.",
        "",
        "| run | tokens/s | x first row | peak memory GiB | state GiB | comm ms | hidden |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "tokens_per_s" in r:
            o = r.get("overlap", {})
            comm = f"{o['comm'] / 1e3:.1f}" if o else "-"
            hidden = f"{o['hidden']:.2f}" if o and o["comm"] else "-"
            lines.append(
                f"| {r['provider']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / one:.2f}x | "
                f"{r['memory_gib']:.2f} | {r['state_gib']:.3f} | {comm} | {hidden} |"
            )
    if meta["part"] == "scaling":
        lines += _losses(rows)
        lines += _killed(rows[-1])
    if meta["part"] == "versus":
        lines += _versus(rows)
    if meta["part"] == "e2e":
        lines += ["", "Last logged loss of each run (the same data and initial weights):", ""]
        lines += [f"- {r['provider']}: {r['losses'][-1][1]:.4f}" for r in rows if r.get("losses")]
    failed = [r for r in rows if "failed" in r]
    for r in failed:
        lines += ["", f"{r['provider']}: failed:", "", "```", r["failed"], "```"]
    return "\n".join(lines) + "\n"


def _versus(rows: list[dict]) -> list[str]:
    """Each setup's mean over the rounds, against the last setup's (the plain loop) of the same rounds."""
    names = list(dict.fromkeys(r["provider"] for r in rows))
    speed = {n: [r["tokens_per_s"] for r in rows if r["provider"] == n] for n in names}
    base = speed[names[-1]]
    base_mean = sum(base) / len(base)
    out = ["", "Over the rounds (interleaved: each round runs every setup once, starting one setup further on):", ""]
    out += ["| setup | mean tokens/s | each round | x plain, mean | x plain, each round |", "|---|---|---|---|---|"]
    for n in names:
        mean = sum(speed[n]) / len(speed[n])
        each = ", ".join(f"{v:.0f}" for v in speed[n])
        ratios = ", ".join(f"{v / b:.3f}" for v, b in zip(speed[n], base))
        out.append(f"| {n} | {mean:.0f} | {each} | {mean / base_mean:.3f}x | {ratios} |")
    return out


def _losses(rows: list[dict]) -> list[str]:
    """2 GPUs against 1 at the same global batch, beside bf16 against float32 on 1 GPU (bf16's own deviation)."""
    two, big, fp32 = (dict(map(tuple, rows[i]["losses"])) for i in (1, 3, 4))
    out = ["", "Loss at the same global batch (8 sequences): 2 GPUs x 4 against 1 GPU x 8, both bf16; and the 1-GPU"]
    out += ["bf16 run against the same run in float32, the size of bf16's own deviation:", ""]
    out += ["| step | 2 GPUs | 1 GPU | 2 - 1 | 1 GPU float32 | bf16 - float32 |", "|---|---|---|---|---|---|"]
    for s in two:
        if s in big and s in fp32:
            cells = [two[s], big[s], f"{two[s] - big[s]:+.4f}", fp32[s], f"{big[s] - fp32[s]:+.4f}"]
            out.append(f"| {s} | " + " | ".join(c if isinstance(c, str) else f"{c:.4f}" for c in cells) + " |")
    return out


def _killed(kill: dict) -> list[str]:
    if "failed" in kill:
        return ["", "Killed run: failed:", "", "```", kill["failed"], "```"]
    out = ["", f"Killed run: {'; '.join(kill['resumed'])}", "", "| step | loss | attempt |", "|---|---|---|"]
    return out + [f"| {s} | {loss:.4f} | {a} |" for s, loss, a in kill["losses"]]


def plot(rows: list[dict], meta: dict, path) -> None:
    speed = [dict(r, group="tokens/s") for r in rows if "tokens_per_s" in r]
    harness.plot_grouped(speed, path, "group", "tokens_per_s", "tokens/s", f"kp_distributed, {meta['device']}")


if __name__ == "__main__":
    main()
