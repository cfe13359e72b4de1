"""Cross-entropy (kp_losses): kp vs the anchors, forward + backward, bf16, every provider in the same run.

    python benchmarks/bench_cross_entropy.py          # both parts, writes results/<device>/cross_entropy.*
    python benchmarks/bench_cross_entropy.py --quick  # one case a part (results/<device>/cross_entropy_quick.*)
    python benchmarks/bench_cross_entropy.py --case llama3-8b ce-128k --only kp liger   # those cells again; the
                                                      # last run's other cells stay in the results
    python benchmarks/bench_cross_entropy.py --tune   # sweep kp's tiles (_ce_fwd, _ce_bwd) and chunk rows, print
    TRITON_INTERPRET=1 python benchmarks/bench_cross_entropy.py --smoke   # CPU, tiny inputs: the mechanics only
                                                      # (kp under Triton's interpreter), nothing timed or written

Part 1, linear + cross-entropy: the loss of h @ W.T (h: tokens x hidden, W: vocab x hidden; Llama 3 8B, TinyLlama,
Qwen2 7B and Gemma 2 2B heads, the last with its final-logit softcap 30), gradients of h and W. Providers:
kp_losses.fused_linear_cross_entropy (and again with its target check off, what the check costs, and with its head's
GEMMs in float8, tensorwise and rowwise: checked against the fp32 reference with the float8 tolerance); Liger-Kernel's
liger_fused_linear_cross_entropy (its defaults: bf16 dW accumulation); Cut Cross-Entropy's linear_cross_entropy (its
defaults: impl "cce", filter_eps "high", which skips gradient blocks of negligible probability); QuACK's
cross_entropy after F.linear (no softcap); torchtune's chunked loss (8 chunks, each logits.float() then a summed
F.cross_entropy, compiled) and plain torch (fp32 logits).
Cells: ms and peak MiB, the peak of torch.cuda.max_memory_allocated over one call above what was allocated
before it: the gradients dh, dW (the same for every provider) plus each provider's own buffers.

Part 2, cross-entropy on bf16 logits (tokens x vocab): kp_losses.cross_entropy, liger_cross_entropy (writes the
gradient over its input in the forward), QuACK's cross_entropy, F.cross_entropy eager and compiled. GB/s counts
3 * tokens * vocab * 2 bytes (forward reads the logits, backward reads them and writes their gradient); the copy
column is y.copy_(x) of the same logits timed in the same rounds (2 * numel * 2 bytes).

Inputs: logits of standard deviation 4 (a next-token distribution of a few nats' entropy, not a flat one, which
would let CCE's gradient filter skip nearly everything), 10 % of targets ignore_index. Before timing, every
provider's loss and gradients are checked against an fp32 reference on the same inputs (relative error, Frobenius
norm for gradients): an anchor that fails is recorded as failed, kp failing stops the run. Times are plain launches
(triton.testing.do_bench: CCE, Liger and kp's target check read values back, so no CUDA graphs; the calls take
milliseconds), the median of --repeats rounds that each time every provider once.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics

import harness
import torch
import torch.nn.functional as F

DTYPE = torch.bfloat16
IGNORE = -100
LOGIT_STD = 4.0
CHUNKS = 8  # torchtune's num_output_chunks
LOSS_TOL, GRAD_TOL = 1e-2, 5e-2  # loose for bf16 (Liger's bf16 dW sum, CCE's filter); catch a wrong mean or scale
FLOAT8_TOL = 5e-2, 1e-1  # a float8 head's (kp.optimize's float8 budget for the gradients)
# name: (tokens, hidden, vocab, softcap)
LINEAR_CASES = {
    "llama3-8b": (8192, 4096, 128256, None),
    "tinyllama": (16384, 2048, 32000, None),
    "qwen2-7b": (8192, 3584, 152064, None),
    "gemma2-2b": (8192, 2304, 256000, 30.0),
}
CE_CASES = {"ce-128k": (8192, 128256), "ce-32k": (16384, 32000), "ce-256k": (4096, 256000)}  # name: (tokens, vocab)
LINEAR_PROVIDERS = (
    "kp",
    "kp, targets unchecked",
    "kp, float8 tensorwise",
    "kp, float8 rowwise",
    "liger",
    "cut cross-entropy",
    "quack",
    "torch compile chunked",
    "torch",
)
NO_SOFTCAP = {"quack"}  # a "-" cell in the softcap rows
CE_PROVIDERS = ("kp", "liger", "quack", "torch", "torch compile")
REPEATS = 3


# ---- providers: part 1 fn(h, w, t, softcap) -> loss, part 2 fn(x, t) -> loss ----


def _logits_loss(h, w, t, cap, reduction="mean"):
    """The loss in PyTorch: fp32 logits (capped as Gemma 2's softcap * tanh(z / softcap))."""
    z = (h @ w.t()).float()
    if cap:
        z = cap * torch.tanh(z / cap)
    return F.cross_entropy(z, t, ignore_index=IGNORE, reduction=reduction)


def _chunked(chunk_loss):
    """torchtune's CEWithChunkedOutputLoss with the output projection inside each chunk's (compiled) function."""

    def run(h, w, t, cap):
        total = sum(chunk_loss(hc, w, tc, cap, "sum") for hc, tc in zip(h.chunk(CHUNKS), t.chunk(CHUNKS)))
        return total / (t != IGNORE).sum()

    return run


def _anchor(name: str, make, out: dict) -> None:
    """out[name] = make(), or the reason it is unavailable printed (absent, or incompatible with this torch)."""
    try:
        out[name] = make()
    except Exception as e:
        print(f"{name} unavailable: {type(e).__name__}: {str(e)[:200]}")


def linear_providers(compiled: bool = True, gpu: bool = True) -> dict:
    import kp_losses

    def kp(h, w, t, cap):
        return kp_losses.fused_linear_cross_entropy(h, w, t, softcap=cap)

    def unchecked(h, w, t, cap):  # what kp's target check (one host sync a call) costs
        kept, kp_losses.functional.VALIDATE_TARGETS = kp_losses.functional.VALIDATE_TARGETS, False
        try:
            return kp(h, w, t, cap)
        finally:
            kp_losses.functional.VALIDATE_TARGETS = kept

    def float8(recipe):  # the head's three GEMMs in float8 (kp-precision's recipes)
        return lambda h, w, t, cap: kp_losses.fused_linear_cross_entropy(h, w, t, softcap=cap, float8=recipe)

    out = {"kp": kp, "kp, targets unchecked": unchecked}
    out.update({f"kp, float8 {r}": float8(r) for r in ("tensorwise", "rowwise")})
    if gpu:  # Triton or CuTe kernels: no CPU path
        _anchor("liger", _liger_linear, out)
        _anchor("cut cross-entropy", _cce, out)
        _anchor("quack", _quack_linear, out)
    out["torch compile chunked"] = _chunked(torch.compile(_logits_loss, dynamic=False) if compiled else _logits_loss)
    out["torch"] = _logits_loss
    return {name: out[name] for name in LINEAR_PROVIDERS if name in out}


def _liger_linear():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return lambda h, w, t, cap: liger_fused_linear_cross_entropy(h, w, t, ignore_index=IGNORE, softcap=cap)


def _cce():
    from cut_cross_entropy import linear_cross_entropy

    return lambda h, w, t, cap: linear_cross_entropy(h, w, t, ignore_index=IGNORE, softcap=cap)


def _quack_linear():
    from quack.cross_entropy import cross_entropy

    return lambda h, w, t, cap: cross_entropy(F.linear(h, w), t, ignore_index=IGNORE)  # cap: never given


def _quack_ce():
    from quack.cross_entropy import cross_entropy

    return lambda x, t: cross_entropy(x, t, ignore_index=IGNORE)


def ce_providers(compiled: bool = True, gpu: bool = True) -> dict:
    import kp_losses

    def torch_ce(x, t):
        return F.cross_entropy(x, t, ignore_index=IGNORE)

    out = {"kp": kp_losses.cross_entropy}
    if gpu:
        _anchor("liger", _liger_ce, out)
        _anchor("quack", _quack_ce, out)
    out["torch"] = torch_ce
    if compiled:
        out["torch compile"] = torch.compile(torch_ce, dynamic=False)
    return {name: out[name] for name in CE_PROVIDERS if name in out}


def _liger_ce():
    from liger_kernel.transformers.functional import liger_cross_entropy

    return lambda x, t: liger_cross_entropy(x, t, ignore_index=IGNORE)


# ---- inputs, checks, measurements ----


def targets(tokens: int, vocab: int, device) -> torch.Tensor:
    t = torch.randint(0, vocab, (tokens,), device=device)
    return t.masked_fill(torch.rand(tokens, device=device) < 0.1, IGNORE)


def linear_inputs(tokens: int, hidden: int, vocab: int, device="cuda"):
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, dtype=DTYPE, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device) * (LOGIT_STD / hidden**0.5)).to(DTYPE).requires_grad_()
    return h, w, targets(tokens, vocab, device)


def ce_inputs(tokens: int, vocab: int, device="cuda"):
    torch.manual_seed(0)
    x = (torch.randn(tokens, vocab, device=device) * LOGIT_STD).to(DTYPE)
    return x, targets(tokens, vocab, device)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref).norm() / ref.norm()).item()


def check(name: str, run, leaves: list, ref: tuple) -> float | str:
    """The provider's largest relative error (loss, then each leaf's gradient) against ref = (loss, grads...),
    or why it failed; kp failing raises."""
    for leaf in leaves:
        leaf.grad = None
    try:
        loss = run()
        loss.backward()
        loss_tol, grad_tol = FLOAT8_TOL if "float8" in name else (LOSS_TOL, GRAD_TOL)
        errs = [_rel(loss.detach(), ref[0]) / loss_tol] + [_rel(x.grad, g) / grad_tol for x, g in zip(leaves, ref[1:])]
        for leaf in leaves:
            leaf.grad = None
        worst = max(errs)
        if not worst <= 1.0:  # NaN fails too
            raise AssertionError(f"error / tolerance (loss, gradients): {[round(e, 2) for e in errs]}")
    except Exception as e:
        if name == "kp":
            raise
        print(f"{name} failed: {type(e).__name__}: {str(e)[:200]}")
        return f"{type(e).__name__}: {str(e)[:200]}"
    return max(errs[0] * loss_tol, *(e * grad_tol for e in errs[1:]))


def reference(loss_fn, leaves: list) -> tuple:
    """(loss, grads...) in fp32 on fp32 copies of the leaves (no TF32: torch's default)."""
    wide = [x.detach().float().requires_grad_() for x in leaves]
    loss = loss_fn(*wide)
    loss.backward()
    return (loss.detach(), *(x.grad for x in wide))


def fwd_bwd(run) -> None:
    run().backward()


def peak_mib(run, leaves: list) -> float:
    """Memory of one forward + backward above what was allocated before it."""
    for leaf in leaves:
        leaf.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fwd_bwd(run)
    torch.cuda.synchronize()
    for leaf in leaves:
        leaf.grad = None
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def rounds(calls: dict, repeats: int) -> dict:
    """Median ms of each call ({name: (call, leaves whose grad is reset)}) over `repeats` rounds, each timing every
    call once, so that the GPU's clocks drifting over the run do not rank close providers; a call that raises is
    dropped (printed)."""
    times: dict = {}
    for _ in range(repeats):
        for name, (call, leaves) in list(calls.items()):
            try:
                times.setdefault(name, []).append(harness.bench_ms(call, grad_to_none=leaves))
            except Exception as e:
                print(f"{name} failed while timed: {type(e).__name__}: {str(e)[:200]}")
                calls.pop(name), times.pop(name)
    return {name: statistics.median(ts) for name, ts in times.items()}


def checked(base: dict, runs: dict, ref: tuple) -> tuple[list[dict], dict]:
    """(failed rows, {name: error}) of runs ({name: (run, leaves)}) against the reference."""
    failed, errs = [], {}
    for name, (run, leaves) in runs.items():
        err = check(name, run, leaves, ref)
        if isinstance(err, str):
            failed.append(dict(base, provider=name, failed=err))
        else:
            errs[name] = err
    return failed, errs


def linear_case(case: str, dims: tuple, provs: dict, repeats: int, device, timing: bool) -> list[dict]:
    tokens, hidden, vocab, cap = dims
    h, w, t = linear_inputs(tokens, hidden, vocab, device)
    ref = reference(functools.partial(_logits_loss, t=t, cap=cap), [h, w])
    base = dict(part="linear", case=case, tokens=tokens, hidden=hidden, vocab=vocab, softcap=cap)
    runs = {
        n: (functools.partial(fn, h, w, t, cap), [h, w]) for n, fn in provs.items() if not cap or n not in NO_SOFTCAP
    }
    rows, errs = checked(base, runs, ref)
    del ref
    if not timing:
        return rows
    mib = {name: peak_mib(*runs[name]) for name in errs}
    ms = rounds({name: (functools.partial(fwd_bwd, runs[name][0]), [h, w]) for name in errs}, repeats)
    return rows + [dict(base, provider=n, ms=m, peak_mib=mib[n], err=errs[n]) for n, m in ms.items()]


def ce_case(case: str, dims: tuple, provs: dict, repeats: int, device, timing: bool) -> list[dict]:
    tokens, vocab = dims
    x, t = ce_inputs(tokens, vocab, device)
    ref = reference(functools.partial(F.cross_entropy, target=t, ignore_index=IGNORE), [x])
    base = dict(part="ce", case=case, tokens=tokens, vocab=vocab)
    runs = {}
    for name, fn in provs.items():
        xp = x.clone().requires_grad_()  # each its own copy: Liger writes the gradient over its input
        runs[name] = (functools.partial(fn, xp, t), [xp])
    rows, errs = checked(base, runs, ref)
    del ref
    if not timing:
        return rows
    calls = {name: (functools.partial(fwd_bwd, runs[name][0]), runs[name][1]) for name in errs}
    calls["copy"] = (functools.partial(torch.Tensor.copy_, torch.empty_like(x), x), None)
    ms = rounds(calls, repeats)
    nbytes = x.numel() * x.element_size()
    copy = 2 * nbytes / ms.pop("copy") / 1e6
    return rows + [
        dict(base, provider=n, ms=m, gbps=3 * nbytes / m / 1e6, copy_gbps=copy, err=errs[n]) for n, m in ms.items()
    ]


def run_part(part, cases: dict, names, repeats: int, device="cuda", timing: bool = True) -> list[dict]:
    """Rows of a part (linear_case or ce_case) on cases {name: dims} with the providers `names` (None: all);
    timing=False: the checks alone (each provider once)."""
    make = linear_providers if part is linear_case else ce_providers
    provs = {n: fn for n, fn in make(compiled=timing, gpu=timing).items() if not names or n in names} if cases else {}
    rows = []
    for case, dims in harness.progress(list(cases.items()) if provs else [], part.__name__):
        rows += part(case, dims, provs, repeats, device, timing)
    return rows


# ---- results ----


def _ratio(by: dict) -> str:
    """kp's time over the fastest anchor's ("-" without either)."""
    anchors = [r["ms"] for p, r in by.items() if "kp" not in p and "ms" in r]
    return f"{by['kp']['ms'] / min(anchors):.2f}" if "ms" in by.get("kp", {}) and anchors else "-"


def _cells(by: dict, names: list, second: str) -> list[str]:
    """Per provider "ms / <second>", "failed" or "-" (not measured)."""
    out = []
    for p in names:
        r = by.get(p)
        out.append("-" if r is None else "failed" if "failed" in r else f"{r['ms']:.2f} / {r[second]:.0f}")
    return out


def _table(rows: list[dict], part: str, order: tuple, before: list, after: list) -> tuple[list, list, dict]:
    """A part's providers (in `order`), table header (before, providers, after) and {case: {provider: row}}."""
    sub = [r for r in rows if r["part"] == part]
    names = [p for p in order if any(r["provider"] == p for r in sub)]
    head = ["case", *before, *names, *after]
    by_case = {c: {r["provider"]: r for r in sub if r["case"] == c} for c in dict.fromkeys(r["case"] for r in sub)}
    return names, ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"], by_case


def render(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"# Cross-entropy, bf16, {meta['device']}",
        "",
        f"torch {meta['torch']}, triton {meta['triton']}, liger-kernel {meta['liger_kernel']}, cut-cross-entropy "
        f"{meta.get('cut_cross_entropy', 'absent')}, quack-kernels {meta.get('quack_kernels', 'absent')}. Forward + "
        f"backward, median of {meta.get('repeats', REPEATS)} rounds each timing every provider once. "
        "`kp / best anchor`: kp's time over the fastest anchor's (below 1: kp is faster); `-`: not measured (QuACK "
        "has no softcap); `failed`: raised, or missed the fp32 reference (the JSON says why).",
    ]
    ratio = ["kp / best anchor"]
    names, head, by_case = _table(rows, "linear", LINEAR_PROVIDERS, ["tokens x hidden x vocab", "softcap"], ratio)
    if by_case:
        lines += ["", "## Linear + cross-entropy: ms / peak MiB above the inputs", "", *head]
    for case, by in by_case.items():
        r = next(iter(by.values()))
        cells = [f"{r['tokens']} x {r['hidden']} x {r['vocab']}", f"{r['softcap']:g}" if r.get("softcap") else "-"]
        lines.append(f"| {case} | " + " | ".join(cells + _cells(by, names, "peak_mib") + [_ratio(by)]) + " |")
    names, head, by_case = _table(rows, "ce", CE_PROVIDERS, ["tokens x vocab"], ["copy GB/s", "kp % of copy", *ratio])
    if by_case:
        lines += ["", "## Cross-entropy on logits: ms / GB/s (3 x tokens x vocab x 2 bytes)", "", *head]
    for case, by in by_case.items():
        r = next(iter(by.values()))
        copy = by.get("kp", {}).get("copy_gbps") or next((x["copy_gbps"] for x in by.values() if "copy_gbps" in x), 0)
        kp = by.get("kp", {}).get("gbps")
        tail = [f"{copy:.0f}" if copy else "-", f"{100 * kp / copy:.0f}%" if kp and copy else "-", _ratio(by)]
        lines.append(
            f"| {case} | {r['tokens']} x {r['vocab']} | " + " | ".join(_cells(by, names, "gbps") + tail) + " |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    """Bars per case and provider: part 1's ms and peak MiB, part 2's GB/s."""
    import matplotlib.pyplot as plt

    panels = (("linear", "ms", "linear + CE, ms"), ("linear", "peak_mib", "linear + CE, peak MiB"))
    panels += (("ce", "gbps", "CE on logits, GB/s"),)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, (part, value, title) in zip(axes, panels):
        sub = [r for r in rows if r["part"] == part and value in r]
        cases = list(dict.fromkeys(r["case"] for r in sub))
        names = list(dict.fromkeys(r["provider"] for r in sub))
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            ys = [next((r[value] for r in sub if r["case"] == c and r["provider"] == name), 0) for c in cases]
            ax.bar([j + i * width for j in range(len(cases))], ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle(f"cross-entropy fwd+bwd, bf16, {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merged(old: list[dict], new: list[dict], cases, names) -> list[dict]:
    """new, plus the old rows of the cells not measured now (another case, or a provider --only left out), in the
    case lists' order."""
    kept = [r for r in old if r["case"] not in cases or (names and r["provider"] not in names)]
    order = list(LINEAR_CASES) + list(CE_CASES)
    return sorted(kept + new, key=lambda r: order.index(r["case"]) if r["case"] in order else len(order))


# ---- command line ----


def tune(cases: list) -> None:
    """kp's tiles per kernel (block_c, num_warps; the other kernel at its default) on the cross-entropy cases, and
    fused_linear_cross_entropy's chunk rows on the linear cases: the fastest settings printed."""
    for case in cases:
        (_tune_tiles if case in CE_CASES else _tune_chunks)(case)


def _tune_tiles(case: str) -> None:
    import kp_core
    import kp_losses
    from kp_losses.ops import cross_entropy as ce_ops

    x, t = ce_inputs(*CE_CASES[case])
    x.requires_grad_()
    run = functools.partial(kp_losses.cross_entropy, x, t)
    for kernel in ("_ce_fwd", "_ce_bwd"):
        results = []
        for block_c, warps in itertools.product((1024, 2048, 4096, 8192, 16384), (4, 8, 16, 32)):
            kp_core.pin(kernel, block_c=block_c, num_warps=warps)
            try:
                if kernel == "_ce_fwd":
                    with torch.no_grad():
                        ms = harness.bench_ms(run)
                else:
                    ms = harness.bench_ms(functools.partial(fwd_bwd, run), grad_to_none=[x])
                results.append((ms, block_c, warps))
            except Exception as e:  # e.g. out of registers: reported, skipped
                print(f"  {kernel} block_c {block_c} num_warps {warps}: {type(e).__name__}: {str(e)[:100]}")
        kp_core.unpin(kernel)
        print(f"tune {kernel} {case} (default {ce_ops.TILES[kernel]}): best ms, block_c, num_warps")
        for ms, block_c, warps in sorted(results)[:4]:
            print(f"   {ms:.3f}  {block_c:5d}  {warps:2d}")


def _tune_chunks(case: str) -> None:
    import kp_losses

    tokens, hidden, vocab, cap = LINEAR_CASES[case]
    h, w, t = linear_inputs(tokens, hidden, vocab)
    for rows in (None, 512, 1024, 2048, 4096, 8192):
        run = functools.partial(kp_losses.fused_linear_cross_entropy, h, w, t, softcap=cap, chunk_size=rows)
        ms = harness.bench_ms(functools.partial(fwd_bwd, run), grad_to_none=[h, w])
        print(f"tune chunk rows {case}: {rows or 'default'}: {ms:.2f} ms, {peak_mib(run, [h, w]):.0f} MiB")


def smoke() -> None:
    """Each provider that runs on a CPU, once, checked against the fp32 reference on tiny inputs (kp under Triton's
    interpreter with TRITON_INTERPRET=1, else its PyTorch path); no torch.compile, no GPU-only anchor."""
    linear = {"tiny": (64, 32, 304, None), "tiny softcap": (64, 32, 304, 30.0)}  # float8: multiples of 16
    failed = run_part(linear_case, linear, None, 1, "cpu", timing=False)
    failed += run_part(ce_case, {"tiny": (48, 1000)}, None, 1, "cpu", timing=False)
    assert not failed, f"failed on the CPU: {failed}"
    print("smoke: every provider that runs on a CPU matched the fp32 reference")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first case of each part only")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="rounds of timing every provider (median kept)")
    parser.add_argument("--case", nargs="+", choices=[*LINEAR_CASES, *CE_CASES], help="only these cases")
    parser.add_argument("--only", nargs="+", choices=sorted({*LINEAR_PROVIDERS, *CE_PROVIDERS}), help="providers")
    parser.add_argument("--tune", action="store_true", help="sweep kp's settings on the cases, print the best")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny inputs, nothing timed or written")
    return parser.parse_args(argv)


def selected_cases(args: argparse.Namespace) -> list[str]:
    if args.case:
        return list(args.case)
    if args.quick:
        return [next(iter(LINEAR_CASES)), next(iter(CE_CASES))]
    return [*LINEAR_CASES, *CE_CASES]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        smoke()
        return
    harness.require_gpu()
    cases = selected_cases(args)
    if args.tune:
        tune(cases)
        return
    torch._dynamo.config.cache_size_limit = 64  # one graph per shape and softcap
    rows = run_part(linear_case, {c: LINEAR_CASES[c] for c in cases if c in LINEAR_CASES}, args.only, args.repeats)
    rows += run_part(ce_case, {c: CE_CASES[c] for c in cases if c in CE_CASES}, args.only, args.repeats)
    name = "cross_entropy_quick" if args.quick else "cross_entropy"
    if args.case or args.only:  # a table measured in several calls: the cells not measured now are the last run's
        rows = merged(harness.last_rows(name), rows, cases, args.only)
    meta = {"kernel": name, "op": "cross_entropy, fused_linear_cross_entropy", "dtype": "bfloat16"}
    meta |= {"repeats": args.repeats, "logit_std": LOGIT_STD, "ignored_fraction": 0.1}
    meta |= {"cut_cross_entropy": harness.installed("cut-cross-entropy")}
    meta |= {"quack_kernels": harness.installed("quack-kernels")}
    harness.publish(name, meta, rows, render, plot)


if __name__ == "__main__":
    main()
