"""Attention: kp vs SDPA's backends (flash = FlashAttention-2, cuDNN, memory-efficient), FlexAttention and
FlashAttention-4 (CuTe DSL, `flash_attn.cute.flash_attn_func`, where installed), with kp's backend="auto" (which
routes each signature to the fastest of kp's kernel, torch's fused kernels and FlashAttention-4).

    python benchmarks/bench_attention.py            # every case below, writes results/<device>/attention.*
    python benchmarks/bench_attention.py --quick    # S = 4096 only (results/<device>/attention_quick.*)
    python benchmarks/bench_attention.py --tune     # sweep kp's tile settings (bf16, D 128), print the best
    python benchmarks/bench_attention.py --providers kp   # only these providers: printed, results/ left as it is
    python benchmarks/bench_attention.py --providers kp "kp tma"   # the forward's TMA switch against kp's default
    python benchmarks/bench_attention.py --exact-delta    # fwd+bwd at head dims 16, 32 with the exact delta on / off

TFLOP/s count the useful multiply-adds: forward 4 * B * H * D * (visible query-key pairs), forward+backward
3.5x that (FlashAttention's convention: backward = 2.5 forward). KV-cache decoding: benchmarks/bench_decode.py.
Attention calls take milliseconds, so plain launches under do_bench are the kernels' own speed here.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics

import harness
import torch
import torch.nn.functional as F

import kp_attention
import kp_core

DTYPE = torch.bfloat16
TOKENS, HEADS, HEAD_DIM = 16384, 16, 128


def visible_pairs(sq: int, sk: int, causal: bool, window: int) -> int:
    """Query-key pairs the mask keeps (bottom-right causal diagonal; window = keys to the left, -1 = all)."""
    total = 0
    for i in range(sq):
        hi = i + sk - sq if causal else sk - 1
        lo = max(0, i + sk - sq - window) if window >= 0 else 0
        total += max(0, min(hi, sk - 1) - lo + 1)
    return total


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v, causal, window, softcap=0.0):
        if window >= 0 or softcap:
            raise ValueError("SDPA has no sliding window (without an explicit mask) and no softcap")
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])

    return run


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}

    def run(q, k, v, causal, window, softcap=0.0):
        if softcap:
            raise ValueError("not timed with softcap here (a score_mod; bench_flex_attention.py times it)")
        key = (q.shape[2], k.shape[2], causal, window)
        if key not in masks:

            def mod(b, h, qi, kj):
                ok = kj <= qi if causal else kj >= 0
                return ok & (qi - kj <= window) if window >= 0 else ok

            masks[key] = create_block_mask(mod, None, None, q.shape[2], k.shape[2], device="cuda")
        return compiled(q, k, v, block_mask=masks[key], enable_gqa=q.shape[1] != k.shape[1])

    return run


def _kp(backend="kp"):
    def run(q, k, v, causal, window, softcap=0.0):
        return kp_attention.flash_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            causal=causal,
            window=(window, 0 if causal else -1),
            softcap=softcap,
            backend=backend,
        ).transpose(1, 2)

    return run


def _kp_tma(q, k, v, causal, window, softcap=0.0):
    """kp with the forward's tiles read through TMA descriptors (attention.FWD_TMA, off by default until this
    row says it is faster); the backward is the same as kp's."""
    with kp_core.pinned("_attn_fwd", tma=True):
        return _kp()(q, k, v, causal, window, softcap)


def _fa4():
    """FlashAttention-4's own entry point, as a user calls it (q, k, v as (B, S, H, D))."""
    from flash_attn.cute import flash_attn_func

    def run(q, k, v, causal, window, softcap=0.0):
        t = [x.transpose(1, 2) for x in (q, k, v)]
        left = window if window >= 0 else None
        out = flash_attn_func(
            *t, causal=causal and left is None, window_size=(left, 0 if left is not None else None), softcap=softcap
        )
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return run


def providers(with_tma: bool = False) -> dict:
    from torch.nn.attention import SDPBackend

    out = {"kp": _kp(), "kp auto": _kp("auto")}
    if with_tma:
        out["kp tma"] = _kp_tma
    out |= {
        "sdpa flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    try:
        out["flex"] = _flex()
    except Exception as e:
        print(f"FlexAttention unavailable: {type(e).__name__}: {e}")
    try:
        out["fa4"] = _fa4()
    except Exception as e:
        print(f"FlashAttention-4 unavailable: {type(e).__name__}: {e}")
    return out


def cases(quick: bool) -> list[dict]:
    seqs = (4096,) if quick else (1024, 4096, 16384)
    plain = dict(hq=HEADS, hkv=HEADS, window=-1, d=HEAD_DIM, softcap=0.0)
    out = [dict(plain, name="dense", b=TOKENS // s, s=s, causal=c) for s in seqs for c in (0, 1)]
    out.append(dict(plain, name="gqa", b=4, s=4096, hq=32, hkv=8, causal=1))
    out.append(dict(plain, name="head dim 64", b=4, s=4096, causal=1, d=64))
    out.append(dict(plain, name="softcap 30", b=4, s=4096, causal=1, softcap=30.0))
    out.append(dict(plain, name="window 1024", b=4, s=4096, causal=1, window=1024))
    if not quick:
        out.append(dict(plain, name="sliding window 4096", b=1, s=16384, causal=1, window=4096))
    return out


def check_correct(name, fn, q, k, v, causal, window, softcap) -> None:
    """Before timing: the provider agrees with fp32 attention at this size (bf16 rounding; the conformance suite
    judges the numerics). Windowed cases get the window as an explicit mask (query i sees keys i - window .. i)."""
    with torch.no_grad():
        ours = fn(q, k, v, causal, window, softcap).float()
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = (j <= i) if causal else torch.ones_like(i == j)
        if window >= 0:
            mask = mask & (j >= i - window)
        kf, vf = (t.float().repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
        s = q.float() @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vf
    err = (ours - ref).abs().max().item()
    assert err < 2e-2, f"{name} wrong (causal={causal}, window={window}, softcap={softcap}): max err {err}"


def time_ms(fn, q, k, v, causal: bool, window: int, mode: str, softcap: float = 0.0) -> float:
    if mode == "fwd":
        with torch.no_grad():
            return harness.bench_ms(lambda: fn(q, k, v, causal, window, softcap))
    do = torch.randn_like(q)
    return harness.bench_ms(lambda: fn(q, k, v, causal, window, softcap).backward(do), grad_to_none=[q, k, v])


def run_dense(quick: bool, only: list[str] | None = None, with_tma: bool = False) -> list[dict]:
    rows = []
    provs = {name: fn for name, fn in providers(with_tma).items() if not only or name in only or name == "kp"}
    for c in harness.progress(cases(quick), "attention"):
        b, s, hq, hkv, causal, window = c["b"], c["s"], c["hq"], c["hkv"], bool(c["causal"]), c["window"]
        d, softcap = c["d"], c["softcap"]
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=DTYPE, requires_grad=True) for h in (hq, hkv, hkv))
        flops = 4 * b * hq * d * visible_pairs(s, s, causal, window)
        checked = {}
        for name, fn in provs.items():
            if name.startswith(("kp", "fa4")):
                try:
                    check_correct(name, fn, q, k, v, causal, window, softcap)
                except AssertionError:
                    raise
                except Exception as e:  # a provider without this case: recorded as missing below
                    checked[name] = e
        # Every provider timed once per round, REPEATS rounds, the median kept: providers within a few percent of
        # each other (kp auto and the one it picked) are then not ranked by the GPU's clock drifting between them.
        times: dict[tuple, list] = {}
        for _ in range(REPEATS):
            for (name, fn), mode in itertools.product(provs.items(), ("fwd", "fwd+bwd")):
                if (name, mode) in checked or name in checked:
                    continue
                try:
                    times.setdefault((name, mode), []).append(time_ms(fn, q, k, v, causal, window, mode, softcap))
                except Exception as e:  # an anchor without this feature (e.g. SDPA + window): recorded as missing
                    print(f"{name} {mode} failed on {c}: {type(e).__name__}: {str(e)[:160]}")
                    checked[(name, mode)] = e
                    times.pop((name, mode), None)
        for name, mode in itertools.product(provs, ("fwd", "fwd+bwd")):
            if (name, mode) not in times:
                continue
            row = dict(case=c["name"], B=b, S=s, Hq=hq, Hkv=hkv, D=d, causal=c["causal"], window=window)
            row["softcap"] = softcap
            ms = statistics.median(times[(name, mode)])
            work = flops * (3.5 if mode == "fwd+bwd" else 1.0)
            rows.append({**row, "mode": mode, "provider": name, "ms": ms, "tflops": work / ms / 1e9})
            if name == "kp auto":
                rows[-1]["chose"] = auto_choice(q, window, softcap, training=mode == "fwd+bwd")
    return rows


REPEATS = 3


def auto_choice(q, window: int, softcap: float, training: bool) -> str:
    """What kp's backend="auto" decided for this benchmark call (kp_attention.backend.decided())."""
    from kp_attention import backend

    shape = tuple(q.transpose(1, 2).shape)
    for key, choice in backend.decided().items():
        if key[0] == "kp_attention.flash_attention" and key[1] == shape and key[6] == softcap and key[-1] == training:
            if key[5][0] == window:
                return choice
    return "?"


def render(meta: dict, dense: list[dict]) -> str:
    names = list(dict.fromkeys(r["provider"] for r in dense))
    lines = [
        f"# Attention, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, flash-attn-4 {meta.get('flash_attn_4', 'absent')}. "
        f"Median of {REPEATS} rounds, each timing every provider once. "
        '`kp auto`: kp_attention.flash_attention(backend="auto"), its choice per row in the last column; '
        "`auto / best`: its TFLOP/s over the best provider's.",
    ]
    lines += [
        "",
        "## TFLOP/s (useful FLOPs)",
        "",
        "| case | B x S | Hq/Hkv | D | causal | mode | " + " | ".join(names) + " | auto / best | auto chose |",
    ]
    lines.append("|---|---|---|---|---|---|" + "---|" * (len(names) + 2))
    for key in dict.fromkeys(_key(r) for r in dense):
        by = {r["provider"]: r for r in dense if _key(r) == key}
        case, b, s, hq, hkv, d, causal, mode = key
        cells = [f"{by[p]['tflops']:.0f}" if p in by else "-" for p in names]
        best = max((r["tflops"] for p, r in by.items() if p != "kp auto"), default=None)
        auto = by.get("kp auto")
        ratio = f"{auto['tflops'] / best:.2f}" if auto and best else "-"
        cells += [ratio, auto.get("chose", "-") if auto else "-"]
        lines.append(f"| {case} | {b} x {s} | {hq}/{hkv} | {d} | {causal} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _key(r: dict) -> tuple:
    return (r["case"], r["B"], r["S"], r["Hq"], r["Hkv"], r.get("D", HEAD_DIM), r["causal"], r["mode"])


def plot(dense: list[dict], meta: dict, path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        rows = [r for r in dense if r["mode"] == mode and r["case"] == "dense"]
        for name in dict.fromkeys(r["provider"] for r in rows):
            for causal, style in ((0, "-"), (1, "--")):
                pts = sorted((r["S"], r["tflops"]) for r in rows if r["provider"] == name and r["causal"] == causal)
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{name}{' causal' * causal}"
                )
        ax.set_xscale("log", base=2)
        ax.set_title(f"attention {mode}, bf16, D {HEAD_DIM}, {TOKENS} tokens x {HEADS} heads")
        ax.set_xlabel("sequence length")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=7)
    fig.suptitle(meta["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def tune(kernels: list[str] | None = None, seq: int = 4096) -> None:
    """Time kp under each tile setting (kp_core.pin per kernel; all three kernels, or `kernels`) at sequence
    length `seq` (TOKENS // seq sequences), causal and not; settings that do not compile (shared memory) are
    skipped."""
    fn = providers()["kp"]
    sweeps = {
        "_attn_fwd": [(bm, bn, w, st) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)],
        "_attn_bwd_dkdv": [(bm, bn, w, st) for bm in (16, 32, 64) for bn in (64, 128) for w in (4, 8) for st in (2, 3)],
        "_attn_bwd_dq": [(bm, bn, w, st) for bm in (64, 128) for bn in (16, 32, 64) for w in (4, 8) for st in (2, 3)],
    }
    b, s = TOKENS // seq, seq
    q, k, v = (torch.randn(b, HEADS, s, HEAD_DIM, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3))
    for kernel, settings in sweeps.items():
        if kernels and kernel not in kernels:
            continue
        for causal in (False, True):
            fwd = kernel == "_attn_fwd"
            flops = 4 * b * HEADS * HEAD_DIM * visible_pairs(s, s, causal, -1) * (1.0 if fwd else 3.5)
            results = []
            for cfg in settings:
                kp_core.pin(kernel, **dict(zip(("block_m", "block_n", "num_warps", "num_stages"), cfg)))
                try:
                    ms = time_ms(fn, q, k, v, causal, -1, "fwd" if fwd else "fwd+bwd")
                except Exception as e:  # out of shared memory, or a compile failure: reported, skipped
                    print(f"  {kernel} {cfg}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                results.append((flops / ms / 1e9, cfg))
            print(f"tune {kernel} S={s} causal={causal}: best TFLOP/s (BLOCK_M, BLOCK_N, warps, stages)")
            for tflops, cfg in sorted(results, reverse=True)[:4]:
                print(f"   {tflops:6.0f}  {cfg}")
            kp_core.unpin(kernel)


def exact_delta_cost(seq: int = 4096) -> None:
    """fwd+bwd of kp at the head dims that take the exact delta (attention.EXACT_DELTA_MAX_HEAD_DIM: dQ's first
    pass sums P * dP) against the same calls with it off (delta from rowsum(dO * O)), bf16, causal and not."""
    from kp_attention.ops import attention

    b = TOKENS // seq
    for d in (16, 32):
        q, k, v = (torch.randn(b, HEADS, seq, d, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3))
        for causal in (False, True):
            ms = {}
            for on in (True, False):
                attention.EXACT_DELTA_MAX_HEAD_DIM = 32 if on else 0
                ms[on] = time_ms(_kp(), q, k, v, causal, -1, "fwd+bwd")
            attention.EXACT_DELTA_MAX_HEAD_DIM = 32
            print(
                f"exact delta, D {d}, B{b} S{seq} H{HEADS}, causal={causal}: {ms[True]:.3f} ms on, "
                f"{ms[False]:.3f} ms off ({ms[True] / ms[False]:.2f}x)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of timing every provider (median kept)")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--tune-seq", type=int, default=4096, help="with --tune: the sequence length")
    parser.add_argument("--tune-kernels", nargs="*", help="with --tune: only these kernels (e.g. _attn_bwd_dq)")
    parser.add_argument("--providers", nargs="+", help="time only these (kp always, to check correctness)")
    parser.add_argument("--exact-delta", action="store_true", help="the exact delta's cost at head dims 16, 32")
    parser.add_argument("--tma", action="store_true", help="also time kp with the forward's TMA loads")
    args = parser.parse_args()
    harness.require_gpu()
    if args.exact_delta:
        exact_delta_cost()
        return
    if args.tune:
        tune(args.tune_kernels, args.tune_seq)
        return
    torch._dynamo.config.cache_size_limit = 64
    global REPEATS
    REPEATS = args.repeats
    dense = run_dense(args.quick, args.providers, args.tma)
    meta = {"kernel": "attention", "dtype": "bfloat16", "head_dim": HEAD_DIM, **harness.versions()}
    meta["flash_attn_4"] = harness.installed("flash-attn-4")
    md = render(meta, dense)
    if args.providers:  # a partial table (e.g. kp alone, to compare two versions of its kernels) is not the record
        print(md)
        return
    name = "attention_quick" if args.quick else "attention"  # the S = 4096 rows alone: a record of their own
    out = harness.write_results(name, meta, dense, md, lambda path: plot(dense, meta, path))
    print(md)
    print(f"wrote {out}/{name}.*")
    assert math.isfinite(sum(r.get("tflops", 0.0) for r in dense))


if __name__ == "__main__":
    main()
