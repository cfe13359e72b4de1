"""Float8 scaled matmul (kp_precision.scaled_mm): kp vs the anchors in one run.

    python benchmarks/bench_scaled_mm.py          # writes results/<device>/scaled_mm.*
    python benchmarks/bench_scaled_mm.py --tune   # sweep kp's tile settings (kp_core.pin("_scaled_mm", ...))

C (M, N) = A (M, K) float8_e4m3fn @ B (K, N) float8_e4m3fn (column-major), bf16 out, at the Llama MLP shapes.
Recipes ("mode"): tensorwise, rowwise (per row of A, per column of B), blockwise (1x128 A, 128x128 B), and
rowwise with the epilogue "bias+gelu". Anchors: torch._scaled_mm (cuBLASLt) with the same scales, its epilogue
done by separate PyTorch ops where it has none; torch.nn.functional.scaled_mm's blockwise recipe where the
installed torch takes it on this GPU; bf16 torch.mm (cuBLAS) as the dense baseline float8 must beat.
TFLOP/s = 2*M*N*K / time, CUDA-graph timing (GPU time alone).
"""

from __future__ import annotations

import argparse
import itertools

import harness
import torch
import torch.nn.functional as F

import kp_core
import kp_precision

FP8 = torch.float8_e4m3fn
SHAPES = [(8192, 8192, 8192), (16384, 4096, 14336), (16384, 14336, 4096), (4096, 4096, 11008), (128, 4096, 14336)]
MODES = ("tensorwise", "rowwise", "blockwise", "rowwise bias+gelu")


def operands(m, k, n, mode):
    """(a, b, scale_a, scale_b, bias) for `mode`, the scales as the recipe's quantisation would give them."""
    a = (torch.randn(m, k, device="cuda") * 100).clamp(-448, 448).to(FP8)
    b = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(FP8).t()
    if mode == "tensorwise":
        sa, sb = torch.tensor(0.01, device="cuda"), torch.tensor(0.02, device="cuda")
    elif mode.startswith("rowwise"):
        sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    else:
        sa = torch.rand(m, k // 128, device="cuda") + 0.5
        sb = (torch.rand(n // 128, k // 128, device="cuda") + 0.5).t()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if "bias" in mode else None
    return a, b, sa, sb, bias


def providers(mode: str, m: int, k: int, n: int) -> dict:
    a, b, sa, sb, bias = operands(m, k, n, mode)
    act = "gelu" if "gelu" in mode else None

    def kp(fast, route=True):
        def f():
            with kp_core.pinned("scaled_mm_route", cublas=route):
                return kp_precision.scaled_mm(
                    a, b, sa, sb, bias=bias, activation=act, out_dtype=torch.bfloat16, use_fast_accum=fast
                )

        return f

    out = {"kp": kp(False), "kp fast": kp(True)}
    if mode != "blockwise":
        out["kp kernel (precise, route off)"] = kp(False, route=False)
        for fast, tag in ((False, ""), (True, " fast")):
            if act:  # cuBLASLt takes the bias; the activation is one more pass over C
                out[f"torch._scaled_mm{tag} + gelu"] = lambda fast=fast: F.gelu(
                    torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast)
                )
            else:
                out[f"torch._scaled_mm{tag}"] = lambda fast=fast: torch._scaled_mm(
                    a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast
                )
    else:
        try:
            recipe = F.ScalingType
            sa_c, sb_c = sa.t().contiguous().t(), sb.t().contiguous().t()  # the layouts cuBLASLt's recipe takes
            f = lambda: F.scaled_mm(a, b, sa_c, recipe.BlockWise1x128, sb_c, recipe.BlockWise128x128)  # noqa: E731
            f()
            out["F.scaled_mm blockwise"] = f
        except Exception as e:  # absent on this torch or GPU: reported, not hidden
            print(f"F.scaled_mm blockwise unavailable: {type(e).__name__}: {str(e)[:200]}")
    x16, w16 = torch.randn(m, k, device="cuda", dtype=torch.bfloat16), torch.randn(k, n, device="cuda").bfloat16()
    out["bf16 torch.mm"] = lambda: torch.mm(x16, w16)
    return out, (a, b, sa, sb, bias, act)


def check_correct(args) -> None:
    """Before timing: kp within 1 % (relative Frobenius) of the float32 matmul of the dequantised operands."""
    a, b, sa, sb, bias, act = args
    y = kp_precision.scaled_mm(
        a, b, sa, sb, bias=None if bias is None else bias.float(), activation=act, out_dtype=torch.float32
    )
    m, k = a.shape
    ea = sa.reshape(1, 1) if sa.numel() == 1 else sa.repeat_interleave(k // sa.shape[1], 1)
    eb = sb.reshape(1, 1) if sb.numel() == 1 else sb.t().repeat_interleave(k // sb.shape[0], 1)
    if eb.shape[0] not in (1, b.shape[1]):
        eb = eb.repeat_interleave(128, 0)
    ref = (a.float() * ea) @ (b.float() * eb.t())
    if bias is not None:
        ref = ref + bias.float()
    ref = F.gelu(ref) if act else ref
    rel = ((y - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"kp scaled_mm differs from the dequantised float32 matmul: relative error {rel:.3g}"


def tune() -> None:
    """The kernel's tile for fast tensorwise calls at a large and a small M (the route pinned off: a precise
    call would time cuBLASLt). Blockwise's own tile is BLOCKWISE_TILE, swept when it was set."""
    for m, k, n in (SHAPES[0], SHAPES[4]):
        kp = providers("tensorwise", m, k, n)[0]["kp fast"]
        results = []
        for bm, bn, bk, warps, stages in itertools.product((64, 128), (128, 256), (64, 128), (4, 8), (3, 4)):
            kp_core.pin("_scaled_mm", block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
            try:
                with kp_core.pinned("scaled_mm_route", cublas=False):
                    ms = harness.bench_graph_ms(kp)
            except Exception as e:  # out of shared memory / registers: not a candidate
                print(f"  {bm}x{bn}x{bk} w{warps} s{stages}: {type(e).__name__}")
                continue
            results.append((2 * m * n * k / ms / 1e9, bm, bn, bk, warps, stages))
        kp_core.unpin("_scaled_mm")
        print(f"tune {m}x{k}x{n} tensorwise fast: best TFLOP/s, block_m, block_n, block_k, num_warps, num_stages")
        for r in sorted(results, reverse=True)[:5]:
            print("   " + "  ".join(f"{v:.0f}" if isinstance(v, float) else str(v) for v in r))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tune", action="store_true")
    harness.require_gpu()
    if parser.parse_args().tune:
        tune()
        return
    rows = []
    for (m, k, n), mode in harness.progress(list(itertools.product(SHAPES, MODES)), "scaled_mm"):
        fns, args = providers(mode, m, k, n)
        check_correct(args)
        for name, fn in fns.items():
            row = dict(M=m, K=k, N=n, mode=mode, provider=name)
            for timing in ("graph", "eager"):
                bench = harness.bench_graph_ms if timing == "graph" else harness.bench_ms
                try:
                    ms = bench(fn)
                except Exception as e:
                    print(f"{name} ({timing}) failed at {m}x{k}x{n} {mode}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                row.update({f"ms_{timing}": ms, f"tflops_{timing}": 2 * m * n * k / ms / 1e9})
            rows.append(row)
    meta = {"kernel": "scaled_mm", "op": "scaled_mm", "dtype": "float8_e4m3fn -> bfloat16"}
    meta.update(harness.versions())
    note = (
        "Cells: TFLOP/s (2*M*N*K / time). kp: use_fast_accum=False (precise: tensorwise and rowwise go to "
        "torch._scaled_mm, see the route), kp fast: use_fast_accum=True (kp's kernel). Ratio: kp / torch at the same "
        "accumulation (bf16 torch.mm is the dense baseline)."
    )
    md = harness.render_tflops("Float8 scaled matmul, e4m3 x e4m3 -> bf16", meta, rows, note, _ratio)
    title = "float8 scaled matmul, e4m3 -> bf16"
    out = harness.write_results(
        "scaled_mm", meta, rows, md, lambda p: harness.plot_tflops(rows, meta, p, SHAPES, MODES, title)
    )
    print(md)
    print(f"wrote {out}")


def _ratio(by: dict) -> str:
    """kp / torch at the same accumulation (precise: torch._scaled_mm, fast: its use_fast_accum=True)."""
    out = []
    for tag in ("", " fast"):
        ours = by.get(f"kp{tag}")
        theirs = [v for p, v in by.items() if p.startswith("torch._scaled_mm") and (" fast" in p) == bool(tag)]
        theirs += [v for p, v in by.items() if p.startswith("F.scaled_mm")]
        if ours and theirs:
            out.append(f"{tag.strip() or 'precise'} {ours / max(theirs):.2f}x")
    return ", ".join(out) or "-"


if __name__ == "__main__":
    main()
