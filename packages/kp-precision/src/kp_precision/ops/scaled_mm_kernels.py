"""Triton kernel of the float8 scaled matmul (the maths is in kp_precision.ops.scaled_mm's docstring).

One program computes a BLOCK_M x BLOCK_N tile of C = A @ B, A (M, K) row-major and B (K, N) column-major, with
a float32 accumulator; float8 tiles go to tl.dot as they are on a GPU (tensor cores), or, when SOFT (always
under the interpreter, whose float8 decoding is wrong for NaN and for some e5m2 values), as float32 decoded
exactly from their bits. A scale that is constant along K
(tensorwise, per row, per column) is applied once in the epilogue; one that changes every SCALE_K elements of K
(blockwise) multiplies each SCALE_K-long partial product, so BLOCK_K divides SCALE_K. Then bias, the activation
(ACT: a kp_core.Activation value; its Triton form is kp_core.activation_kernels') and the cast to C's dtype, still
in registers. `_epilogue` is the same epilogue as a pass of its own, over a float32 product cuBLASLt made.
"""

import triton
import triton.language as tl

from kp_core import jit_keys
from kp_core.activation_kernels import act_fwd
from kp_core.float8_kernels import fp8_value
from kp_precision.ops.kernel_helpers import grouped_tile


@triton.jit
def _operand(ptr, mask, E5M2: tl.constexpr, SOFT: tl.constexpr):
    # one return: the compiler type-checks every return of a function, even one a constexpr branch skips
    if SOFT:  # ptr is a uint8 view of the float8 data
        x = fp8_value(tl.load(ptr, mask=mask, other=0).to(tl.int32), E5M2)
    else:
        x = tl.load(ptr, mask=mask, other=0.0)
    return x


@triton.jit
def _dot(a, b, acc, SOFT: tl.constexpr, PROMOTE_K: tl.constexpr):
    if SOFT:  # float32 operands: exact products (no TF32), as the float8 ones are
        acc = tl.dot(a, b, acc, input_precision="ieee")
    elif PROMOTE_K == 0:
        acc = tl.dot(a, b, acc)
    else:
        # Hopper's float8 tensor-core instructions sum in a narrower accumulator; every PROMOTE_K elements of K
        # the partial sum is added to the float32 one (Triton's max_num_imprecise_acc; 16-bit dots ignore it)
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_K)
    return acc


@triton.jit
def _scaled_mm(
    A,
    stride_am,
    B,
    stride_bn,
    SA,
    stride_sam,
    stride_sak,
    SB,
    stride_sbk,
    stride_sbn,
    BIAS,
    C,
    stride_cm,
    PRE,
    M,
    N,
    K,
    SA_ROWS: tl.constexpr,
    SA_K: tl.constexpr,
    SB_COLS: tl.constexpr,
    SB_K: tl.constexpr,
    SCALE_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    STORE_PRE: tl.constexpr,
    A_E5M2: tl.constexpr,
    B_E5M2: tl.constexpr,
    SOFT: tl.constexpr,
    PROMOTE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """C = act(sum_k A B * scales + bias). A scale's element for row m (column n) is at (m // SA_ROWS) *
    stride_sam (n // SB_COLS * stride_sbn); SA_K / SB_K say whether it also changes along K, every SCALE_K
    elements (then its K index is k // SCALE_K). Tensorwise scales have stride 0. STORE_PRE: also store the
    value before the activation in PRE (C's strides), for a backward. With float16 / bfloat16 operands and unit
    scales this is kp_precision's fused linear + activation."""
    rm, rn = grouped_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    a_ptr = A + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptr = B + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]
    sa_row = SA + (rm // SA_ROWS) * stride_sam
    sb_col = SB + (rn // SB_COLS) * stride_sbn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        a = _operand(a_ptr, (rm < M)[:, None] & (rk < K - k)[None, :], A_E5M2, SOFT)
        b = _operand(b_ptr, (rk < K - k)[:, None] & (rn < N)[None, :], B_E5M2, SOFT)
        if SA_K or SB_K:
            part = _dot(a, b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), SOFT, PROMOTE_K)
            if SA_K:
                part *= tl.load(sa_row + (k // SCALE_K) * stride_sak, mask=rm < M, other=0.0)[:, None]
            if SB_K:
                part *= tl.load(sb_col + (k // SCALE_K) * stride_sbk, mask=rn < N, other=0.0)[None, :]
            acc += part
        else:
            acc = _dot(a, b, acc, SOFT, PROMOTE_K)
        a_ptr += BLOCK_K
        b_ptr += BLOCK_K
    if not SA_K:
        acc *= tl.load(sa_row, mask=rm < M, other=0.0)[:, None]
    if not SB_K:
        acc *= tl.load(sb_col, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    offs = rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
    if STORE_PRE:
        tl.store(PRE + offs, acc.to(PRE.dtype.element_ty), mask=mask)
    acc = act_fwd(acc, ACT)
    tl.store(C + offs, acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _epilogue(C, BIAS, OUT, n, cols, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """OUT = act(C + BIAS) over n contiguous elements of a float32 (rows, cols) product, in float32, one rounding
    to OUT's dtype: the epilogue of a product cuBLASLt made (OUT may be C)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(C + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(BIAS + offs % cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offs, act_fwd(y, ACT).to(OUT.dtype.element_ty), mask=mask)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
