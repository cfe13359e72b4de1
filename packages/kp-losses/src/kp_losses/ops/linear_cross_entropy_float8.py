"""fused_linear_cross_entropy's head in float8 (its `float8` option): the chunks' GEMMs on float8 operands
through kp-precision's quantize and scaled_mm (the `kp-losses[float8]` extra):

    logits  = x @ w.T        x and w cast along H (the hidden size), x once for every chunk
    dinput  = g @ w          g cast along V, w along V
    dweight = g.T @ x        tensorwise: g.T and x.T along the rows, one GEMM after the last chunk

"tensorwise": one scale per tensor, x and w float8_e4m3fn, g float8_e5m2 (its range wider than its precision
needs), the float8 data of w and x transposed for the backward rather than cast again (torchao's tensorwise
recipe, kp_precision.Float8Config("tensorwise")). d(weight) sums over every chunk's rows, so g's scale cannot be
each chunk's amax: it is g's bound over e5m2's largest value (each element of the chunk's gradient is at most its
row's loss gradient x the largest class weight x (1 + 2 z_loss |logsumexp|), the logits bounded by the softcap or
by |x| |w| + |bias|), e5m2's 32 binades leaving room for the slack; every chunk's float8 g.T is kept (one byte per
logit: half the fp32 sum of d(weight) the other heads keep) and d(weight) is one GEMM, rounded once.
"rowwise": one scale per row of each contraction, power-of-two scales, e4m3fn (torchao's rowwise recipe) for the
logits and d(input); d(weight)'s contraction over the rows crosses the chunks, whose rows' scales a float8 GEMM
cannot carry, so it runs in the input's dtype (summed in fp32, as without float8).

g is the chunk's gradient as the cross-entropy kernels wrote it over the logits (the logits' dtype), cast
afterwards; the GEMMs sum in fp32 and round to the input's dtype. H and V must be multiples of 16 (float8 tensor
cores); the rows are padded to one (rows of zeros whose targets are ignored).
"""

import math

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise")  # the op's float8 argument: 0 none, 1 + RECIPES.index(recipe)
ALIGN = 16
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what kp-precision casts


def kp_precision():
    """kp-precision's module, or ImportError saying how to get it."""
    try:
        import kp_precision
    except ImportError as e:
        raise ImportError("kp_losses: float8 needs kp-precision: pip install 'kp-losses[float8]'") from e
    return kp_precision


def _cast(t: torch.Tensor, fp8: torch.dtype, rowwise: bool, scale=None):
    gran = "rowwise" if rowwise else "tensorwise"
    return kp_precision().quantize(t, fp8, granularity=gran, power_of_2=rowwise, scale=scale)


def _transpose(t: torch.Tensor) -> torch.Tensor:
    """t.t().contiguous() in one tiled pass (kp-precision's kp::transpose; torch's transposing copy is slow)."""
    kp_precision()
    return torch.ops.kp.transpose(t)


def grad_scale(x, weight, bias, ce_weight, row_scale, z_loss: float, softcap: float, v: int) -> torch.Tensor:
    """g's tensorwise dequantisation scale (0-d, on the device, no sync): its bound over e5m2's largest value, as
    a dynamic scale is the amax over it (the bound is the amax where a row's target has a small probability; a
    power of two above it lost up to a binade of e5m2's subnormals: 5.6 % against 5.3 % relative error on a test
    problem). |d loss / d logit| <= the row's loss gradient x the largest |class weight| (and 1) x (1 + 2 z
    |lse|), |lse| <= the largest |logit| + log V; a softcap's derivative is at most 1."""
    bound = row_scale.abs().amax().float()
    if ce_weight is not None:
        bound = bound * ce_weight.abs().amax().float().clamp(min=1.0)
    if z_loss:
        if softcap:
            logit = torch.tensor(softcap, device=x.device)
        else:
            norms = (torch.linalg.vector_norm(t, dim=1, dtype=torch.float32).amax() for t in (x, weight))
            logit = math.prod(norms)
            logit = logit + (0 if bias is None else bias.float().abs().amax())
        bound = bound * (1 + 2 * abs(z_loss) * (logit + math.log(v)))
    return bound.clamp(min=1e-30) / torch.finfo(E5M2).max


class Head:
    """The head's operands cast once a call: x and w along H for the logits, w along V for d(input), x.T (and
    tensorwise, every chunk's g.T) for d(weight)."""

    def __init__(self, x, weight, recipe: int, need_input: bool, need_weight: bool, g_scale):
        self.rowwise = RECIPES[recipe - 1] == "rowwise"
        self.qx = _cast(x, E4M3, self.rowwise)
        self.qw = _cast(weight, E4M3, self.rowwise)
        self.g_scale = g_scale  # tensorwise: g's fixed scale (grad_scale); rowwise: None, each row its own
        self.w_dx = None
        if need_input and self.rowwise:  # w.T (H, V) cast along V: (V, H) column-major, scale (1, H)
            qwt = _cast(_transpose(weight), E4M3, True)
            self.w_dx = qwt.data.t(), qwt.scale.t()
        elif need_input:
            self.w_dx = _transpose(self.qw.data).t(), self.qw.scale
        self.gt = None  # tensorwise: every chunk's float8 g.T, (V, rows)
        if need_weight and not self.rowwise:
            self.gt = torch.empty((weight.shape[0], x.shape[0]), dtype=E5M2, device=x.device)

    def logits(self, start: int, end: int, bias, dtype: torch.dtype) -> torch.Tensor:
        """The rows' logits, in dtype."""
        qx, qw = self.qx, self.qw
        xs = qx.scale if not self.rowwise else qx.scale[start:end]
        ws = qw.scale.t() if self.rowwise else qw.scale
        return kp_precision().scaled_mm(qx.data[start:end], qw.data.t(), xs, ws, bias=bias, out_dtype=dtype)

    def grads(self, g: torch.Tensor, start: int, end: int, dx, dtype: torch.dtype) -> None:
        """The rows' d(input) written into dx (when not None); tensorwise, their float8 g.T kept for d(weight)."""
        if dx is None and self.gt is None:
            return
        qg = _cast(g, E4M3 if self.rowwise else E5M2, self.rowwise, scale=self.g_scale)
        if dx is not None:
            dx.copy_(kp_precision().scaled_mm(qg.data, self.w_dx[0], qg.scale, self.w_dx[1], out_dtype=dtype))
        if self.gt is not None:
            self.gt[:, start:end] = _transpose(qg.data)

    def weight_grad(self, dtype: torch.dtype) -> torch.Tensor:
        """Tensorwise: d(weight) (V, H) in dtype, g.T @ x over every row in one float8 GEMM."""
        xt = _transpose(self.qx.data)  # (H, rows): x as the GEMM's column-major second operand
        return kp_precision().scaled_mm(self.gt, xt.t(), self.g_scale, self.qx.scale, out_dtype=dtype)
