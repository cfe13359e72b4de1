"""Float8 scaled matmul: launcher, the PyTorch reference path and the op declaration.

    C = act(A @ B * scales + bias), rounded once to C's dtype

A (M, K) and B (K, N) are float8 (e4m3fn or e5m2, any pairing), A row-major and B column-major (B = W.t() of a
row-major (N, K) weight, as torch._scaled_mm takes it); products are exact and summed in float32. Scales are
float32 dequantisation scales (x ~ data * scale), one per block of the operand:

    scale_a        ()  tensorwise    (M, 1) per row      (M, ceil(K/128)) 1 x 128 blocks   (ceil(M/128), ceil(K/128))
    scale_b        ()  tensorwise    (1, N) per column   (ceil(K/128), N) 128 x 1 blocks   (ceil(K/128), ceil(N/128))

A scale constant along K multiplies the float32 sum once; a blockwise one multiplies each 128-long partial sum
(the DeepSeek-V3 recipe). Then bias (float32 or C's dtype), the activation (relu, gelu, gelu_tanh, silu:
kp_core.Activation, the kernels' forms from kp_core.activation_kernels) and the cast, all in float32 registers:
no extra pass over C.

Accumulation. Hopper's float8 tensor cores sum products in an accumulator narrower than float32, so a long K
loses bits. use_fast_accum=False (the default, as torch._scaled_mm's) adds each 128-deep partial sum to the float32
one, which is what cuBLASLt does too (measured: the same error as torch._scaled_mm's); True lets the tensor cores
sum all of K (torchao uses it for the forward). Triton's promotion every 128 runs at about a third of the fast
kernel's speed on the H100 (benchmarks/results), so a precise call whose scales are constant along K goes to
torch._scaled_mm (cuBLASLt) where the installed torch takes its dtypes and scale shapes, the epilogue then one
elementwise kernel over its float32 product (kp_precision.ops.scaled_mm_route); so does a fast call with no bias
and no activation. Blockwise calls (1 x 128 blocks of
A, 128 x 128 of B) go to cuBLASLt's blockwise recipe (torch.nn.functional.scaled_mm) where the installed torch has
it: the kernel's blockwise path promotes every 128 as it does, at about 0.55x its speed. Everything else runs the
kernel.

Kernel: kp_precision.ops.scaled_mm_kernels (its _epilogue runs after cuBLASLt). Declaration: SCALED_MM
(kp::scaled_mm). Spec: conformance/specs/test_scaled_mm.py.
"""

import torch

import kp_core
from kp_core.activation import NAMES, reference
from kp_core.float8 import FP8_DTYPES, soft_float8
from kp_precision.ops import scaled_mm_route as route

if kp_core.has_triton():
    from kp_precision.ops import scaled_mm_kernels as kernels

OP = "kp::scaled_mm"
PACKAGE = "kp-precision"
SPEC = "scaled_mm"
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")  # the op's activation names (kp_core.activation.NAMES)
SCALE_K = 128
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M) on a GPU: the float8 shape of Triton's own Hopper
# matmul tutorial (a 128 x 256 tile, 128 deep, 3 stages: 144 KiB of shared memory); a benchmark may pin others.
TILE = (128, 256, 128, 8, 3, 8)
# How many elements of K a precise float8 tensor-core sum runs before it is added to the float32 accumulator
# (use_fast_accum=False); 0 is no limit (use_fast_accum=True, Triton's default on Hopper).
PROMOTE_K = 128
# Blockwise scales: a second accumulator per K-block, so a smaller tile (measured on the H100: 627 TFLOP/s at
# 8192^3 against 296 with TILE, which spills).
BLOCKWISE_TILE = (128, 128, 128, 8, 4, 8)
# The kernel's own float8 decoding on a GPU (pinned by tests): float32 tiles, which need less shared memory.
SOFT_TILE = (64, 64, 32, 4, 2, 8)
# The interpreter runs programs one after another: small tiles cross block and scale boundaries in small tests.
INTERPRET_TILE = (16, 32, 32, 1, 1, 2)


def scale_layout(scale: torch.Tensor, rows: int, k: int, operand: str) -> tuple[int, bool] | None:
    """(rows per scale element, whether the scale changes along K) for an operand with `rows` rows (M of A, N of
    B) and depth k, from the scale's shape (scale_b given as (K-blocks, N-blocks)); None if no recipe has it."""
    kb = kp_core.cdiv(k, SCALE_K)
    shape = tuple(scale.shape)
    if scale.numel() == 1 and scale.dim() <= 2:
        return (1, False)  # stride 0 (see _scale_view): every row reads the one value
    if operand == "b":
        shape = shape[::-1]
    if shape == (rows, 1):
        return (1, False)
    if shape == (rows, kb):
        return (1, True)
    if shape == (kp_core.cdiv(rows, SCALE_K), kb):
        return (SCALE_K, True)
    return None


def _scale_view(scale: torch.Tensor, operand: str) -> tuple[torch.Tensor, int, int]:
    """The scale with its strides as (along rows, along K) of its operand (0 where it is constant)."""
    if scale.numel() == 1:
        return scale, 0, 0
    s = scale if operand == "a" else scale.t()
    return s, (s.stride(0) if s.shape[0] > 1 else 0), (s.stride(1) if s.shape[1] > 1 else 0)


def _expand(scale: torch.Tensor, rows: int, k: int, layout: tuple[int, bool], operand: str) -> torch.Tensor:
    """The scale of each element of the operand as (rows, k) float32."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).float().expand(rows, k)
    s = scale if operand == "a" else scale.t()
    per_rows, along_k = layout
    s = s.float().repeat_interleave(per_rows, 0)[:rows]
    return s.repeat_interleave(SCALE_K, 1)[:, :k] if along_k else s.expand(rows, k)


def _reference(a, b, scale_a, scale_b, bias, activation, out_dtype):
    """float32 PyTorch: dequantised operands, one matmul, the epilogue (the CPU path without Triton)."""
    m, k = a.shape
    n = b.shape[1]
    af = a.float() * _expand(scale_a, m, k, scale_layout(scale_a, m, k, "a"), "a")
    bf = b.float() * _expand(scale_b, n, k, scale_layout(scale_b, n, k, "b"), "b").t()
    y = af @ bf
    if bias is not None:
        y = y + bias.float()
    return reference(y, NAMES[activation]).to(out_dtype)


def forward(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out_dtype: torch.dtype,
    use_fast_accum: bool,
) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=out_dtype, device=a.device)
    if k == 0:  # an empty sum: the epilogue of zeros, no launch
        return _reference(a, b, scale_a, scale_b, bias, activation, out_dtype)
    backend = kp_core.choose_backend(OP, a)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP)
        return _reference(a, b, scale_a, scale_b, bias, activation, out_dtype)
    bias = None if bias is None else bias.contiguous()  # the epilogue reads bias[col]
    rows_a, k_a = scale_layout(scale_a, m, k, "a")
    rows_b, k_b = scale_layout(scale_b, n, k, "b")
    layouts = ((rows_a, k_a), (rows_b, k_b))
    plain = bias is None and activation == "none"
    if backend == kp_core.TRITON and route.routes(a, b, scale_a, scale_b, layouts, use_fast_accum, plain):
        y = route.run(a, b, scale_a, scale_b, layouts, bias, activation, out_dtype, use_fast_accum)
        if y is not None:
            return y
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)  # after the route: it returns its own
    soft = soft_float8(backend)
    tile = BLOCKWISE_TILE if k_a or k_b else TILE
    bm, bn, bk, warps, stages, group = INTERPRET_TILE if backend == kp_core.INTERPRET else SOFT_TILE if soft else tile
    promote = 0 if use_fast_accum else PROMOTE_K
    s = kp_core.settings(
        "_scaled_mm", block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, promote_k=promote
    )
    bm, bn, bk = s["block_m"], s["block_n"], s["block_k"]
    if k_a or k_b:  # a K-block of the tile must sit inside one scale block (powers of two)
        bk = min(bk, SCALE_K)
    sa, sa_m, sa_k = _scale_view(scale_a, "a")
    sb, sb_n, sb_k = _scale_view(scale_b, "b")
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(n, bn)
    kp_core.check_index_fits("kp_precision.scaled_mm", "the launch grid (programs)", grid)
    bt = b.t()  # (N, K) row-major: B's columns are its rows
    a_in, b_in = (a.view(torch.uint8), bt.view(torch.uint8)) if soft else (a, bt)
    args = (a_in, a.stride(0), b_in, bt.stride(0), sa, sa_m, sa_k, sb, sb_k, sb_n)
    args += (out if bias is None else bias, out, out.stride(0), out, m, n, k)
    consts = dict(
        SA_ROWS=rows_a,
        SA_K=k_a,
        SB_COLS=rows_b,
        SB_K=k_b,
        SCALE_K=SCALE_K,
        HAS_BIAS=bias is not None,
        ACT=int(NAMES[activation]),
        STORE_PRE=False,
        A_E5M2=a.dtype == torch.float8_e5m2,
        B_E5M2=b.dtype == torch.float8_e5m2,
        SOFT=soft,
        PROMOTE_K=min(s["promote_k"], bk),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=group,
    )
    kp_core.launch(OP, backend, kernels._scaled_mm, (grid,), args, consts, s["num_warps"], s["num_stages"])
    return out


def _fake(a, b, scale_a, scale_b, bias, activation, out_dtype, use_fast_accum):
    return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)


# traced into compiled graphs (kp_core.library): packages/kp/tests/test_inline.py
SCALED_MM = kp_core.op(OP, forward, _fake, package=PACKAGE, spec=SPEC, dtypes=FP8_DTYPES, inline=True)
