"""benchmarks/bench_cross_entropy.py off the GPU: its command line, the markdown from a rows list, the merge of a
partial run into the last one, and (where kp_losses imports) --smoke's checks on the CPU. Skipped without torch
(the lint session's environment)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import bench_cross_entropy as bench  # noqa: E402

META = {
    "device": "NVIDIA H200",
    "torch": "2.11.0",
    "triton": "3.6.0",
    "liger_kernel": "0.8.5",
    "cut_cross_entropy": "25.1.1",
    "quack_kernels": "absent",
    "repeats": 3,
}


def linear_row(case: str, provider: str, ms: float, mib: float = 1000.0) -> dict:
    tokens, hidden, vocab, cap = bench.LINEAR_CASES[case]
    base = dict(part="linear", case=case, tokens=tokens, hidden=hidden, vocab=vocab, softcap=cap, provider=provider)
    return dict(base, ms=ms, peak_mib=mib, err=0.004)


def failed_row(case: str, provider: str) -> dict:
    row = linear_row(case, provider, 0.0)
    return {k: v for k, v in row.items() if k not in ("ms", "peak_mib", "err")} | {"failed": "AssertionError: ..."}


def ce_row(case: str, provider: str, ms: float, copy: float = 4000.0) -> dict:
    tokens, vocab = bench.CE_CASES[case]
    gbps = 3 * tokens * vocab * 2 / ms / 1e6
    return dict(part="ce", case=case, tokens=tokens, vocab=vocab, provider=provider, ms=ms, gbps=gbps, copy_gbps=copy)


ROWS = [
    linear_row("llama3-8b", "kp", 40.0, 3000),
    linear_row("llama3-8b", "liger", 50.0, 2500),
    linear_row("llama3-8b", "torch", 80.0, 30000),
    failed_row("llama3-8b", "cut cross-entropy"),
    linear_row("gemma2-2b", "kp", 30.0),
    linear_row("gemma2-2b", "liger", 25.0),
    ce_row("ce-128k", "kp", 1.0),
    ce_row("ce-128k", "torch", 2.0),
]


def table(md: str, title: str) -> list[str]:
    """The lines of the table under the heading that starts with `title`."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"## {title}"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


def test_cases_from_the_command_line():
    assert bench.selected_cases(bench.parse_args([])) == [*bench.LINEAR_CASES, *bench.CE_CASES]
    assert bench.selected_cases(bench.parse_args(["--quick"])) == ["llama3-8b", "ce-128k"]
    args = bench.parse_args(["--case", "gemma2-2b", "ce-32k", "--only", "kp", "cut cross-entropy", "--repeats", "5"])
    assert bench.selected_cases(args) == ["gemma2-2b", "ce-32k"]
    assert args.only == ["kp", "cut cross-entropy"] and args.repeats == 5
    with pytest.raises(SystemExit):
        bench.parse_args(["--case", "no-such-case"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--only", "no-such-provider"])


def test_linear_table():
    md = bench.render(META, ROWS)
    assert "cut-cross-entropy 25.1.1" in md and "median of 3 rounds" in md
    lines = table(md, "Linear + cross-entropy")
    head = cells(lines[0])
    assert head == ["case", "tokens x hidden x vocab", "softcap", "kp", "liger", "cut cross-entropy", "torch"] + [
        "kp / best anchor"
    ]
    assert all(len(cells(line)) == len(head) for line in lines)
    llama = dict(zip(head, cells(lines[2])))
    assert llama["tokens x hidden x vocab"] == "8192 x 4096 x 128256" and llama["softcap"] == "-"
    assert llama["kp"] == "40.00 / 3000" and llama["cut cross-entropy"] == "failed"
    assert llama["kp / best anchor"] == "0.80"  # 40 ms over liger's 50: the failed row is no anchor
    gemma = dict(zip(head, cells(lines[3])))
    assert gemma["softcap"] == "30" and gemma["torch"] == "-" and gemma["kp / best anchor"] == "1.20"


def test_ce_table():
    lines = table(bench.render(META, ROWS), "Cross-entropy on logits")
    head = cells(lines[0])
    assert head == ["case", "tokens x vocab", "kp", "torch", "copy GB/s", "kp % of copy", "kp / best anchor"]
    row = dict(zip(head, cells(lines[2])))
    gbps = 3 * 8192 * 128256 * 2 / 1.0 / 1e6
    assert row["kp"] == f"1.00 / {gbps:.0f}" and row["copy GB/s"] == "4000"
    assert row["kp % of copy"] == f"{100 * gbps / 4000:.0f}%" and row["kp / best anchor"] == "0.50"


def test_one_part_alone_and_no_kp():
    md = bench.render(META, [r for r in ROWS if r["part"] == "ce" and r["provider"] != "kp"])
    assert "Linear + cross-entropy" not in md
    row = cells(table(md, "Cross-entropy on logits")[2])
    assert row[-2:] == ["-", "-"]  # no kp: no % of copy, no ratio


def test_a_partial_run_keeps_the_other_cells():
    new = [linear_row("llama3-8b", "kp", 35.0), ce_row("ce-128k", "kp", 0.9)]
    rows = bench.merged(ROWS, new, ["llama3-8b", "ce-128k"], ["kp"])
    kept = {(r["case"], r["provider"]) for r in rows}
    assert ("gemma2-2b", "kp") in kept and ("llama3-8b", "liger") in kept and ("ce-128k", "torch") in kept
    assert [r["ms"] for r in rows if (r["case"], r["provider"]) == ("llama3-8b", "kp")] == [35.0]
    assert [r["case"] for r in rows] == sorted(
        (r["case"] for r in rows), key=[*bench.LINEAR_CASES, *bench.CE_CASES].index
    )
    # without --only, every provider of the cases measured now is replaced (one that failed now has no old row)
    rows = bench.merged(ROWS, new[:1], ["llama3-8b"], None)
    assert {r["provider"] for r in rows if r["case"] == "llama3-8b"} == {"kp"}


def test_smoke_checks_every_cpu_provider():
    pytest.importorskip("kp_losses")
    bench.smoke()


def test_plot(tmp_path):
    pytest.importorskip("matplotlib").use("Agg")
    bench.plot(ROWS, META, tmp_path / "cross_entropy.png")
    assert (tmp_path / "cross_entropy.png").stat().st_size > 0
