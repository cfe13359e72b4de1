"""Float8 quantisation: launchers, the PyTorch reference path and the op declarations.

The input is viewed as (M, K) rows (K the last dim). A scale covers a block of that view, given as
(block_m, block_k) with 0 meaning the whole dimension: tensorwise (0, 0), rowwise (1, 0), blockwise (1, 128)
for activations and (128, 128) for weights. Per block, in float32:

    amax = max |x|              (NaN if the block holds a NaN, as torch.amax)
    q    = FP8_MAX / max(amax, EPS)          floored to a power of two when power_of_2
    data = float8(saturate(x * q))           saturate: clamp to +-FP8_MAX, NaN kept; round to nearest-even
    scale = 1 / q                            so that x ~ data * scale (torch._scaled_mm's convention)

(kp_core.float8 holds these constants and the cast in PyTorch, kp_core.float8_kernels its Triton forms.) With a
given (delayed) tensorwise scale s, q = 1 / s and the returned scale is s; the returned amax is then the input's,
for the caller's amax history. Divisions are IEEE round-to-nearest, as in torch. FP8_MAX is 448 for
float8_e4m3fn and 57344 for float8_e5m2, EPS 1e-12 (torchao's). Also kp::transpose, the tiled transposing copy the
float8 training backward runs on float8 data and 16-bit tensors.

Kernels: kp_precision.ops.quantize_kernels. Declarations: QUANTIZE (kp::quantize), DEQUANTIZE (kp::dequantize),
TRANSPOSE (kp::transpose). Spec: conformance/specs/test_quantize.py.
"""

import functools

import torch

import kp_core
from kp_core.float8 import EPS, FP8_DTYPES, divide, fp8_max, multiplier, saturating_cast, soft_float8

if kp_core.has_triton():
    from kp_precision.ops import quantize_kernels as kernels

OP = "kp::quantize"
OP_DEQ = "kp::dequantize"
OP_T = "kp::transpose"
PACKAGE = "kp-precision"
SPEC = "quantize"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (elements per program, num_warps) of the tile kernels on a GPU: best of benchmarks/bench_quantize.py --tune on
# an H100 (bf16, 16384x4096 and 8192^2; elements 2K-32K, 4-16 warps), where the runners-up were within 1-2 %.
# The interpreter runs programs one after another, so it gets 16x bigger tiles.
TILES = {"_amax": (16384, 16), "_quantize_tensorwise": (4096, 4), "_quantize": (4096, 8), "_dequantize": (4096, 8)}
INTERPRET_SCALE = 16
# The transpose's square tile on a GPU (elements per side) and under the interpreter (small: tests cross tiles);
# kp_core.pin("_transpose", block=...) overrides both (a power of two).
TRANSPOSE_BLOCK = 64
INTERPRET_TRANSPOSE_BLOCK = 16


def scale_shape(shape: tuple, block_m: int, block_k: int) -> tuple:
    """The scale's shape for an input of `shape` (see the module docstring for the block encoding)."""
    if block_m == 0:
        return ()
    k = shape[-1]
    lead = shape[:-1]
    nk = 1 if block_k == 0 else kp_core.cdiv(k, block_k)
    if block_m == 1:
        return (*lead, nk)
    m = 1
    for d in lead:
        m *= d
    return (kp_core.cdiv(m, block_m), nk)


def _tile(kernel: str, k: int, block_m: int, block_k: int, interpret: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps) of a launch of `kernel`: a key of TILES, whose settings a benchmark
    may pin (benchmarks/bench_quantize.py --tune); "_quantize_tensorwise" is _quantize's tensorwise mode."""
    return _tile_for(kernel, k, block_m, block_k, interpret, kp_core.tuning.generation())


@functools.lru_cache(maxsize=1024)  # on every launch: the Python of a cast is most of its cost at small sizes
def _tile_for(kernel: str, k: int, block_m: int, block_k: int, interpret: bool, _generation: int):
    s = kp_core.settings(kernel, elements=TILES[kernel][0], num_warps=TILES[kernel][1])
    if block_m > 1:
        bm, bk = block_m, block_k
    else:
        elements = s["elements"] * (INTERPRET_SCALE if interpret else 1)
        bk = block_k or min(kp_core.next_power_of_2(k), 1024)
        bm = max(1, elements // bk)
    if block_m > 1:  # a square block is one tile, whatever the settings' size: warps by its size
        tile = bm * bk
        return bm, bk, 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return bm, bk, s["num_warps"]


@functools.lru_cache(maxsize=1024)
def _consts(mode: int, block_m: int, block_k: int, delayed: bool, fp8: torch.dtype, soft: bool, pow2: bool):
    """_quantize's constexprs, made once per combination (kp_core.Constexprs: a cheap launch key)."""
    return kp_core.Constexprs(
        MODE=mode,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        DELAYED=delayed,
        FP8_MAX=fp8_max(fp8),
        EPS=EPS,
        E5M2=fp8 == torch.float8_e5m2,
        SOFT=soft,
        POW2=pow2,
    )


def _blocks(x2: torch.Tensor, block_m: int, block_k: int) -> torch.Tensor:
    """x2 (M, K) as (Mb, bm, Kb, bk) blocks, zero-padded (zeros change no amax)."""
    m, k = x2.shape
    bm = m if block_m == 0 else block_m
    bk = k if block_k == 0 else block_k
    pm, pk = kp_core.cdiv(m, bm) * bm, kp_core.cdiv(k, bk) * bk
    if (pm, pk) == (m, k):  # whole blocks: a view (no copy for inductor to make, kp_precision.shared.cast)
        return x2.reshape(pm // bm, bm, pk // bk, bk)
    padded = x2.new_zeros((pm, pk))
    padded[:m, :k] = x2
    return padded.view(pm // bm, bm, pk // bk, bk)


def reference(x2, scale, fp8, block_m, block_k, power_of_2):
    """(data, scale, amax) of a 2-D x2 in PyTorch, the kernels' maths bit for bit: the reference path, and the
    tensorwise cast under torch.compile (kp_precision.shared.cast)."""
    xf = x2.float()
    if scale is not None:
        q = divide(1.0, scale.float().reshape(1, 1))
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
        s_out = scale.float().reshape(())
        qb = q
    else:
        amax = _blocks(xf, block_m, block_k).abs().amax(dim=(1, 3))  # (Mb, Kb)
        q = multiplier(amax, fp8, power_of_2)
        s_out = divide(1.0, q)
        bm = x2.shape[0] if block_m == 0 else block_m
        bk = x2.shape[1] if block_k == 0 else block_k
        qb = q.repeat_interleave(max(bm, 1), 0)[: x2.shape[0]].repeat_interleave(max(bk, 1), 1)[:, : x2.shape[1]]
    return saturating_cast(xf, qb, fp8), s_out, amax


# ---- launchers ----


def _launch_quantize(op, x2, data, scale_in, fp8, block_m, block_k, power_of_2):
    """(scale, amax) as (Mb, Kb) float32, or 0-d for tensorwise; data (M, K) is written in place."""
    backend = kp_core.choose_backend(op, x2)
    if backend == kp_core.REFERENCE:
        kp_core.reference(op)
        d, s, a = reference(x2, scale_in, fp8, block_m, block_k, power_of_2)
        data.copy_(d)
        return s, a
    interpret = backend == kp_core.INTERPRET
    m, k = x2.shape
    soft = soft_float8(backend)
    y = data.view(torch.uint8) if soft else data
    if block_m == 0:  # tensorwise: the amax as int32 bits (see the kernels' docstring), then the cast
        amax_bits = torch.zeros((), dtype=torch.int32, device=x2.device)
        delayed = scale_in is not None
        if not delayed:
            bm, bk, warps = _tile("_amax", k, 0, 0, interpret)
            grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
            args = (x2, x2.stride(0), amax_bits, m, k)
            kp_core.launch(op, backend, kernels._amax, (grid,), args, dict(BLOCK_M=bm, BLOCK_K=bk), warps)
        scale = scale_in.float().reshape(()) if delayed else torch.empty((), device=x2.device)
        bm, bk, warps = _tile("_quantize_tensorwise", k, 0, 0, interpret)
        grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
        consts = _consts(0, bm, bk, delayed, fp8, soft, power_of_2)
        args = (x2, x2.stride(0), y, y.stride(0), scale, 0, amax_bits, m, k)
        kp_core.launch(op, backend, kernels._quantize, (grid,), args, consts, warps)
        return (scale.clone() if delayed else scale), amax_bits.view(torch.float32)
    shape = scale_shape((m, k), block_m, block_k)
    scale = torch.empty(shape, device=x2.device)
    amax = torch.empty(shape, device=x2.device)
    if block_m == 1 and block_k == 0:  # rowwise
        cfg = kp_core.row_config(op, k, x2.element_size())
        if cfg.looped:
            args = (x2, x2.stride(0), y, y.stride(0), scale, amax, m, k)
            consts = dict(BLOCK_K=cfg.block_cols, FP8_MAX=fp8_max(fp8), EPS=EPS, E5M2=fp8 == torch.float8_e5m2)
            consts.update(SOFT=soft, POW2=power_of_2)
            kp_core.launch(op, backend, kernels._quantize_rows_looped, (m,), args, consts, cfg.num_warps)
            return scale, amax
        bm, bk, warps = cfg.block_rows * (INTERPRET_SCALE if interpret else 1), cfg.block_cols, cfg.num_warps
        bm = min(bm, kp_core.next_power_of_2(m))
        mode = 1
    else:
        bm, bk, warps = _tile("_quantize", k, block_m, block_k, interpret)
        mode = 1 if block_m == 1 else 2
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
    kp_core.check_index_fits(op, "the launch grid (programs)", grid)
    consts = _consts(mode, bm, bk, False, fp8, soft, power_of_2)
    args = (x2, x2.stride(0), y, y.stride(0), scale, scale.stride(0), amax, m, k)
    kp_core.launch(op, backend, kernels._quantize, (grid,), args, consts, warps)
    return scale, amax


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as (M, K) with unit column stride (rows may be strided); copies only when it must."""
    k = t.shape[-1] if t.dim() else 1
    t2 = t.reshape(-1, k)
    return t2 if t2.stride(1) == 1 or k == 1 else t2.contiguous()


def forward(
    x: torch.Tensor, scale: torch.Tensor | None, fp8: torch.dtype, block_m: int, block_k: int, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale, amax): data in fp8 with x's shape, scale and amax of scale_shape(x.shape, block_m, block_k)."""
    data = torch.empty(x.shape, dtype=fp8, device=x.device)
    shape = scale_shape(tuple(x.shape), block_m, block_k)
    if x.numel() == 0:  # no launch: every block is empty, amax 0
        amax = torch.zeros(shape, device=x.device)
        if scale is not None:
            return data, scale.float().reshape(()).clone(), amax
        q = multiplier(amax, fp8, power_of_2)
        return data, torch.ones_like(q) / q, amax
    x2 = _rows(x)
    s, a = _launch_quantize(OP, x2, data.view(-1, x2.shape[1]), scale, fp8, block_m, block_k, power_of_2)
    return data, s.reshape(shape), a.reshape(shape)


def _quantize_fake(x, scale, fp8, block_m, block_k, power_of_2):
    shape = scale_shape(tuple(x.shape), block_m, block_k)
    return (
        torch.empty(x.shape, dtype=fp8, device=x.device),
        x.new_empty(shape, dtype=torch.float32),
        x.new_empty(shape, dtype=torch.float32),
    )


def dequantize(data: torch.Tensor, scale: torch.Tensor, block_m: int, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """data * scale broadcast over its blocks, as `dtype`."""
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    if out.numel() == 0:
        return out
    d2 = _rows(data)
    m, k = d2.shape
    s2 = scale.reshape(1, 1) if block_m == 0 else scale.reshape(-1, scale.shape[-1])
    backend = kp_core.choose_backend(OP_DEQ, d2)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP_DEQ)
        bm, bk = (m if block_m == 0 else block_m), (k if block_k == 0 else block_k)
        sb = s2.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
        out.view(m, k).copy_(d2.float() * sb)
        return out
    soft = soft_float8(backend)
    # a scale's strides along the dimensions it covers whole are 0
    s0 = 0 if block_m == 0 else s2.stride(0)
    s1 = 0 if block_k == 0 else s2.stride(1)
    bm, bk, warps = _tile("_dequantize", k, 0, 0, backend == kp_core.INTERPRET)
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
    kp_core.check_index_fits(OP_DEQ, "the launch grid (programs)", grid)
    src = d2.view(torch.uint8) if soft else d2
    args = (src, src.stride(0), s2, s0, s1, out.view(m, k), k, m, k)
    consts = dict(
        BM=max(block_m, 1), BK=max(block_k, 1), BLOCK_M=bm, BLOCK_K=bk, E5M2=data.dtype == torch.float8_e5m2, SOFT=soft
    )
    kp_core.launch(OP_DEQ, backend, kernels._dequantize, (grid,), args, consts, warps)
    return out


# Each dtype's bits as an integer dtype of its size: the transpose moves bits, never decodes a value
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def transpose(data: torch.Tensor) -> torch.Tensor:
    """(M, N) data with unit column stride as (N, M) row-major: data.t().contiguous() in one tiled pass. The
    float8 training backward needs float8 data and 16- or 32-bit inputs, gradients and weights transposed, and
    PyTorch's transposing copy runs far below copy bandwidth (one byte or element per row per lane)."""
    m, n = data.shape
    out = torch.empty((n, m), dtype=data.dtype, device=data.device)
    if out.numel() == 0:
        return out
    data = data if data.stride(1) == 1 or n == 1 else data.contiguous()
    backend = kp_core.choose_backend(OP_T, data)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP_T)
        return out.copy_(data.t())
    block = INTERPRET_TRANSPOSE_BLOCK if backend == kp_core.INTERPRET else TRANSPOSE_BLOCK
    block = kp_core.settings("_transpose", block=block)["block"]
    grid = kp_core.cdiv(m, block) * kp_core.cdiv(n, block)
    kp_core.check_index_fits(OP_T, "the launch grid (programs)", grid)
    bits = _BITS[data.element_size()]
    x, y = data.view(bits), out.view(bits)
    args = (x, x.stride(0), y, y.stride(0), m, n)
    kp_core.launch(OP_T, backend, kernels._transpose, (grid,), args, dict(BLOCK=block), 4)
    return out


# ---- declarations ----

# QUANTIZE and TRANSPOSE are traced into compiled graphs (kp_core.library): packages/kp/tests/test_inline.py
QUANTIZE = kp_core.op(OP, forward, _quantize_fake, package=PACKAGE, spec=SPEC, dtypes=DTYPES, inline=True)

DEQUANTIZE = kp_core.op(
    OP_DEQ,
    dequantize,
    lambda data, scale, block_m, block_k, dtype: torch.empty(data.shape, dtype=dtype, device=data.device),
    package=PACKAGE,
    spec=SPEC,
    dtypes=FP8_DTYPES,
)

TRANSPOSE = kp_core.op(
    OP_T,
    transpose,
    lambda data: data.new_empty((data.shape[1], data.shape[0])),
    package=PACKAGE,
    spec=SPEC,
    dtypes=FP8_DTYPES + DTYPES,
    inline=True,
)
