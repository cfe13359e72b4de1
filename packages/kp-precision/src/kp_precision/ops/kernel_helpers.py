"""Triton helpers kp-precision's kernels share: float8 / minifloat bits and their values, and tile indexing.

Helpers, not launchable kernels (hence not a `*_kernels` module): quantize_kernels, scaled_mm_kernels, mx_kernels,
fake_quantize_kernels and linear_activation_kernels call them. The bit codecs are integer arithmetic, exact on
every backend: Triton's interpreter converts to float8 with its own rounding and decodes NaN and some e5m2
values wrongly, and nothing converts to float4.
"""

import triton
import triton.language as tl

# ---- float8 and smaller floats as bits ----


@triton.jit
def abs_bits(x):
    """|x| (float32) as int32 bits, ordered as the floats are, NaN above +inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def minifloat_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr, SIGN: tl.constexpr, NAN: tl.constexpr):
    """y (float32, NaN or within the format's range) rounded to nearest-even as the bits (int32) of a small
    sign-magnitude float: MANT mantissa bits, exponent bias BIAS, the sign at bit SIGN, NaN as NAN. Integer
    arithmetic: Triton's interpreter converts to float8 with its own rounding, and nothing converts to float4.
    Normal results: round the float32 mantissa to MANT bits and rebias the exponent; subnormal results:
    multiples of the smallest subnormal, rounded with the 2**23 trick."""
    SHIFT: tl.constexpr = 23 - MANT
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> (31 - SIGN)) & (1 << SIGN)
    a = bits & 0x7FFFFFFF
    normal = a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)
    normal = (normal >> SHIFT) - ((127 - BIAS) << MANT)
    # |y| below the smallest normal 2**(1 - BIAS): count steps of the smallest subnormal 2**(1 - BIAS - MANT)
    steps = tl.abs(y) * (2.0 ** (BIAS + MANT - 1))
    sub = ((steps + 8388608.0) - 8388608.0).to(tl.int32)
    out = tl.where(a < ((128 - BIAS) << 23), sub, normal)
    out = tl.where(a > 0x7F800000, NAN, out)  # with y's sign, as torch
    return out | sign


@triton.jit
def minifloat_value(b, MANT: tl.constexpr, BIAS: tl.constexpr, SIGN: tl.constexpr):
    """The bits (int32) of a small sign-magnitude float as float32, without its special values: normal values
    rebuilt as float32 bits, subnormals as a multiple of the smallest subnormal (exact)."""
    exp = (b >> MANT) & ((1 << (SIGN - MANT)) - 1)
    mant = b & ((1 << MANT) - 1)
    sign = (b & (1 << SIGN)) << (31 - SIGN)
    normal = (sign | ((exp + (127 - BIAS)) << 23) | (mant << (23 - MANT))).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * (2.0 ** (1 - BIAS - MANT))
    return tl.where(exp == 0, tl.where(sign != 0, -sub, sub), normal)


@triton.jit
def fp8_bits(y, E5M2: tl.constexpr):
    """y (float32, NaN or within range) as float8 bits (uint8): e5m2 or e4m3fn, NaN 0x7F in both (as torch)."""
    if E5M2:
        return minifloat_bits(y, 2, 15, 7, 0x7F).to(tl.uint8)
    return minifloat_bits(y, 3, 7, 7, 0x7F).to(tl.uint8)


@triton.jit
def fp8_value(b, E5M2: tl.constexpr):
    """float8 bits (int32, 0..255) as float32, with inf and NaN (e5m2: IEEE's; e4m3fn: NaN only, S.1111.111)."""
    if E5M2:
        v = minifloat_value(b, 2, 15, 7)
        inf = tl.where((b & 0x80) != 0, -float("inf"), float("inf"))
        v = tl.where((b & 0x7C) == 0x7C, tl.where((b & 3) == 0, inf, float("nan")), v)
    else:
        v = minifloat_value(b, 3, 7, 7)
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return v


# ---- tiles ----


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
