"""Triton forms of kp_core.float8 (the maths is in its docstring): helpers kernels call, not launchable kernels.

kp-precision's casts, matmuls and MX kernels and kp-norms' float8 output use them. The bit codecs are integer
arithmetic, exact on every backend: Triton's interpreter converts to float8 with its own rounding and decodes NaN
and some e5m2 values wrongly, and nothing converts to float4. Amaxes are taken over the float32 bit patterns of |x|
as int32: for non-negative floats the integer order is the float order, NaN's pattern is above +inf's (so a NaN
makes the amax NaN, as torch.amax does), and an integer max needs no NaN rules from the hardware. Imported by
kernel modules only, so kp-core itself runs where Triton is not installed.
"""

import triton
import triton.language as tl

from kp_core import jit_keys


@triton.jit
def abs_bits(x):
    """|x| (float32) as int32 bits, ordered as the floats are, NaN above +inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def minifloat_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr, SIGN: tl.constexpr, NAN: tl.constexpr):
    """y (float32, NaN or within the format's range) rounded to nearest-even as the bits (int32) of a small
    sign-magnitude float: MANT mantissa bits, exponent bias BIAS, the sign at bit SIGN, NaN as NAN. Normal
    results: round the float32 mantissa to MANT bits and rebias the exponent; subnormal results: multiples of the
    smallest subnormal, rounded with the 2**23 trick."""
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


@triton.jit
def recip(q):
    """1 / q rounded to nearest (div_rn: the IEEE division torch does, whatever Triton's `/` lowers to)."""
    return tl.math.div_rn(tl.full(q.shape, 1.0, tl.float32), q)


@triton.jit
def multiplier(amax_bits, FP8_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    """q = FP8_MAX / max(amax, EPS) in float32 (round to nearest), floored to a power of two when POW2."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    amax = tl.where(amax != amax, amax, tl.maximum(amax, EPS))  # a NaN amax stays NaN, as torch.clamp keeps it
    q = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    if POW2:  # clear the mantissa: 2**floor(log2(q)) for a finite positive q; NaN stays NaN
        q = tl.where(q != q, q, (q.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True))
    return q


@triton.jit
def store_fp8(ptr, y, mask, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr):
    """Saturate y to +-FP8_MAX (NaN stays NaN, inf saturates), round to nearest-even and store. SOFT: ptr is a
    uint8 view of the data and the bits are made in integer arithmetic (fp8_bits)."""
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    if SOFT:
        tl.store(ptr, fp8_bits(y, E5M2), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


jit_keys.settle_module(globals())  # every function's Triton cache key fixed at import (kp_core.jit_keys)
