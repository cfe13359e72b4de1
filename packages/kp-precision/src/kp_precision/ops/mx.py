"""MX formats (OCP Microscaling Formats v1.0): launchers, the PyTorch reference path and the op declarations.

A row of K elements (K a multiple of 32) is split into blocks of 32; each block shares a scale X = 2**e stored
as an E8M0 byte (e + 127; 255 is NaN). Per block, as the specification's conversion (section 6.3):

    e    = floor(log2(max |x|)) - EMAX      clamped to E8M0's [-127, 127]; EMAX is the element format's largest
                                            normal exponent: 8 for fp8 e4m3, 15 for e5m2, 2 for fp4 e2m1
    elem = round_to_nearest_even(clamp(x / X, -MAX, MAX))      MAX = 448, 57344, 6
    a block whose amax is NaN or inf gets the NaN scale (its elements then carry nothing)

fp8 elements are stored as torch's float8 dtypes, fp4 (e2m1) elements two per byte, the first in the low
nibble; scales as uint8 bytes. Dequantised: elem * X. The matmul of two MX operands along K sums, per block,
the exact dot product of the elements times both scales, in float32.

Kernels: kp_precision.ops.mx_kernels. Declarations: MX_QUANTIZE (kp::mx_quantize), MX_DEQUANTIZE
(kp::mx_dequantize), MX_MATMUL (kp::mx_matmul). Spec: conformance/specs/test_mx.py.
"""

import torch

import kp_core
from kp_core.float8 import soft_float8

if kp_core.has_triton():
    from kp_precision.ops import mx_kernels as kernels

OP_Q = "kp::mx_quantize"
OP_DQ = "kp::mx_dequantize"
OP_MM = "kp::mx_matmul"
PACKAGE = "kp-precision"
SPEC = "mx"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK = 32
# name -> (kernel id, largest normal exponent, largest value, storage dtype of the elements)
ELEMENTS = {
    "fp8_e4m3": (0, 8, 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": (1, 15, 57344.0, torch.float8_e5m2),
    "fp4_e2m1": (2, 2, 6.0, torch.uint8),
}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 codes 0..7; 8..15 are their negatives
# (BLOCK_M, BLOCK_K or BLOCK_N, num_warps): GPU / interpreter
TILES = {"_mx_quantize": ((32, 256, 4), (16, 64, 1)), "_mx_matmul": ((64, 64, 4), (16, 32, 1))}


def data_shape(shape: tuple, elem: str) -> tuple:
    return (*shape[:-1], shape[-1] // 2) if elem == "fp4_e2m1" else tuple(shape)


def _tile(kernel, backend):
    gpu, interp = TILES[kernel]
    bm, bk, warps = interp if backend == kp_core.INTERPRET else gpu
    s = kp_core.settings(kernel, block_m=bm, block_k=bk, num_warps=warps)
    return s["block_m"], s["block_k"], s["num_warps"]


# ---- reference path (CPU without the interpreter, or KP_BACKEND=reference) ----


def _encode_ref(y: torch.Tensor, elem: str) -> torch.Tensor:
    """Saturated float32 values as element storage: torch's float8 cast, or fp4 codes (nearest value, ties to
    the even code) packed two per byte."""
    if elem != "fp4_e2m1":
        return y.to(ELEMENTS[elem][3])
    grid = torch.tensor(FP4_VALUES, device=y.device)
    dist = (y.abs().nan_to_num(0.0).unsqueeze(-1) - grid).abs()
    nearest = dist == dist.min(-1, keepdim=True).values
    idx = torch.arange(8, device=y.device)
    first = torch.where(nearest, idx, 8).min(-1).values
    last = torch.where(nearest, idx, -1).max(-1).values
    code = torch.where(first % 2 == 1, last, first)  # a tie is between neighbours: the even code (mantissa 0)
    code = code | torch.signbit(y).to(torch.int64) << 3
    code = code.to(torch.uint8)
    return code[..., 0::2] | (code[..., 1::2] << 4)


def _decode_ref(data: torch.Tensor, elem: str) -> torch.Tensor:
    if elem != "fp4_e2m1":
        return data.float()
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2).long()
    mag = torch.tensor(FP4_VALUES, device=data.device)[codes & 7]
    return torch.where(codes >= 8, -mag, mag)


def _e8m0_ref(s: torch.Tensor) -> torch.Tensor:
    v = torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.long() - 127)
    return torch.where(s == 255, float("nan"), v)


def _quantize_ref(x2, elem):
    _, emax, vmax, _ = ELEMENTS[elem]
    xb = x2.float().reshape(x2.shape[0], -1, BLOCK)
    amax = xb.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1: floor(log2 amax) = e - 1
    shared = torch.where(amax == 0, -127, e - 1 - emax).clamp(-127, 127)
    s = torch.where(amax.isfinite(), shared + 127, 255).to(torch.uint8)
    y = xb * torch.ldexp(torch.ones_like(amax), -shared).unsqueeze(-1)
    y = torch.where(y.isnan(), y, y.clamp(-vmax, vmax)).reshape(x2.shape)
    return _encode_ref(y, elem), s


# ---- launchers ----


def quantize(x: torch.Tensor, elem: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, E8M0 scales (..., K/32) uint8) of x (..., K) in the MX format `elem`."""
    kind, emax, vmax, storage = ELEMENTS[elem]
    data = torch.empty(data_shape(tuple(x.shape), elem), dtype=storage, device=x.device)
    scale = torch.empty((*x.shape[:-1], x.shape[-1] // BLOCK), dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return data, scale
    x2 = x.reshape(-1, x.shape[-1])
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    m, k = x2.shape
    d2, s2 = data.view(m, -1), scale.view(m, -1)
    backend = kp_core.choose_backend(OP_Q, x2)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP_Q)
        d, s = _quantize_ref(x2, elem)
        d2.copy_(d)
        s2.copy_(s)
        return data, scale
    soft = soft_float8(backend)
    y = d2.view(torch.uint8) if soft else d2
    bm, bk, warps = _tile("_mx_quantize", backend)
    bk = min(bk, max(BLOCK, kp_core.next_power_of_2(k)))
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
    kp_core.check_index_fits(OP_Q, "the launch grid (programs)", grid)
    args = (x2, x2.stride(0), y, y.stride(0), s2, s2.stride(0), m, k)
    consts = dict(ELEM=kind, EMAX=emax, MAXV=vmax, SOFT=soft, BLOCK_M=bm, BLOCK_K=bk)
    kp_core.launch(OP_Q, backend, kernels._mx_quantize, (grid,), args, consts, warps)
    return data, scale


def dequantize(data: torch.Tensor, scale: torch.Tensor, elem: str, dtype: torch.dtype) -> torch.Tensor:
    k = scale.shape[-1] * BLOCK
    out = torch.empty((*scale.shape[:-1], k), dtype=dtype, device=data.device)
    if out.numel() == 0:
        return out
    m = out.numel() // k
    d2, s2, o2 = data.reshape(m, -1), scale.reshape(m, -1), out.view(m, k)
    backend = kp_core.choose_backend(OP_DQ, d2)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP_DQ)
        v = _decode_ref(d2, elem).view(m, -1, BLOCK) * _e8m0_ref(s2).unsqueeze(-1)
        o2.copy_(v.reshape(m, k))
        return out
    d2 = d2.view(torch.uint8)
    bm, bk, warps = _tile("_mx_quantize", backend)
    bk = min(bk, max(BLOCK, kp_core.next_power_of_2(k)))
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
    args = (d2, d2.stride(0), s2, s2.stride(0), o2, o2.stride(0), m, k)
    consts = dict(ELEM=ELEMENTS[elem][0], BLOCK_M=bm, BLOCK_K=bk)
    kp_core.launch(OP_DQ, backend, kernels._mx_dequantize, (grid,), args, consts, warps)
    return out


def matmul(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    elem_a: str,
    elem_b: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """a (M, K) @ b (N, K).T, both MX along K (data and scales row-major)."""
    m, n, k = a.shape[0], b.shape[0], scale_a.shape[1] * BLOCK
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if out.numel() == 0 or k == 0:
        return out.zero_()
    backend = kp_core.choose_backend(OP_MM, a)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP_MM)
        av = (_decode_ref(a, elem_a).view(m, -1, BLOCK) * _e8m0_ref(scale_a).unsqueeze(-1)).view(m, k)
        bv = (_decode_ref(b, elem_b).view(n, -1, BLOCK) * _e8m0_ref(scale_b).unsqueeze(-1)).view(n, k)
        out.copy_(av @ bv.t())
        return out
    bm, bn, warps = _tile("_mx_matmul", backend)
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(n, bn)
    a8, b8 = a.view(torch.uint8), b.view(torch.uint8)
    args = (a8, a8.stride(0), scale_a, scale_a.stride(0), b8, b8.stride(0), scale_b, scale_b.stride(0))
    args += (out, out.stride(0), m, n, k)
    consts = dict(A_ELEM=ELEMENTS[elem_a][0], B_ELEM=ELEMENTS[elem_b][0], BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8)
    kp_core.launch(OP_MM, backend, kernels._mx_matmul, (grid,), args, consts, warps)
    return out


# ---- declarations ----


def _quantize_fake(x, elem):
    return (
        torch.empty(data_shape(tuple(x.shape), elem), dtype=ELEMENTS[elem][3], device=x.device),
        torch.empty((*x.shape[:-1], x.shape[-1] // BLOCK), dtype=torch.uint8, device=x.device),
    )


MX_QUANTIZE = kp_core.op(OP_Q, quantize, _quantize_fake, package=PACKAGE, spec=SPEC, dtypes=DTYPES)
MX_DEQUANTIZE = kp_core.op(
    OP_DQ,
    dequantize,
    lambda data, scale, elem, dtype: torch.empty(
        (*scale.shape[:-1], scale.shape[-1] * BLOCK), dtype=dtype, device=data.device
    ),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)
MX_MATMUL = kp_core.op(
    OP_MM,
    matmul,
    lambda a, scale_a, b, scale_b, elem_a, elem_b, out_dtype: torch.empty(
        (a.shape[0], b.shape[0]), dtype=out_dtype, device=a.device
    ),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)
