"""KV-cache decoding: kp.flash_attention_with_kvcache vs SDPA's FlashAttention-2 and cuDNN backends and
FlashAttention-4 (where installed), one run, each timed eager (a loop of plain calls back to back, wall time per
call: the host's launch cost and the GPU's time overlap as in a decoding loop) and replayed from a CUDA graph (the
GPU's time alone), with the host's CPU time per eager call.

    python benchmarks/bench_decode.py            # writes results/<device>/decode.{json,md,png}
    python benchmarks/bench_decode.py --tune     # sweep kp's split-kernel settings (B16 L32768, B64 L8192, B1 L8192)

q length 1, Hq 32 / Hkv 8, D 128, bf16. GB/s count the K and V bytes read (what bounds decoding). kp reads the
cache in its (B, S, H, D) layout; SDPA gets (B, H, S, D) transposed views of the same tensors. kp is timed with
its default value check of cache_seqlens (on the device, its flag copied back without blocking) and without it
(VALIDATE_VALUES = False; the kernels stay in bounds either way). The paged columns read the same
cache split into pages of 256 and 16 slots in shuffled order through a block_table. `kp auto` is backend="auto"
(cache_seqlens as a tensor: torch's kernels are left out, they need one length on the host), `kp auto (host
length)` the same call with cache_seqlens an int (torch's kernels among the candidates), `kp fa4`
FlashAttention-4 behind kp's op (the append and value checks kp adds), `fa4` FlashAttention-4's own
flash_attn_func on the whole cache (every sequence full, as SDPA's columns).
"""

from __future__ import annotations

import argparse
import functools
import time

import harness
import torch
import torch.nn.functional as F

import kp_attention
import kp_core
from kp_attention.ops import decode as decode_mod

DTYPE = torch.bfloat16
HEAD_DIM, HQ, HKV = 128, 32, 8
CASES = [(1, 8192), (1, 32768), (16, 32768), (64, 8192)]
WAVES = decode_mod.WAVES
PAGES = (256, 16)  # FlashAttention's paged block size, and vLLM's


def _sdpa(backend, q, k, v):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)


def _fa4():
    from flash_attn.cute import flash_attn_func

    def run(q, k, v):
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return run


def loop_ms(fn, calls: int = 200, repeats: int = 5) -> float:
    """Wall ms per call of `calls` plain calls back to back (a decoding loop: the host's launch work and the GPU's
    overlap, the slower of the two sets the rate), median of `repeats` loops. do_bench flushes the L2 between calls
    and times each alone, which hides a varying part of a host-bound call's cost (batch-1 rows moved 2-3x between
    runs of the same code)."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def host_us(fn, calls: int = 200) -> float:
    """The Python thread's CPU time per call, in microseconds (what an eager decode step costs the host)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.thread_time()
    for _ in range(calls):
        fn()
    spent = time.thread_time() - start
    torch.cuda.synchronize()
    return spent / calls * 1e6


def _kp_unchecked(q, k, v, seqlens, block_table=None):
    decode_mod.VALIDATE_VALUES = False
    try:
        return kp_attention.flash_attention_with_kvcache(q, k, v, seqlens, block_table=block_table)
    finally:
        decode_mod.VALIDATE_VALUES = True


def inputs(b: int, length: int):
    q = torch.randn(b, 1, HQ, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(b, length, HKV, HEAD_DIM, device="cuda", dtype=DTYPE)
    return q, k, torch.randn_like(k), torch.full((b,), length, dtype=torch.int32, device="cuda")


def paged(k: torch.Tensor, page: int):
    """k (B, L, H, D) as a paged cache (num_blocks, page, H, D) in shuffled block order, and its block_table."""
    b, length = k.shape[:2]
    blocks = k.reshape(b * length // page, page, *k.shape[2:])
    perm = torch.randperm(blocks.shape[0], device=k.device, generator=torch.Generator(k.device).manual_seed(0))
    table = torch.empty_like(perm)
    table[perm] = torch.arange(perm.numel(), device=k.device)  # block i of the sequence lives at table[i]
    return blocks[perm].contiguous(), table.view(b, -1).to(torch.int32)


def check_correct(q, k, v, seqlens) -> None:
    """Before timing: kp agrees with SDPA in fp32 (bf16 rounding; the conformance suite judges the numerics)."""
    ours = kp_attention.flash_attention_with_kvcache(q, k, v, seqlens).float()
    ref = _sdpa_math(q.float(), k.float(), v.float())
    err = (ours - ref).abs().max().item()
    assert err < 2e-2, f"kp decode wrong: max err {err}"


def _sdpa_math(q, k, v):
    return F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
    ).transpose(1, 2)


def run() -> list[dict]:
    from torch.nn.attention import SDPBackend

    rows = []
    for b, length in harness.progress(CASES, "decode"):
        q, k, v, seqlens = inputs(b, length)
        check_correct(q, k, v, seqlens)
        nbytes = 2 * k.numel() * k.element_size()
        fns = {
            "kp": functools.partial(kp_attention.flash_attention_with_kvcache, q, k, v, seqlens, backend="kp"),
            "kp (no value check)": functools.partial(_kp_unchecked, q, k, v, seqlens),
            "kp auto": functools.partial(kp_attention.flash_attention_with_kvcache, q, k, v, seqlens),
            "kp auto (host length)": functools.partial(kp_attention.flash_attention_with_kvcache, q, k, v, length),
            "kp fa4": functools.partial(kp_attention.flash_attention_with_kvcache, q, k, v, seqlens, backend="fa4"),
        }
        contiguous = _kp_unchecked(q, k, v, seqlens).float()
        for page in PAGES:  # the same cache, paged: only the layout (and BLOCK_N <= page) may change
            k_paged, table = paged(k, page)
            v_paged, _ = paged(v, page)
            err = (_kp_unchecked(q, k_paged, v_paged, seqlens, table).float() - contiguous).abs().max().item()
            assert err < 2e-2, f"paged ({page}) differs from contiguous by {err}"
            fns[f"kp paged {page} (no value check)"] = functools.partial(
                _kp_unchecked, q, k_paged, v_paged, seqlens, table
            )
        fns |= {
            "sdpa flash": functools.partial(_sdpa, SDPBackend.FLASH_ATTENTION, q, k, v),
            "sdpa cudnn": functools.partial(_sdpa, SDPBackend.CUDNN_ATTENTION, q, k, v),
        }
        try:
            fns["fa4"] = functools.partial(_fa4(), q, k, v)
        except Exception as e:
            print(f"FlashAttention-4 unavailable: {type(e).__name__}: {e}")
        for name, fn in fns.items():
            for mode in MODES:
                try:
                    with torch.no_grad():
                        ms = loop_ms(fn) if mode == "eager" else harness.bench_graph_ms(fn)
                        host = host_us(fn) if mode == "eager" else None
                except Exception as e:  # an anchor without this case: recorded as missing
                    print(f"{name} {mode} decode failed at B{b} L{length}: {type(e).__name__}: {str(e)[:160]}")
                    continue
                row = dict(B=b, L=length, Hq=HQ, Hkv=HKV, provider=name, mode=mode, ms=ms, gbps=nbytes / ms / 1e6)
                rows.append(row if host is None else dict(row, host_us=host))
    return rows


MODES = ("eager", "graph")


def render(meta: dict, rows: list[dict]) -> str:
    names = list(dict.fromkeys(r["provider"] for r in rows))
    lines = [
        f"# KV-cache decode, bf16, D {HEAD_DIM}, q length 1, Hq {HQ} / Hkv {HKV}, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, flash-attn-4 {meta.get('flash_attn_4', 'absent')}. "
        "Cells: GB/s of K + V read, eager (a loop of plain calls, wall time per call, median of 5 loops) and "
        "replayed from a CUDA graph (do_bench median); `best anchor`: the "
        "best of SDPA's FlashAttention-2 and cuDNN and FlashAttention-4 in that mode, `kp / best`: kp's default "
        'call over it (cache_seqlens a tensor), `auto (host length) / best`: backend="auto" given the length as an '
        "int.",
    ]
    for mode in MODES:
        head = " | ".join(names) + " | kp / best anchor | auto (host length) / best |"
        lines += ["", f"## {mode}", "", "| B | cache length | " + head, "|---|---|" + "---|" * (len(names) + 2)]
        for b, length in CASES:
            by = {r["provider"]: r for r in rows if (r["B"], r["L"], r.get("mode", "eager")) == (b, length, mode)}
            cells = [f"{by[p]['gbps']:.0f}" if p in by else "-" for p in names]
            best = max((by[p]["gbps"] for p in ("sdpa flash", "sdpa cudnn", "fa4") if p in by), default=None)
            for ours in ("kp", "kp auto (host length)"):
                cells.append(f"{by[ours]['gbps'] / best:.2f}x" if best and ours in by else "-")
            lines.append(f"| {b} | {length} | " + " | ".join(cells) + " |")
    lines += ["", "## Host CPU time per eager call (us, the Python thread's)", ""]
    lines += ["| B | cache length | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for b, length in CASES:
        by = {r["provider"]: r for r in rows if (r["B"], r["L"]) == (b, length) and "host_us" in r}
        lines.append(
            f"| {b} | {length} | " + " | ".join(f"{by[p]['host_us']:.0f}" if p in by else "-" for p in names) + " |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    import matplotlib.pyplot as plt

    labels = [f"B{b} L{length}" for b, length in CASES]
    rows = [r for r in rows if r.get("mode", "eager") == "graph"]
    names = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        by = {(r["B"], r["L"]): r["gbps"] for r in rows if r["provider"] == name}
        ax.bar([x + i * width for x in range(len(CASES))], [by.get(c, 0) for c in CASES], width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(CASES))], labels)
    ax.set_xlabel("replayed from a CUDA graph")
    ax.set_ylabel("GB/s of K + V")
    ax.set_title(f"decode, bf16, {meta['device']}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tune() -> None:
    for b, length in ((16, 32768), (64, 8192), (1, 8192)):
        _tune_case(b, length)


def _tune_case(b: int, length: int) -> None:
    q, k, v, seqlens = inputs(b, length)
    results = []
    tiles = [(bn, w, st) for bn in (32, 64, 128) for w in (2, 4, 8) for st in (2, 3, 4)]
    for cfg in [(*t, waves) for t in tiles for waves in (1, 2, 3, 4, 6)]:
        kp_core.pin("_decode_split", block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2])
        decode_mod.WAVES = cfg[3]
        try:
            ms = harness.bench_graph_ms(functools.partial(_kp_unchecked, q, k, v, seqlens))  # the GPU's time
        except Exception as e:  # out of shared memory, or a compile failure: reported, skipped
            print(f"  decode {cfg}: {type(e).__name__}: {str(e)[:100]}")
            continue
        results.append((2 * k.numel() * k.element_size() / ms / 1e6, cfg))
    kp_core.unpin("_decode_split")
    decode_mod.WAVES = WAVES
    print(f"tune decode B{b} L{length}: best GB/s (BLOCK_N, warps, stages, waves of programs per SM)")
    for gbps, cfg in sorted(results, reverse=True)[:6]:
        print(f"   {gbps:6.0f}  {cfg}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true")
    args = parser.parse_args()
    harness.require_gpu()
    if args.tune:
        tune()
        return
    rows = run()
    meta = {"kernel": "decode", "dtype": "bfloat16", "head_dim": HEAD_DIM, **harness.versions()}
    meta["flash_attn_4"] = harness.installed("flash-attn-4")
    md = render(meta, rows)
    out = harness.write_results("decode", meta, rows, md, lambda path: plot(rows, meta, path))
    print(md)
    print(f"wrote {out}/decode.*")


if __name__ == "__main__":
    main()
