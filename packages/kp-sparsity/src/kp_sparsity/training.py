"""Sparse training: nn.Linear layers whose weight runs 2:4 in every forward and backward while the optimizer keeps
the dense weight (straight-through, as in SR-STE and torchao's runtime 2:4 training).

Per forward, the layer multiplies by W_s = W * mask with a transposable 2:4 mask (W_s and W_s^T both 2:4), so both
matmuls that read the weight can run on sparse tensor cores: y = x W_s^T and, in the backward, dx = dy W_s.
The weight's gradient stays dense (dW = dy^T x), and it reaches the dense weight:
- mask_every=k: the mask is recomputed from the dense weight every k training forwards (k=1: every step, as
  SR-STE trains from scratch), and the gradient is straight-through plus SR-STE's decay of the pruned weights:
  dW + decay * (W - W_s);
- mask_every=None: the mask is fixed (computed once, when the layer is made: sparse fine-tuning of a pruned
  model), the gradient is masked (dW * mask) and the weight is pruned in place, so it stays 2:4.
The mask is kp's (kp::mask_2_4_transposable: per 4 x 4 block the best of the 90 patterns). On the sparse route kp
packs W_s and W_s^T each step into cuSPARSELt's layout in one pass (kp::pack_2_4_cusparselt). torch's own runtime
packer (torch._sparse_semi_structured_tile, which torchao's SemiSparseLinear runs) gave wrong products with
cuSPARSELt on an H200 (torch 2.11), and cuSPARSELt's own compression is too slow to run each step.
cuSPARSELt's products come column-major; they are handed on as views (_unflatten), never copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kp_core
from kp_sparsity import functional
from kp_sparsity.activations import SparseActivationLinear
from kp_sparsity.activations import why_not_sparse as why_not_sparse_act
from kp_sparsity.linear import Decision
from kp_sparsity.ops import cusparselt
from kp_sparsity.shared import SPARSE_DTYPES, compute_operands, eligible, sharing, time_ms

_ROUTES = ("auto", "sparse", "dense")


def _pack(weight: torch.Tensor, mask: torch.Tensor):
    """weight * mask (mask transposable 2:4) as a cuSPARSELt semi-structured tensor holding W_s and W_s^T, both
    packed by kp in one pass."""
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT

    packed, packed_t = cusparselt.PACK(weight, mask, True)
    return SparseSemiStructuredTensorCUSPARSELT(
        weight.shape, packed, None, packed_t, None, None, fuse_transpose_cusparselt=False, requires_grad=False
    )


def _unflatten(t: torch.Tensor, lead) -> torch.Tensor:
    """(T, N) as (*lead, N); cuSPARSELt's products come column-major (the transpose of a row-major result), which
    a reshape would copy (about 0.9 ms for 8192 x 14336 bf16 on an H100): a view with permuted strides instead."""
    if len(lead) > 1 and t.stride(0) == 1 and t.shape[1] > 1:
        return t.t().reshape(t.shape[1], *lead).movedim(0, -1)
    return t.reshape(*lead, t.shape[1])


class _Linear24(torch.autograd.Function):
    """y = x W_s^T + b, W_s = where(mask, W, 0); the weight's gradient as the module docstring says."""

    @staticmethod
    def forward(ctx, x, weight, bias, mask, decay, fixed, sparse):
        k = weight.shape[1]
        x2 = x.reshape(-1, k)
        if sparse:
            operand = _pack(weight, mask)
        else:
            operand = torch.where(mask, weight, torch.zeros((), dtype=weight.dtype, device=weight.device))
        y = F.linear(x2, operand, bias)
        ctx.save_for_backward(x2, weight, mask)
        ctx.operand, ctx.decay, ctx.fixed, ctx.has_bias, ctx.x_shape = operand, decay, fixed, bias is not None, x.shape
        return _unflatten(y, x.shape[:-1])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mask = ctx.saved_tensors
        dy2 = dy.reshape(-1, weight.shape[0])  # a view for the layouts _unflatten makes; any layout multiplies
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            # dy @ W_s: with a packed operand torch multiplies by its packed transpose (W_s^T is 2:4 as well)
            dx = _unflatten(torch.mm(dy2, ctx.operand), ctx.x_shape[:-1])
        if ctx.needs_input_grad[1]:
            dw = dy2.t().mm(x2.to(dy2.dtype))
            zero = torch.zeros((), dtype=dw.dtype, device=dw.device)
            if ctx.fixed:
                dw = torch.where(mask, dw, zero)
            elif ctx.decay:
                dw = dw + ctx.decay * torch.where(mask, zero, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        ctx.operand = None
        return dx, dw, db, None, None, None, None


class SparseTrainingLinear(nn.Linear):
    """nn.Linear trained with a runtime 2:4 weight (module docstring): `mask` (bool buffer, saved in state_dicts),
    `mask_every`, `decay`, `route` ("sparse": packed for sparse tensor cores each step; "dense": the same numbers
    through the dense matmul).

    Args:
        in_features: a multiple of 4 (of 64 for route "sparse").
        out_features: a multiple of 4 (of 64 for route "sparse").
        bias: as nn.Linear's.
        device: as nn.Linear's.
        dtype: as nn.Linear's.
        mask_every: recompute the mask every this many training forwards, or None for a fixed mask.
        decay: SR-STE's decay of the pruned weights (mask_every not None).

    The forward takes (*, in_features) and returns (*, out_features); route "sparse" needs float16 / bfloat16
    compute on a CUDA device. `from_dense(linear, mask_every=..., decay=...)` shares an nn.Linear's parameters.

    Examples:
        >>> import torch
        >>> import kp_sparsity
        >>> layer = kp_sparsity.SparseTrainingLinear(128, 64, mask_every=None)  # a fixed mask: weights pruned now
        >>> layer(torch.randn(4, 128)).sum().backward()
        >>> int((layer.weight != 0).view(64, 32, 4).sum(-1).max()), layer.mask.dtype
        (2, torch.bool)
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, mask_every=1, decay=2e-4):
        super().__init__(in_features, out_features, bias, device, dtype)
        self._setup(mask_every, decay)

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, mask_every=1, decay=2e-4) -> SparseTrainingLinear:
        """A SparseTrainingLinear sharing linear's parameters (no copy), its mask computed from them."""
        new = sharing(cls, linear)
        new._setup(mask_every, decay)
        return new

    def _setup(self, mask_every, decay) -> None:
        if mask_every is not None and (
            isinstance(mask_every, bool) or not isinstance(mask_every, int) or mask_every < 1
        ):
            raise ValueError(f"SparseTrainingLinear: mask_every must be a positive int or None, got {mask_every!r}")
        if not isinstance(decay, (int, float)) or decay < 0:
            raise ValueError(f"SparseTrainingLinear: decay must be a number >= 0, got {decay!r}")
        if self.out_features % 4 or self.in_features % 4:
            raise ValueError(
                "SparseTrainingLinear: a transposable 2:4 mask needs in_features and out_features multiples of 4, "
                f"got weight of shape {(self.out_features, self.in_features)}"
            )
        self.mask_every, self.decay, self.route, self.steps = mask_every, float(decay), "dense", 0
        self.register_buffer("mask", torch.empty(self.weight.shape, dtype=torch.bool, device=self.weight.device))
        self.update_mask()

    @torch.no_grad()
    def update_mask(self) -> None:
        """Recompute the mask from the dense weight; with a fixed mask, prune the weight to it."""
        self.mask.copy_(functional.mask_2_4(self.weight.detach(), transposable=True))
        if self.mask_every is None:
            self.weight.masked_fill_(~self.mask, 0)

    @torch.compiler.disable
    def _count_step(self) -> None:
        # outside torch.compile's graph: a Python counter there would be a guard, one recompile per step
        if self.steps and self.steps % self.mask_every == 0:
            self.update_mask()
        self.steps += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mask_every is not None and self.training and torch.is_grad_enabled():
            self._count_step()
        x, weight, bias = compute_operands(self, x)
        sparse = self.route == "sparse"
        if sparse and (not_sparse := why_not_sparse(self.weight.shape, x.dtype, x.device)):
            raise ValueError(f"SparseTrainingLinear: route 'sparse' cannot run here: {not_sparse}")
        with torch.autocast(x.device.type, enabled=False):
            return _Linear24.apply(x, weight, bias, self.mask, self.decay, self.mask_every is None, sparse)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, 2:4 transposable, mask_every={self.mask_every}, route={self.route}"


def why_not_sparse(shape, dtype, device) -> str:
    """Why a layer cannot train on sparse tensor cores ('' when it can): inference's conditions, and the runtime
    packer's multiples of 64."""
    why = eligible(shape, dtype, device, True)
    if not why and (shape[0] % cusparselt.BLOCK or shape[1] % cusparselt.BLOCK):
        why = f"shape {tuple(shape)} (kp's runtime packer takes multiples of {cusparselt.BLOCK})"
    return why


_MEASURED: dict = {}


def measure_step(out_features, in_features, dtype, tokens, device, activations=False) -> tuple[float, float]:
    """(dense ms, sparse ms) of one forward + backward, the input needing its gradient, of a SparseTrainingLinear
    (its mask kept, as between updates) or with activations=True a SparseActivationLinear, at `tokens` rows.
    Measured once per kind, shape, dtype, token count and GPU in this process."""
    key = (activations, out_features, in_features, dtype, tokens, torch.cuda.get_device_name(device))
    if key not in _MEASURED:
        kw = dict(bias=False, device=device, dtype=dtype)
        if activations:
            layer = SparseActivationLinear(in_features, out_features, **kw)
        else:
            layer = SparseTrainingLinear(in_features, out_features, **kw, mask_every=None)
        x = torch.randn(tokens, in_features, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(tokens, out_features, device=device, dtype=dtype)

        def step():
            layer(x).backward(dy)

        times = []
        for route in ("dense", "sparse"):
            layer.route = route
            times.append(time_ms(step, reps=10))
        _MEASURED[key] = tuple(times)
    return _MEASURED[key]


def sparsify_for_training(
    model: nn.Module,
    *,
    module_filter_fn=None,
    activation_filter_fn=None,
    mask_every: int | None = 1,
    decay: float = 2e-4,
    route: str = "auto",
    tokens: int = 8192,
) -> list[Decision]:
    """Swap model's nn.Linear layers in place for SparseTrainingLinear (2:4 weights), or SparseActivationLinear
    (2:4 inputs, dense weights) where activation_filter_fn(module, fqn) says so; both share the layers' parameters,
    so an optimizer made before still steps them.

    module_filter_fn(module, fqn) -> bool picks layers (default: every nn.Linear but the root with both dimensions
    multiples of 4). mask_every / decay: the module docstring (None: a fixed mask, the weights pruned now).
    route "sparse" runs every layer on sparse tensor cores (a GPU, fp16 / bf16 compute (weights or autocast),
    dimensions multiples of 64), "dense" through dense matmuls (the same numbers). "auto" measures one forward +
    backward of each distinct layer shape both ways at `tokens` rows. For the 2:4 weights it picks one route for
    the whole model, the faster over all those layers: cuSPARSELt's products come column-major, and where a sparse
    layer's output meets a dense one's in an elementwise op (a gated MLP's gate and up projections) torch's kernel
    for mismatched layouts cost more than the layer gained (H100: a Llama MLP block with gate and up sparse, down
    dense, 0.86x dense; all three sparse, 1.06x). 2:4 activations (row-major products) are decided per layer.
    Layers that cannot run 2:4 stay dense either way. Returns one Decision per layer considered.

    Examples:
        >>> import torch
        >>> import kp_sparsity
        >>> model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 128))
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> decisions = kp_sparsity.sparsify_for_training(
        ...     model, route="dense", activation_filter_fn=lambda module, name: name == "2"
        ... )
        >>> type(model[0]).__name__, type(model[2]).__name__
        ('SparseTrainingLinear', 'SparseActivationLinear')
        >>> model(torch.randn(8, 128)).sum().backward()
        >>> optimizer.step()  # the optimizer made before steps the same parameters
    """
    kp_core.check_module("sparsify_for_training", "model", model)
    for arg, fn in (("module_filter_fn", module_filter_fn), ("activation_filter_fn", activation_filter_fn)):
        kp_core.check_callable("sparsify_for_training", arg, fn)
    if route not in _ROUTES:
        raise ValueError(f"sparsify_for_training: route must be 'auto', 'sparse' or 'dense', got {route!r}")
    decisions, layers = [], []
    for name, m in list(model.named_modules()):
        if type(m) is not nn.Linear or (module_filter_fn is not None and not module_filter_fn(m, name)):
            continue
        out_f, in_f = m.weight.shape
        act = activation_filter_fn is not None and bool(activation_filter_fn(m, name))
        why = "the root module (sparsify its parent)" if not name else ""
        if not why and (in_f % 4 or (out_f % 4 and not act)):
            why = f"shape {(out_f, in_f)} (2:4 needs multiples of 4)"
        if why:
            decisions.append(Decision(name, (out_f, in_f), "unchanged", why=why))
            continue
        d = Decision(name, (out_f, in_f), route, why="2:4 activations" if act else "")
        # the matmuls run in the weight's dtype, or bf16 under autocast for fp32 weights
        dtype = m.weight.dtype if m.weight.dtype in SPARSE_DTYPES else torch.bfloat16
        not_sparse = ""
        if route != "dense":
            dev = m.weight.device
            not_sparse = (
                why_not_sparse_act(in_f, out_f, dtype, dev) if act else why_not_sparse((out_f, in_f), dtype, dev)
            )
        if route == "sparse" and not_sparse:
            raise ValueError(f"sparsify_for_training: layer {name!r} cannot run 2:4: {not_sparse}")
        if route == "auto":
            if not_sparse:
                d.route, d.why = "dense", not_sparse
            else:
                d.dense_ms, d.sparse_ms = measure_step(out_f, in_f, dtype, tokens, m.weight.device, act)
                if act:
                    d.route = "sparse" if d.sparse_ms < d.dense_ms else "dense"
                    d.why = f"2:4 activations, one step measured at {tokens} tokens"
        layers.append((name, m, d, act))
        decisions.append(d)
    timed = [d for _, _, d, act in layers if d.dense_ms is not None and not act]
    if timed:
        dense, sparse = sum(d.dense_ms for d in timed), sum(d.sparse_ms for d in timed)
        for d in timed:
            d.route = "sparse" if sparse < dense else "dense"
            d.why = (
                f"the model's {len(timed)} 2:4-weight layers, one step each at {tokens} tokens: {dense:.3f} ms "
                f"dense, {sparse:.3f} sparse"
            )
    for name, m, d, act in layers:
        if act:
            new = SparseActivationLinear.from_dense(m, route=d.route)
        else:
            new = SparseTrainingLinear.from_dense(m, mask_every=mask_every, decay=decay)
            new.route = d.route
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return decisions
