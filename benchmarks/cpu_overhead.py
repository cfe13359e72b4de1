"""CPU cost of one kp norm call on a tiny input, taken apart: launchers alone, on which thread, vs PyTorch.

    python benchmarks/cpu_overhead.py     (GPU only; prints microseconds per call)

At 8 x 4096 the kernels take a few microseconds, so wall time per call is the CPU's: Python, dispatch,
allocations, Triton's launcher and autograd. Used to find where kp's plain-launch fwd+bwd time goes.
"""

import time

import harness
import torch
import triton

import kp_norms
from kp_norms.ops import norm as norm_mod

ROWS, N = 8, 4096


def per_call_us(label, fn, iters=300):
    print(f"{label:45s} {harness.wall_us_per_call(fn, iters):8.1f} us", flush=True)


@triton.jit
def _empty_kernel(X, N):
    pass


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


def main():
    harness.require_gpu()
    x, w, b = (
        torch.randn(*s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in ((ROWS, N), (N,), (N,))
    )
    dy = torch.randn(ROWS, N, device="cuda", dtype=torch.bfloat16)
    v = norm_mod.Variant(rms=False)
    xd, wd, bd = x.detach(), w.detach(), b.detach()
    _, _, mean, rstd = norm_mod.forward_impl(xd, None, wd, bd, 1e-6, v)

    def fwd_bwd(fn):
        def step():
            x.grad = w.grad = b.grad = None
            fn().backward(dy)

        return step

    per_call_us("triton launch, empty kernel", lambda: _empty_kernel[(1,)](dy, 1))
    per_call_us("x * 1 fwd+bwd (builtin)", fwd_bwd(lambda: x * 1))
    per_call_us("autograd.Function identity fwd+bwd", fwd_bwd(lambda: _Identity.apply(x)))
    per_call_us("kp forward_impl (launcher alone)", lambda: norm_mod.forward_impl(xd, None, wd, bd, 1e-6, v))
    per_call_us(
        "kp backward_impl (launcher alone)", lambda: norm_mod.backward_impl(dy, None, xd, wd, bd, mean, rstd, 1e-6, v)
    )
    per_call_us("F.layer_norm fwd+bwd", fwd_bwd(lambda: torch.nn.functional.layer_norm(x, (N,), w, b, 1e-6)))
    per_call_us("kp layer_norm fwd (grad mode)", lambda: kp_norms.layer_norm(x, (N,), w, b, 1e-6))
    per_call_us("kp layer_norm fwd+bwd", fwd_bwd(lambda: kp_norms.layer_norm(x, (N,), w, b, 1e-6)))

    # The same backward launcher, timed where autograd runs it (its device thread).
    original, times = norm_mod.backward_impl, []

    def timed(*args):
        start = time.perf_counter()
        out = original(*args)
        times.append(time.perf_counter() - start)
        return out

    norm_mod.backward_impl = timed
    try:
        per_call_us("kp layer_norm fwd+bwd (timing backward_impl)", fwd_bwd(lambda: kp_norms.layer_norm(x, (N,), w, b)))
    finally:
        norm_mod.backward_impl = original
    print(f"{'backward_impl on the autograd thread (median)':45s} {sorted(times)[len(times) // 2] * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
