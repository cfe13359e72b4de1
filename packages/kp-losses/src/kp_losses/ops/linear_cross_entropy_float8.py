"""fused_linear_cross_entropy's head in float8 (its `float8` option): the three GEMMs of each chunk on float8
operands through kp-precision's quantize and scaled_mm (the `kp-losses[float8]` extra), dynamic scaling:

    logits  = x @ w.T        x and w cast along H (the hidden size)
    dinput  = g @ w          g cast along V, w along V
    dweight = g.T @ x        g.T and x.T cast along the chunk's rows

"tensorwise": one scale per tensor, x and w float8_e4m3fn, g float8_e5m2 (its range wider than its precision
needs), the float8 data of w and x transposed for the backward rather than cast again (torchao's tensorwise
recipe, kp_precision.Float8Config("tensorwise")); "rowwise": one scale per row of each contraction, e4m3fn
everywhere, power-of-two scales (torchao's rowwise recipe). g is the chunk's gradient as the cross-entropy kernels
wrote it over the logits (the logits' dtype), cast afterwards; the GEMMs sum in fp32 and round to the input's dtype,
d(weight)'s per-chunk products are summed in fp32. H and V must be multiples of 16 (float8 tensor cores); the rows
are padded to one (rows of zeros whose targets are ignored) where the chunk's rows are the contraction.
"""

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


def _cast(t: torch.Tensor, fp8: torch.dtype, rowwise: bool):
    return kp_precision().quantize(t, fp8, granularity="rowwise" if rowwise else "tensorwise", power_of_2=rowwise)


def _t(scale: torch.Tensor) -> torch.Tensor:
    """A scale as scaled_mm's scale_b for the transposed operand (a tensorwise scale is 0-d)."""
    return scale.t() if scale.dim() else scale


def _column_major(data: torch.Tensor) -> torch.Tensor:
    return data.t().contiguous().t()


class Head:
    """The head's weight cast once a call: along H for the logits, and along V for d(input) when it is needed."""

    def __init__(self, weight: torch.Tensor, recipe: int, need_input: bool):
        self.rowwise = RECIPES[recipe - 1] == "rowwise"
        self.grad = E4M3 if self.rowwise else E5M2
        self.qw = _cast(weight, E4M3, self.rowwise)
        self.w_dx = None
        if need_input and self.rowwise:  # w.T (H, V) cast along V: (V, H) column-major, scale (1, H)
            qwt = _cast(weight.t().contiguous(), E4M3, True)
            self.w_dx = qwt.data.t(), qwt.scale.t()
        elif need_input:
            self.w_dx = _column_major(self.qw.data), self.qw.scale

    def logits(self, xc: torch.Tensor, bias, dtype: torch.dtype):
        """(the chunk's logits in dtype, x's float8 cast)."""
        qx = _cast(xc, E4M3, self.rowwise)
        mm = kp_precision().scaled_mm
        return mm(qx.data, self.qw.data.t(), qx.scale, _t(self.qw.scale), bias=bias, out_dtype=dtype), qx

    def grads(self, g: torch.Tensor, xc: torch.Tensor, qx, dx, need_weight: bool, dtype: torch.dtype):
        """d(input) of the chunk written into dx (when not None); returns the chunk's d(weight) (V, H) in dtype, or
        None."""
        mm = kp_precision().scaled_mm
        qg = _cast(g, self.grad, self.rowwise) if dx is not None or not self.rowwise else None
        if dx is not None:
            dx.copy_(mm(qg.data, self.w_dx[0], qg.scale, self.w_dx[1], out_dtype=dtype))
        if not need_weight:
            return None
        if self.rowwise:  # g.T (V, R) and x.T (H, R) cast along the rows
            qgt = _cast(g.t().contiguous(), self.grad, True)
            qxt = _cast(xc.t().contiguous(), E4M3, True)
            return mm(qgt.data, qxt.data.t(), qgt.scale, qxt.scale.t(), out_dtype=dtype)
        return mm(qg.data.t().contiguous(), _column_major(qx.data), qg.scale, qx.scale, out_dtype=dtype)
