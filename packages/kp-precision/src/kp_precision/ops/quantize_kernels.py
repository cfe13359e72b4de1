"""Triton kernels of float8 quantisation (the maths is in kp_precision.ops.quantize's docstring).

Every kernel views its input as (M, K) rows with a row stride and unit column stride. Amax is taken over the
float32 bit patterns of |x| as int32: for non-negative floats the integer order is the float order, NaN's
pattern is above +inf's (so a NaN makes the amax NaN, as torch.amax does), and an integer max needs no NaN rules
from the hardware.
"""

import triton
import triton.language as tl

# The quantisation modes: one scale for the tensor, one per row of a tile (rowwise, and 1 x BK blocks), one per
# whole BM x BK tile (square blocks).
TENSOR = tl.constexpr(0)
ROW = tl.constexpr(1)
TILE = tl.constexpr(2)


@triton.jit
def _abs_bits(x):
    """|x| (float32) as int32 bits, ordered as the floats are, NaN above +inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _recip(q):
    """1 / q rounded to nearest (div_rn: the IEEE division torch does, whatever Triton's `/` lowers to)."""
    return tl.math.div_rn(tl.full(q.shape, 1.0, tl.float32), q)


@triton.jit
def _multiplier(amax_bits, FP8_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    """q = FP8_MAX / max(amax, EPS) in float32 (round to nearest), floored to a power of two when POW2."""
    amax = amax_bits.to(tl.float32, bitcast=True)
    amax = tl.where(amax != amax, amax, tl.maximum(amax, EPS))  # a NaN amax stays NaN, as torch.clamp keeps it
    q = tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax)
    if POW2:  # clear the mantissa: 2**floor(log2(q)) for a finite positive q; NaN stays NaN
        q = tl.where(q != q, q, (q.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True))
    return q


@triton.jit
def _minifloat_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr, SIGN: tl.constexpr, NAN: tl.constexpr):
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
def _minifloat_value(b, MANT: tl.constexpr, BIAS: tl.constexpr, SIGN: tl.constexpr):
    """The bits (int32) of a small sign-magnitude float as float32, without its special values: normal values
    rebuilt as float32 bits, subnormals as a multiple of the smallest subnormal (exact)."""
    exp = (b >> MANT) & ((1 << (SIGN - MANT)) - 1)
    mant = b & ((1 << MANT) - 1)
    sign = (b & (1 << SIGN)) << (31 - SIGN)
    normal = (sign | ((exp + (127 - BIAS)) << 23) | (mant << (23 - MANT))).to(tl.float32, bitcast=True)
    sub = mant.to(tl.float32) * (2.0 ** (1 - BIAS - MANT))
    return tl.where(exp == 0, tl.where(sign != 0, -sub, sub), normal)


@triton.jit
def _fp8_bits(y, E5M2: tl.constexpr):
    """y (float32, NaN or within range) as float8 bits (uint8): e5m2 or e4m3fn, NaN 0x7F in both (as torch)."""
    if E5M2:
        return _minifloat_bits(y, 2, 15, 7, 0x7F).to(tl.uint8)
    return _minifloat_bits(y, 3, 7, 7, 0x7F).to(tl.uint8)


@triton.jit
def _fp8_value(b, E5M2: tl.constexpr):
    """float8 bits (int32, 0..255) as float32, with inf and NaN (e5m2: IEEE's; e4m3fn: NaN only, S.1111.111)."""
    if E5M2:
        v = _minifloat_value(b, 2, 15, 7)
        inf = tl.where((b & 0x80) != 0, -float("inf"), float("inf"))
        v = tl.where((b & 0x7C) == 0x7C, tl.where((b & 3) == 0, inf, float("nan")), v)
    else:
        v = _minifloat_value(b, 3, 7, 7)
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)
    return v


@triton.jit
def _tile_of(M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's tile of an (M, K) array cut into BLOCK_M x BLOCK_K tiles (row-major order of tiles): its
    rows, its columns, their in-bounds mask and its first column."""
    n_k = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    k0 = (pid % n_k) * BLOCK_K
    rows = (pid // n_k) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = k0 + tl.arange(0, BLOCK_K)
    return rows, cols, (rows < M)[:, None] & (cols < K)[None, :], k0


@triton.jit
def _store_fp8(ptr, y, mask, FP8_MAX: tl.constexpr, E5M2: tl.constexpr, SOFT: tl.constexpr):
    """Saturate y to +-FP8_MAX (NaN stays NaN, inf saturates), round to nearest-even and store."""
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX))
    if SOFT:
        tl.store(ptr, _fp8_bits(y, E5M2), mask=mask)  # ptr is a uint8 view of the data
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _amax(X, stride_x, AMAX, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """AMAX (int32 bits, zero on entry) = max |x| over the tensor: one tile per program, an atomic max each."""
    rows, cols, mask, k0 = _tile_of(M, K, BLOCK_M, BLOCK_K)
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_max(AMAX, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))


@triton.jit
def _quantize(
    X,
    stride_x,
    Y,
    stride_y,
    SCALE,
    stride_s,
    AMAX,
    M,
    K,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DELAYED: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
    POW2: tl.constexpr,
):
    """y = saturate(x * q) as float8 on one BLOCK_M x BLOCK_K tile, with q = FP8_MAX / amax.

    MODE TENSOR: the amax is AMAX (int32 bits, from the _amax pass) and program 0 writes the scale; DELAYED:
    q = 1 / SCALE (a given scale, read only) and this tile's amax goes into AMAX by an atomic max. MODE ROW: a
    scale per row of the tile, at SCALE[row, tile column]; MODE TILE: one per tile, at SCALE[tile row, tile
    column]. Scales are written as 1 / q (what dequantisation multiplies by), amaxes as floats at the same place
    in AMAX."""
    n_k = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    pid_m = pid // n_k
    pid_k = pid % n_k
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if MODE == TENSOR:
        if DELAYED:
            q = _recip(tl.load(SCALE))
            tl.atomic_max(AMAX, tl.max(tl.max(_abs_bits(x), axis=1), axis=0))
        else:
            q = _multiplier(tl.load(AMAX), FP8_MAX, EPS, POW2)
            if pid == 0:
                tl.store(SCALE, _recip(q))
        y = x * q
    elif MODE == ROW:
        amax_bits = tl.max(_abs_bits(x), axis=1)
        q = _multiplier(amax_bits, FP8_MAX, EPS, POW2)
        at = rows.to(tl.int64) * stride_s + pid_k
        tl.store(SCALE + at, _recip(q), mask=row_ok)
        tl.store(AMAX + at, amax_bits.to(tl.float32, bitcast=True), mask=row_ok)
        y = x * q[:, None]
    else:
        amax_bits = tl.max(tl.max(_abs_bits(x), axis=1), axis=0)
        q = _multiplier(amax_bits, FP8_MAX, EPS, POW2)
        tl.store(SCALE + pid_m * stride_s + pid_k, _recip(q))
        tl.store(AMAX + pid_m * stride_s + pid_k, amax_bits.to(tl.float32, bitcast=True))
        y = x * q
    _store_fp8(Y + r64 * stride_y + cols[None, :], y, mask, FP8_MAX, E5M2, SOFT)


@triton.jit
def _quantize_rows_looped(
    X,
    stride_x,
    Y,
    stride_y,
    SCALE,
    AMAX_OUT,
    M,
    K,
    BLOCK_K: tl.constexpr,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
    POW2: tl.constexpr,
):
    """Rowwise quantisation of rows wider than one tile: one row per program, a pass for the amax and a pass
    (mostly from L2) for the cast."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_K,), tl.int32)
    for start in range(0, K, BLOCK_K):
        c = start + cols
        x = tl.load(X + row * stride_x + c, mask=c < K, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, _abs_bits(x))
    amax_bits = tl.max(acc, axis=0)
    q = _multiplier(amax_bits, FP8_MAX, EPS, POW2)
    tl.store(SCALE + row, _recip(q))
    tl.store(AMAX_OUT + row, amax_bits.to(tl.float32, bitcast=True))
    for start in range(0, K, BLOCK_K):
        c = start + cols
        x = tl.load(X + row * stride_x + c, mask=c < K, other=0.0).to(tl.float32)
        _store_fp8(Y + row * stride_y + c, x * q, c < K, FP8_MAX, E5M2, SOFT)


@triton.jit
def _dequantize(
    D,
    stride_d,
    SCALE,
    stride_s0,
    stride_s1,
    Y,
    stride_y,
    M,
    K,
    BM: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E5M2: tl.constexpr,
    SOFT: tl.constexpr,
):
    """y = data * SCALE[row // BM, col // BK] (scale strides 0 along a dimension one scale covers). SOFT: the
    data is read as uint8 bits and decoded in integer arithmetic (the interpreter's float8 upcast gets NaN and
    inf wrong)."""
    rows, cols, mask, k0 = _tile_of(M, K, BLOCK_M, BLOCK_K)
    r64 = rows.to(tl.int64)[:, None]
    raw = tl.load(D + r64 * stride_d + cols[None, :], mask=mask)  # masked lanes are never stored
    if SOFT:
        d = _fp8_value(raw.to(tl.int32), E5M2)
    else:
        d = raw.to(tl.float32)
    s = tl.load(SCALE + (r64 // BM) * stride_s0 + (cols[None, :] // BK) * stride_s1, mask=mask, other=1.0)
    tl.store(Y + r64 * stride_y + cols[None, :], (d * s).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _transpose(X, stride_x, Y, stride_y, M, N, BLOCK: tl.constexpr):
    """Y (N, M) = X (M, N).T for elements as integers of their size (float8 data as uint8, bf16 as int16, ...): a
    BLOCK x BLOCK tile per program, read along X's rows and written along Y's rows (Triton moves the tile
    through shared memory between the two)."""
    tiles_n = tl.cdiv(N, BLOCK)
    rm = (tl.program_id(0) // tiles_n) * BLOCK + tl.arange(0, BLOCK)
    rn = (tl.program_id(0) % tiles_n) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + rm.to(tl.int64)[:, None] * stride_x + rn[None, :], mask=(rm < M)[:, None] & (rn < N)[None, :])
    mask = (rn < N)[:, None] & (rm < M)[None, :]
    tl.store(Y + rn.to(tl.int64)[:, None] * stride_y + rm[None, :], tl.trans(x), mask=mask)
