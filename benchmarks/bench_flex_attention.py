"""Flex attention: kp_attention.flex vs PyTorch's FlexAttention (compiled: default, and max-autotune) and, where the
variant has one, SDPA's FlashAttention-2 / cuDNN backends, in one run.

    python benchmarks/bench_flex_attention.py            # writes results/<device>/flex_attention.{json,md,png}
    python benchmarks/bench_flex_attention.py --quick    # the first shape only, no max-autotune

Variants: causal, sliding window (1024), document mask (random document lengths), prefix-LM (1024), ALiBi
(causal), softcap 30 (causal); shapes B4 S4096 H16 and B1 S16384 H16, D 64 and 128, bf16; forward and
forward+backward TFLOP/s counted over the visited (unmasked) score elements, so the rows compare time. Also the
block-mask creation time (kp's kernel vs FlexAttention's create_block_mask) and each provider's first call
(trace and compile) time. Every provider is checked against FlexAttention's output before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import time

import harness
import torch
import torch.nn.functional as F

import kp_attention.flex as kp_flex

DTYPE = torch.bfloat16
SHAPES = [(4, 4096, 16, 128), (4, 4096, 16, 64), (1, 16384, 16, 128), (1, 16384, 16, 64)]
WINDOW = PREFIX = 1024


def variants(s: int, device):
    """name -> (score_mod, mask_mod, SDPA's equivalent or None)."""
    torch.manual_seed(0)
    lengths = torch.randint(256, 2048, (s // 256,)).cumsum(0)
    docs = torch.searchsorted(lengths, torch.arange(s), right=True).to(device)
    slopes = torch.exp2(-8.0 * torch.arange(1, 17, device=device) / 16)

    def causal(b, h, q, kv):
        return q >= kv

    def sliding(b, h, q, kv):
        return (q >= kv) & (q - kv < WINDOW)

    def document(b, h, q, kv):
        return (docs[q] == docs[kv]) & (q >= kv)

    def prefix(b, h, q, kv):
        return (kv < PREFIX) | (q >= kv)

    def alibi(score, b, h, q, kv):
        return score - slopes[h] * (q - kv)

    def softcap(score, b, h, q, kv):
        return torch.tanh(score / 30.0) * 30.0

    return {
        "causal": (None, causal, "causal"),
        "sliding window": (None, sliding, None),
        "document": (None, document, None),
        "prefix-LM": (None, prefix, None),
        "alibi": (alibi, causal, None),
        "softcap": (softcap, causal, None),
    }


def _sdpa(backend, q, k, v):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def run(quick: bool) -> list[dict]:
    from torch.nn.attention import SDPBackend
    from torch.nn.attention import flex_attention as torch_flex

    flex_default = torch.compile(torch_flex.flex_attention)
    flex_tuned = torch.compile(torch_flex.flex_attention, mode="max-autotune-no-cudagraphs")
    rows = []
    for b, s, h, d in harness.progress(SHAPES[:1] if quick else SHAPES, "flex"):
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=DTYPE, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        for name, (score_mod, mask_mod, sdpa) in variants(s, q.device).items():
            ours_mask = kp_flex.create_block_mask(mask_mod, None, None, s, s, device="cuda")
            theirs_mask = torch_flex.create_block_mask(mask_mod, None, None, s, s, device="cuda")
            visited = ours_mask.to_dense().sum().item() * 128 * 128  # score elements in visited blocks
            shape = dict(B=b, S=s, H=h, D=d, variant=name)
            for who, create in (("kp", kp_flex.create_block_mask), ("FlexAttention", torch_flex.create_block_mask)):
                ms = harness.bench_ms(functools.partial(create, mask_mod, None, None, s, s, "cuda"))
                rows.append(dict(shape, provider=f"block mask: {who}", mode="create", ms=ms))
            providers = {
                "kp": functools.partial(kp_flex.flex_attention, q, k, v, score_mod, ours_mask),
                "FlexAttention": functools.partial(flex_default, q, k, v, score_mod, theirs_mask),
            }
            if not quick:
                providers["FlexAttention max-autotune"] = functools.partial(flex_tuned, q, k, v, score_mod, theirs_mask)
            if sdpa == "causal" and score_mod is None:
                providers["sdpa flash"] = functools.partial(_sdpa, SDPBackend.FLASH_ATTENTION, q, k, v)
                providers["sdpa cudnn"] = functools.partial(_sdpa, SDPBackend.CUDNN_ATTENTION, q, k, v)
            want = None
            for provider, fn in providers.items():
                try:
                    first = first_call_ms(fn)
                    out = fn()
                    if want is None:
                        want = providers["FlexAttention"]().float()
                    err = (out.float() - want).abs().max().item()
                    assert err < 5e-2, f"{provider} {name}: differs from FlexAttention by {err}"
                    fwd = harness.bench_ms(lambda fn=fn: fn().detach())

                    def step(fn=fn, dout=dout):
                        fn().backward(dout)

                    both = harness.bench_ms(step, grad_to_none=[q, k, v])
                except Exception as e:  # a provider without this case: recorded as missing
                    print(f"{provider} {name} B{b} S{s} D{d} failed: {type(e).__name__}: {str(e)[:160]}")
                    continue
                for mode, ms, flops in (
                    ("fwd", fwd, 4 * visited * d * b * h),
                    ("fwd+bwd", both, 14 * visited * d * b * h),
                ):
                    rows.append(dict(shape, provider=provider, mode=mode, ms=ms, tflops=flops / ms / 1e9))
                rows.append(dict(shape, provider=provider, mode="first call", ms=first))
    return rows


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Flex attention, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}. Cells: TFLOP/s over the visited blocks (do_bench median);",
        "the last column is kp / FlexAttention (compiled, default mode).",
        "",
    ]
    providers = list(dict.fromkeys(r["provider"] for r in rows if "tflops" in r))
    lines += [
        "| B | S | D | variant | mode | " + " | ".join(providers) + " | kp / Flex |",
        "|---|---|---|---|---|" + "---|" * (len(providers) + 1),
    ]
    keys = list(dict.fromkeys((r["B"], r["S"], r["D"], r["variant"], r["mode"]) for r in rows if "tflops" in r))
    for key in keys:
        by = {
            r["provider"]: r for r in rows if (r["B"], r["S"], r["D"], r["variant"], r["mode"]) == key and "tflops" in r
        }
        ratio = (
            by["kp"]["tflops"] / by["FlexAttention"]["tflops"] if "kp" in by and "FlexAttention" in by else float("nan")
        )
        cells = " | ".join(f"{by[p]['tflops']:.0f}" if p in by else "-" for p in providers)
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {key[4]} | {cells} | {ratio:.2f} |")
    lines += [
        "",
        "Block-mask creation and first call, ms:",
        "",
        "| B | S | D | variant | what | ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["mode"] in ("create", "first call"):
            lines.append(
                f"| {r['B']} | {r['S']} | {r['D']} | {r['variant']} | {r['provider']} {r['mode']} | {r['ms']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    timed = [dict(r, shape=f"{r['variant']} D{r['D']} S{r['S']} {r['mode']}") for r in rows if "tflops" in r]
    harness.plot_grouped(timed, path, "shape", "tflops", "TFLOP/s", f"flex attention, bf16, {meta['device']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    harness.require_gpu()
    rows = run(args.quick)
    meta = {"kernel": "flex_attention", "dtype": "bfloat16", **harness.versions()}
    harness.publish("flex_attention", meta, rows, render, lambda path: plot(rows, meta, path))


if __name__ == "__main__":
    main()
