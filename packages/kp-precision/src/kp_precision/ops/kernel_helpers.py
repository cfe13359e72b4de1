"""Triton helpers kp-precision's kernels share: tile indexing (the float8 bit codecs and casts are kp-core's,
kp_core.float8_kernels, shared with kp-norms' float8 output).

Helpers, not launchable kernels (hence not a `*_kernels` module): quantize_kernels, scaled_mm_kernels, mx_kernels,
fake_quantize_kernels and linear_activation_kernels call them.
"""

import triton
import triton.language as tl

from kp_core import jit_keys


@triton.jit
def tile_of(M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's tile of an (M, K) array cut into BLOCK_M x BLOCK_K tiles (row-major order of tiles): its
    rows, its columns, their in-bounds mask and its first column."""
    n_k = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    k0 = (pid % n_k) * BLOCK_K
    rows = (pid // n_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = k0 + tl.arange(0, BLOCK_K)
    return rows, cols, (rows < M)[:, None] & (cols < K)[None, :], k0


@triton.jit
def tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """First row and column of output tile number `tile`, in grouped order: GROUP_M row tiles share each column
    tile while its B block is in L2."""
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    first_m = (tile // (GROUP_M * n_n)) * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * n_n)) % size_m
    pid_n = (tile % (GROUP_M * n_n)) // size_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def grouped_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """The rows and columns of this program's tile of C (tile_origin's order)."""
    row, col = tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    return row + tl.arange(0, BLOCK_M), col + tl.arange(0, BLOCK_N)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
