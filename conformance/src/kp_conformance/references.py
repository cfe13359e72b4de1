"""The independent references, one per op, written from the maths in plain PyTorch, independent of kp's code: the
one name they take from kp is kp_core.cdiv, an integer ceiling division for scale shapes.

Each op has a float64 ground truth (`*64`) and "PyTorch in the low precision" (`*_lowp`): the same computation as
PyTorch (or the model family's own code) runs it in the input's dtype. The tolerance rule
(kp_conformance.check_close) judges kp by both. The conformance specs and the packages' own tests share them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kp_core import cdiv

# ---- norms and activations ----


def rms64(x, w, eps, offset=0.0):
    """RMSNorm (Zhang & Sennrich 2019, eq. 4; torch.nn.RMSNorm), Gemma's weight offset (1 + w)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * (offset + w)


def layer64(x, w, b, eps):
    """LayerNorm (Ba et al. 2016; torch.nn.LayerNorm), biased variance. The centred row is x - mu less its own
    mean: with a large common offset, mu's rounding (half an fp64 ulp of the offset) would otherwise move every
    centred value, an error of the truth itself that float64 inputs would be judged against."""
    d = x - x.mean(-1, keepdim=True)
    xc = d - d.mean(-1, keepdim=True)
    y = xc / torch.sqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    y = y if w is None else y * w
    return y if b is None else y + b


def silu64(z):
    return z / (1 + torch.exp(-z))


def gelu64(z):
    return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))


def gelu_tanh64(z):
    """GELU's tanh form (Hendrycks & Gimpel 2016; torch.nn.GELU(approximate="tanh"))."""
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))


# ---- attention ----


def allowed(sq: int, sk: int, causal: bool, window, device, top_left: bool = False) -> torch.Tensor:
    """(sq, sk) bool: query i may see key j. The diagonal is i + sk - sq (bottom-right, FlashAttention >= 2.1), or
    i (top-left, torch's is_causal); window (left, right) bounds keys about it (-1: unbounded); causal sets
    right = min(right, 0)."""
    off = 0 if top_left else sk - sq
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    if left >= 0:
        ok &= j >= i + off - left
    if right >= 0:
        ok &= j <= i + off + right
    return ok


def _scores(q, k, scale, softcap):
    """(B, Hq, Sq, Sk) scores of (B, S, H, D) tensors, kv heads repeated for GQA (Ainslie et al. 2023)."""
    hq, hkv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return softcap * torch.tanh(s / softcap) if softcap > 0 else s


def alibi_bias(alibi, sq: int, sk: int, dtype, device, top_left: bool = False) -> torch.Tensor:
    """(B or 1, H, Sq, Sk): -slope * |i + off - j| for slopes alibi (H,) or (B, H), off = sk - sq (bottom-right) or
    0 (Press et al. 2022, ALiBi; FlashAttention's alibi_slopes)."""
    off = 0 if top_left else sk - sq
    i = torch.arange(sq, device=device, dtype=dtype)[:, None]
    j = torch.arange(sk, device=device, dtype=dtype)[None, :]
    slopes = alibi.to(device=device, dtype=dtype)
    slopes = slopes.reshape(-1 if slopes.dim() == 2 else 1, slopes.shape[-1], 1, 1)
    return -slopes * (i + off - j).abs()


def _masked(s, q, k, causal, window, mask, top_left, alibi=None):
    if alibi is not None:  # added in s's dtype: float64 for the reference, float32 for PyTorch's baseline
        s = s + alibi_bias(alibi, q.shape[1], k.shape[1], s.dtype, s.device, top_left)
    ok = allowed(q.shape[1], k.shape[1], causal, window, q.device, top_left)
    if mask is not None and mask.dtype == torch.bool:
        ok = ok & mask
    elif mask is not None:
        s = s + mask.to(s.dtype)
    return s.masked_fill(~ok, float("-inf"))


def attention64(
    q,
    k,
    v,
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    scale=None,
    mask=None,
    top_left=False,
    alibi_slopes=None,
    keep=None,
    dropout_p=0.0,
):
    """softmax(scale * Q K^T + mask) V (Vaswani et al. 2017, eq. 1) in float64 on (B, S, H, D) tensors; softcap
    c * tanh(s / c) (Gemma 2 report); alibi_slopes: the slopes of alibi_bias, added after softcap; dropout
    (Srivastava et al. 2014) of the probabilities with the given (B, Hq, Sq, Sk) boolean keep mask, the kept ones
    scaled by 1 / (1 - dropout_p). Returns (out, lse); rows with no visible key give 0 and -inf."""
    q, k, v = (t.double() for t in (q, k, v))
    s = _masked(_scores(q, k, scale, softcap), q, k, causal, window, mask, top_left, alibi_slopes)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def attention_lowp(
    q,
    k,
    v,
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    scale=None,
    mask=None,
    top_left=False,
    alibi_slopes=None,
    keep=None,
    dropout_p=0.0,
):
    """PyTorch in the input's precision: SDPA with the mask made explicit, or with softcap, ALiBi or a given
    dropout mask (which SDPA lacks) Hugging Face's eager attention (scores in the input dtype, the ALiBi bias added
    and the softmax taken in fp32, dropout applied to the probabilities in the input dtype). Fully masked rows: 0."""
    if k.shape[1] == 0:
        return q.new_zeros(q.shape)
    if softcap > 0 or alibi_slopes is not None or keep is not None:
        s = _scores(q, k, scale, softcap)
        s = _masked(s if alibi_slopes is None else s.float(), q, k, causal, window, mask, top_left, alibi_slopes)
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
        if keep is not None:
            p = p * keep / (1 - dropout_p)
        vr = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        return torch.einsum("bhqk,bkhd->bqhd", p, vr).nan_to_num(0.0)
    ok = allowed(q.shape[1], k.shape[1], causal, window, q.device, top_left)
    if mask is None or mask.dtype == torch.bool:
        attn = ok if mask is None else ok & mask
    else:
        attn = mask.to(q.dtype).masked_fill(~ok, float("-inf"))
    hq = q.shape[2]
    k, v = (t.repeat_interleave(hq // t.shape[2], dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=attn, scale=scale)
    return out.transpose(1, 2).nan_to_num(0.0)  # SDPA's fully masked rows are NaN; kp's are defined as 0


def lse_lowp(
    q,
    k,
    *,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    scale=None,
    mask=None,
    top_left=False,
    alibi_slopes=None,
    keep=None,
    dropout_p=0.0,
):
    """lse has no PyTorch counterpart: its baseline is logsumexp (fp32) of the scores PyTorch forms in q's dtype
    (the ALiBi bias added in fp32). Dropout (keep, dropout_p) does not change lse."""
    s = _scores(q, k, scale, softcap)
    s = _masked(s if alibi_slopes is None else s.float(), q, k, causal, window, mask, top_left, alibi_slopes)
    return torch.logsumexp(s.float(), dim=-1)


def kvcache_rows(cache: torch.Tensor, b: int, n: int, block_table=None) -> torch.Tensor:
    """(1, n, H, D): the first n tokens of sequence b of a (B, S_max, H, D) or paged (blocks, page, H, D) cache."""
    if block_table is None:
        return cache[b : b + 1, :n]
    page = cache.shape[1]
    j = torch.arange(n, device=cache.device)
    return cache[block_table[b].long()[j // page], j % page][None]


def decode(attention, q, k_cache, v_cache, lens, *, block_table=None, causal=True, window=(-1, -1), **kw):
    """KV-cache attention by `attention` (attention64 or attention_lowp) one sequence at a time: sequence b's
    queries attend its first lens[b] cached keys (from row cache_leftpad[b] when kw has it), the diagonal
    bottom-right. Returns what `attention` returns, concatenated over the batch (out; and lse for attention64)."""
    results = []
    slopes = kw.pop("alibi_slopes", None)
    leftpad = kw.pop("cache_leftpad", None)
    for b, n in enumerate(lens):
        kb, vb = (kvcache_rows(c, b, n, block_table) for c in (k_cache, v_cache))
        if leftpad is not None:  # the sequence starts at row leftpad[b]: the diagonal stays on its last key
            kb, vb = kb[:, int(leftpad[b]) :], vb[:, int(leftpad[b]) :]
        if slopes is not None:  # (Hq,) or (B, Hq): sequence b's
            kw["alibi_slopes"] = slopes[b] if slopes.dim() == 2 else slopes
        results.append(attention(q[b : b + 1], kb, vb, causal=causal, window=window, **kw))
    if isinstance(results[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*results))
    return torch.cat(results)


# ---- float8 (the recipe of kp_precision.quantize, as torchao's float8 scaling writes it) ----

FP8_EPS = 1e-12  # torchao's floor on an amax, so an all-zero block gets a finite scale
FP8_BLOCKS = {"tensorwise": (0, 0), "rowwise": (1, 0)}


def pow2_floor(q):
    """2**floor(log2 q), exactly: frexp gives q = m * 2**e with 0.5 <= m < 1 (exp2(floor(log2 q)) in float32 is
    not exact: log2 of a q just below a power of two rounds up to the integer). 0 (an infinite amax) and NaN
    stay."""
    _, e = torch.frexp(q)
    return torch.where(q.isnan() | (q == 0), q, torch.ldexp(torch.ones_like(q), e - 1))


def fp8_scale_shape(shape, block_m, block_k):
    """The scale's shape for an input of `shape` viewed as (M, K) rows, blocks (block_m, block_k), 0 = whole."""
    if block_m == 0:
        return ()
    lead, k = tuple(shape[:-1]), shape[-1]
    nk = 1 if block_k == 0 else cdiv(k, block_k)
    return (*lead, nk) if block_m == 1 else (cdiv(math.prod(lead), block_m), nk)


def quantize_fp8(x, fp8, granularity, block=None, given=None, power_of_2=False):
    """(data, scale, amax) in float32 PyTorch: amax per block, q = FP8_MAX / max(amax, 1e-12) (floored to a
    power of two if asked), data = torch's cast of clamp(x * q) (NaN kept), scale = 1 / q; with a `given`
    (delayed) tensorwise scale, q = 1 / given and amax is the input's."""
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).float()
    m, k = x2.shape
    fmax = torch.tensor(torch.finfo(fp8).max, device=x.device)
    if given is not None:
        q = torch.ones((), device=x.device) / given.reshape(())
        amax = x2.abs().amax() if x2.numel() else torch.zeros((), device=x.device)
        scale, qb = given.reshape(()), q
    else:
        blocks = FP8_BLOCKS.get(granularity) or tuple(block)
        shape = fp8_scale_shape(x.shape, *blocks)
        bm, bk = blocks[0] or m, blocks[1] or k
        if not x2.numel():  # every block empty: amax 0
            amax = torch.zeros(shape, device=x.device)
            q = fmax / amax.clamp(min=FP8_EPS)
            q = pow2_floor(q) if power_of_2 else q
            return torch.empty(x.shape, dtype=fp8, device=x.device), torch.ones_like(q) / q, amax
        pad = F.pad(x2, (0, -k % bk, 0, -m % bm))  # zeros change no amax
        amax = pad.view(pad.shape[0] // bm, bm, pad.shape[1] // bk, bk).abs().amax(dim=(1, 3))
        q = fmax / amax.clamp(min=FP8_EPS)  # tensor / tensor: one IEEE division (a Python number / t is a * (1 / t))
        if power_of_2:
            q = pow2_floor(q)
        scale = torch.ones_like(q) / q
        qb = q.repeat_interleave(bm, 0)[:m].repeat_interleave(bk, 1)[:, :k]
        scale, amax = scale.reshape(shape), amax.reshape(shape)
    y = x2 * qb
    y = torch.where(y.isnan(), y, y.clamp(-fmax, fmax))
    return y.to(fp8).reshape(x.shape), scale, amax


def dequantize_fp8(data, scale, granularity, block=None, dtype=torch.float64):
    """data * scale broadcast over its blocks, in `dtype` (float64: exact)."""
    d = data.reshape(-1, data.shape[-1]).to(dtype)
    m, k = d.shape
    bm, bk = FP8_BLOCKS.get(granularity) or tuple(block)
    s = scale.reshape(1, 1) if bm == 0 else scale.reshape(-1, scale.shape[-1])
    s = s.to(dtype).repeat_interleave(bm or m, 0)[:m].repeat_interleave(bk or k, 1)[:, :k]
    return (d * s).reshape(data.shape)


def scale_of_each(data, scale, granularity, block=None):
    """The float32 scale of every element of `data` (dequantize_fp8 of ones)."""
    return dequantize_fp8(torch.ones_like(data, dtype=torch.float32), scale, granularity, block, torch.float32)


def scaled_mm_lowp(a, b, scale_a, scale_b, use_fast_accum=False):
    """PyTorch's own float8 GEMM of the same operands, for the 2x rule: a (M, K) and b (K, N) float8, scale_a (M, K)
    and scale_b (K, N) every element's float32 scale, constant within each 128-deep slice of K. torch._scaled_mm
    (float8 tensor cores on a GPU, whose accumulator is narrower than float32: a float32 matmul would hide that)
    with unit scales, then the scales in float32 as the recipe applies them: once after the whole sum when they
    are constant along K, else per 128-deep slice, the slices summed in float32."""
    k = a.shape[1]
    along_k = k and not (
        torch.equal(scale_a, scale_a[:, :1].expand_as(scale_a)) and torch.equal(scale_b, scale_b[:1].expand_as(scale_b))
    )
    step = 128 if along_k else max(k, 1)
    one = torch.ones((), device=a.device)
    out = torch.zeros(a.shape[0], b.shape[1], device=a.device)
    n = b.shape[1]
    for j in range(0, k, step):
        # zeros pad K and N to the multiples of 16 torch._scaled_mm takes on a GPU (+0.0 is byte 0 in both formats)
        aj, bj = _pad16(a[:, j : j + step], 1), _pad16(_pad16(b[j : j + step].t(), 1), 0)
        part = torch._scaled_mm(aj, bj.t(), one, one, out_dtype=torch.float32, use_fast_accum=use_fast_accum)
        out = out + part[:, :n] * scale_a[:, j : j + 1] * scale_b[j : j + 1, :]
    return out


def _pad16(t, dim):
    """float8 t, contiguous, zero-padded along dim to a multiple of 16."""
    pad = -t.shape[dim] % 16
    u = t.contiguous().view(torch.uint8)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad) if dim == 1 else (0, 0, 0, pad))
    return u.view(t.dtype)


# ---- MX formats (OCP Microscaling Formats v1.0, section 6.3's conversion) ----

MX_ELEMENTS = {  # name -> (largest normal exponent, largest value, torch dtype or None for fp4)
    "fp8_e4m3": (8, 448.0, torch.float8_e4m3fn),
    "fp8_e5m2": (15, 57344.0, torch.float8_e5m2),
    "fp4_e2m1": (2, 6.0, None),
}
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp4_codes(y):
    """Saturated float32 values as e2m1 codes (int64, sign in bit 3): nearest grid value, a tie to the even code
    (mantissa bit 0). Midpoints between neighbours bound the buckets; a value on a midpoint is a tie."""
    grid = torch.tensor(FP4_GRID, dtype=torch.float64, device=y.device)
    mids = (grid[1:] + grid[:-1]) / 2
    mag = y.abs().double().nan_to_num(0.0)
    idx = torch.bucketize(mag, mids)  # mag == mids[i] -> i (the lower neighbour)
    tie = (idx < 7) & (mag == mids[idx.clamp(max=6)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)
    return idx | (torch.signbit(y).long() << 3)


def mx_quantize(x, elem):
    """(element values as float64 (..., K), E8M0 scale bytes (..., K/32) as int64) of x by the MX conversion:
    X = 2**(floor(log2 amax) - emax), clamped to [2**-127, 2**127], NaN if the block's amax is NaN or inf;
    elements = RNE(clamp(x / X, -max, max)) (torch's own cast for fp8, fp4_codes for fp4)."""
    emax, vmax, dtype = MX_ELEMENTS[elem]
    xb = x.double().reshape(*x.shape[:-1], -1, 32)
    amax = xb.abs().amax(-1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax)).nan_to_num(1.0, 1.0)
    # floor(log2 amax) from the binary exponent: CUDA's float64 log2 of 64.0 is 5.999999999999999
    floor_log2 = torch.frexp(safe)[1].double() - 1
    shared = torch.where(amax > 0, floor_log2 - emax, -127.0).clamp(-127, 127)
    byte = torch.where(amax.isfinite(), shared + 127, 255.0).long()
    y = (xb / torch.exp2(shared).unsqueeze(-1)).float()  # a power of two: exact
    y = torch.where(y.isnan(), y, y.clamp(-vmax, vmax))
    if dtype is not None:
        elems = y.to(dtype).double()
    else:
        codes = fp4_codes(y)
        elems = torch.tensor(FP4_GRID, dtype=torch.float64, device=x.device)[codes & 7]
        elems = torch.where(codes >= 8, -elems, elems)
    return elems.reshape(x.shape), byte


def mx_values(elems, byte):
    """Dequantised MX values in float64: element * 2**(byte - 127), NaN where the byte is 255."""
    scale = torch.where(byte == 255, float("nan"), torch.exp2(byte.double() - 127))
    return (elems.reshape(*byte.shape, 32) * scale.unsqueeze(-1)).reshape(elems.shape)


# ---- integer fake quantisation (symmetric, per group; as torchao's QAT fake quantisers, with scale amax / qmax) ----


def fake_quantize_int(x, qmax, group):
    """(dequantised values in x's dtype, integer codes as float32) of symmetric quantisation of x's last dim in
    groups of `group` (0: whole rows): scale = max(amax, 1e-12) / qmax in float32 (IEEE division), codes =
    round-half-even(x / scale) clamped to [-qmax - 1, qmax], values = codes * scale rounded once to x's dtype."""
    k = x.shape[-1]
    g = group or k
    xg = x.float().reshape(-1, k // g, g)
    amax = xg.abs().amax(-1, keepdim=True)
    # both operands on x's device: CUDA divides by a CPU scalar as a multiplication by its reciprocal
    scale = torch.maximum(amax, torch.full_like(amax, 1e-12)) / torch.full_like(amax, float(qmax))
    codes = torch.round(xg / scale).clamp(-qmax - 1, qmax)
    return (codes * scale).to(x.dtype).reshape(x.shape), codes.reshape(x.shape)


def mask_2_4(weight, column_scale=None):
    """The 2:4 keep mask along the last dim: per group of 4, the 2 highest float32 scores |w| (times
    column_scale), NaN as +inf, ties to the lower index; by a stable descending sort (kp ranks pairwise)."""
    s = weight.float().abs()
    if column_scale is not None:
        s = s * column_scale.float()
    s = torch.nan_to_num(s, nan=float("inf"), posinf=float("inf"))
    groups = s.reshape(*weight.shape[:-1], -1, 4)
    top = torch.sort(groups, dim=-1, descending=True, stable=True).indices[..., :2]
    keep = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True)
    return keep.reshape(weight.shape)


def transposable_patterns():
    """The 4 x 4 0/1 blocks with two ones in every row and column (90), found by filtering all 2**16 blocks, in
    kp's documented order: each row's pair as a base-6 digit ((0,1) < (0,2) < (0,3) < (1,2) < (1,3) < (2,3)),
    first row most significant."""
    pair_rank = {(0, 1): 0, (0, 2): 1, (0, 3): 2, (1, 2): 3, (1, 3): 4, (2, 3): 5}
    found = []
    for bits in range(1 << 16):
        block = [[(bits >> (4 * i + j)) & 1 for j in range(4)] for i in range(4)]
        if all(sum(r) == 2 for r in block) and all(sum(block[i][j] for i in range(4)) == 2 for j in range(4)):
            key = [pair_rank[tuple(j for j in range(4) if r[j])] for r in block]
            found.append((key, [float(v) for r in block for v in r]))
    return torch.tensor([b for _, b in sorted(found)])


def block_scores_2_4(weight, column_scale=None):
    """float64 score of every pattern for every 4 x 4 block: (M / 4 * K / 4, 90), blocks row-major."""
    s = weight.float().abs()
    if column_scale is not None:
        s = s * column_scale.float()
    s = torch.nan_to_num(s, nan=3.0e38, posinf=3.0e38).clamp(max=3.0e38).double()
    m, k = weight.shape
    blocks = s.reshape(m // 4, 4, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    return blocks @ transposable_patterns().to(blocks).T


def blocks_of(mask):
    """A (M, K) mask as (M / 4 * K / 4, 16) blocks, row-major within each block."""
    m, k = mask.shape
    return mask.reshape(m // 4, 4, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def sparse_training_step(x, weight, bias, mask, dy, decay, fixed, dtype=torch.float64):
    """2:4 sparse training's forward and gradients in `dtype` (float64: the reference; the layer's own dtype:
    PyTorch's low-precision computation for the tolerance rule): y = x W_s^T + b with W_s = W * mask;
    dx = dy W_s; dW = dy^T x straight through, plus decay * W where the mask drops (SR-STE), or masked when the
    mask is fixed; db = sum of dy. Returns (y, dx, dW, db)."""
    w_s = torch.where(mask, weight.to(dtype), torch.zeros((), dtype=dtype, device=weight.device)).requires_grad_()
    x_ = x.detach().to(dtype).requires_grad_()
    b = None if bias is None else bias.detach().to(dtype)
    y = torch.nn.functional.linear(x_, w_s, b)
    y.backward(dy.to(dtype))
    zero = torch.zeros((), dtype=dtype, device=weight.device)
    if fixed:
        dw = torch.where(mask, w_s.grad, zero)
    else:
        dw = w_s.grad + decay * torch.where(mask, zero, weight.detach().to(dtype))
    db = None if bias is None else dy.to(dtype).reshape(-1, dy.shape[-1]).sum(0)
    return y.detach(), x_.grad, dw, db


# cuSPARSELt's metadata nibble order inside a 64-row x 8-group tile: the (row or group, bit) that each bit of a
# nibble's index holds, low bit first (read off torch._cslt_compress on sm90).
CUSPARSELT_NIBBLE_BITS = (("r", 3), ("g", 2), ("g", 0), ("g", 1), ("r", 0), ("r", 1), ("r", 2), ("r", 4), ("r", 5))


def cusparselt_compressed(weight, mask):
    """torch._cslt_compress(weight * mask) for a 16-bit (R, C) weight and a mask keeping 2 of every 4 along C,
    built entry by entry: kept values row-major, then per group the nibble first | second << 2 at its place
    (tiles of 64 rows x 8 groups, row-tile major; CUSPARSELT_NIBBLE_BITS inside a tile), 4 nibbles a 16-bit word."""
    rows, cols = weight.shape
    w, keep = weight.cpu(), mask.cpu()
    values = torch.stack([w[r][keep[r]] for r in range(rows)])
    nibbles = [0] * (rows * cols // 4)
    for r in range(rows):
        for g in range(cols // 4):
            kept = [j for j in range(4) if keep[r, 4 * g + j]]
            tile = (r // 64) * (cols // 32) + g // 8
            inside = sum(
                (((r if axis == "r" else g) >> bit) & 1) << i for i, (axis, bit) in enumerate(CUSPARSELT_NIBBLE_BITS)
            )
            nibbles[tile * 512 + inside] = kept[0] | (kept[1] << 2)
    words = [sum(nibbles[4 * i + j] << (4 * j) for j in range(4)) for i in range(len(nibbles) // 4)]
    meta = torch.tensor([x - 65536 if x >= 32768 else x for x in words], dtype=torch.int16).view(weight.dtype)
    return torch.cat([values.flatten(), meta]).view(rows, cols // 2 + cols // 16)


def sparse_activation_step(x, weight, bias, dy, dtype=torch.float64):
    """2:4 activations' forward and gradients in `dtype`: x_s = x * m, m the 2:4 mask of each token's features
    (mask_2_4 above); y = x_s W^T + b, dx = (dy W) * m, dW = dy^T x_s, db = sum of dy. Returns (y, dx, dW, db)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    m = mask_2_4(x2).reshape(x.shape)
    xs = torch.where(m, x.detach().to(dtype), torch.zeros((), dtype=dtype, device=x.device)).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    y = torch.nn.functional.linear(xs, w, None if bias is None else bias.detach().to(dtype))
    y.backward(dy.to(dtype))
    db = None if bias is None else dy.to(dtype).reshape(-1, dy.shape[-1]).sum(0)
    return y.detach(), torch.where(m, xs.grad, torch.zeros((), dtype=dtype, device=x.device)), w.grad, db
