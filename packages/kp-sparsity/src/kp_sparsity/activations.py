"""2:4 activations: an nn.Linear whose input keeps, per token, the 2 largest |x| of every 4 consecutive input
features (kp::prune_2_4's mask), as in 2:4 activation-sparsity training work (squared-ReLU MLPs, whose
activations are mostly zeros already). The weight stays dense.

y = x_s W^T + b with x_s = x * m; dx = (dy W) * m; dW = dy^T x_s. On the sparse route kp packs x_s into
cuSPARSELt's layout each call (kp::pack_2_4_cusparselt) and cuSPARSELt multiplies it, the sparse operand first;
a call whose token count is not a multiple of 64 takes the dense matmul on x_s (the same numbers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kp_sparsity import functional
from kp_sparsity.ops import cusparselt
from kp_sparsity.shared import SPARSE_DTYPES, compute_operands, sharing


def why_not_sparse(in_features: int, out_features: int, dtype, device) -> str:
    """Why 2:4 activations cannot run on sparse tensor cores here ('' when they can)."""
    if dtype not in SPARSE_DTYPES:
        return f"dtype {dtype} (2:4 matmuls take fp16 / bf16)"
    if device.type != "cuda":
        return "not on a CUDA device"
    if in_features % cusparselt.BLOCK or out_features % 16:
        return f"in_features {in_features} (a multiple of 64) or out_features {out_features} (of 16)"
    return ""


class _ActLinear24(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sparse):
        x2 = x.reshape(-1, weight.shape[1])
        mask = functional.mask_2_4(x2)
        if sparse and x2.shape[0] % cusparselt.BLOCK == 0:
            packed, _ = cusparselt.PACK(x2, mask, False)
            y = torch._cslt_sparse_mm(packed, weight.t())  # (x_s W^T): the 2:4 operand first
            y = y if bias is None else y + bias
        else:
            y = F.linear(torch.where(mask, x2, torch.zeros((), dtype=x2.dtype, device=x2.device)), weight, bias)
        ctx.save_for_backward(x2, mask, weight)
        ctx.has_bias, ctx.x_shape = bias is not None, x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, mask, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0])
        zero = torch.zeros((), dtype=x2.dtype, device=x2.device)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = torch.where(mask, dy2.mm(weight), zero).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            dw = dy2.t().mm(torch.where(mask, x2, zero))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db, None


def _check_route(route: str) -> str:
    if route not in ("sparse", "dense"):
        raise ValueError(f"SparseActivationLinear: route must be 'sparse' or 'dense', got {route!r}")
    return route


class SparseActivationLinear(nn.Linear):
    """nn.Linear whose input is made 2:4 along in_features each call (module docstring); `route` "sparse" (the
    packed input on sparse tensor cores) or "dense" (the same numbers through the dense matmul).

    Args:
        in_features: a multiple of 4 (of 64 for route "sparse").
        out_features: as nn.Linear's (a multiple of 16 for route "sparse").
        bias: as nn.Linear's.
        device: as nn.Linear's.
        dtype: as nn.Linear's.
        route: "dense" or "sparse" (float16 / bfloat16 on a CUDA device).

    The forward takes (*, in_features) and returns (*, out_features). `from_dense(linear, route=...)` shares an
    nn.Linear's parameters.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> import kp_sparsity
        >>> layer = kp_sparsity.SparseActivationLinear(128, 64)
        >>> x = torch.randn(8, 128)
        >>> x_s = x * kp_sparsity.mask_2_4(x)  # per token, the 2 largest |x| of every 4 features
        >>> torch.allclose(layer(x), F.linear(x_s, layer.weight, layer.bias), atol=1e-6)
        True
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, route="dense"):
        if in_features % 4:
            raise ValueError(f"SparseActivationLinear: in_features must be a multiple of 4, got {in_features}")
        _check_route(route)
        super().__init__(in_features, out_features, bias, device, dtype)
        self.route = route

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, route: str = "dense") -> SparseActivationLinear:
        """A SparseActivationLinear sharing linear's parameters (no copy)."""
        new = sharing(cls, linear)
        if new.in_features % 4:
            raise ValueError(f"SparseActivationLinear: in_features must be a multiple of 4, got {new.in_features}")
        new.route = _check_route(route)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, weight, bias = compute_operands(self, x)
        sparse = self.route == "sparse"
        if sparse and (not_sparse := why_not_sparse(self.in_features, self.out_features, x.dtype, x.device)):
            raise ValueError(f"SparseActivationLinear: route 'sparse' cannot run here: {not_sparse}")
        with torch.autocast(x.device.type, enabled=False):
            return _ActLinear24.apply(x, weight, bias, sparse)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, 2:4 activations, route={self.route}"
