"""SparseLinear and sparsify(): nn.Linear layers with 2:4 weights, and a router that keeps a layer dense where
the 2:4 matmul is not faster on this GPU at the model's token count.

Every selected layer's weight is pruned to 2:4 (magnitude, or Wanda from calibration activations), so the
model's numbers are the pruned model's whichever way a layer runs; the router only picks the kernel: torch's
semi-structured sparse matmul (cuSPARSELt or CUTLASS) or the dense one on the pruned weight.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

import kp_core
from kp_sparsity import functional
from kp_sparsity.shared import eligible, time_ms


class SparseLinear(nn.Module):
    """y = x W^T + b with W a 2:4 semi-structured sparse weight (torch's subclass), inference only.

    Args:
        weight: (out_features, in_features): one of torch's semi-structured sparse tensors (to_sparse_2_4), or a
            dense tensor already pruned to 2:4.
        bias: (out_features,), or None.
        in_features: the input's last dim.
        out_features: the output's last dim.

    `SparseLinear.from_dense(linear, column_scale=None, backend=None, alg_id=None)` prunes and packs an
    nn.Linear. The forward takes (*, in_features) in the weight's dtype (float16 or bfloat16 for a sparse
    weight) on a GPU with sparse tensor cores.

    Examples:
        >>> import torch
        >>> import kp_sparsity
        >>> dense = torch.nn.Linear(4096, 4096, dtype=torch.bfloat16, device="cuda")  # needs a GPU
        >>> layer = kp_sparsity.SparseLinear.from_dense(dense)
        >>> layer(torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda")).shape
        torch.Size([2048, 4096])
    """

    def __init__(self, weight, bias: torch.Tensor | None, in_features: int, out_features: int):
        kp_core.check_tensor("SparseLinear", "weight", weight)  # a dense 2:4 tensor or torch's sparse subclass
        if bias is not None:
            kp_core.check_tensor("SparseLinear", "bias", bias)
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_dense(
        cls,
        linear: nn.Linear,
        *,
        column_scale: torch.Tensor | None = None,
        backend: str | None = None,
        alg_id: int | None = None,
    ):
        """linear's weight pruned to 2:4 (magnitude, or Wanda with column_scale) and packed by kp; alg_id: the
        cuSPARSELt algorithm to run (None: torch's default)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"SparseLinear.from_dense: linear must be an nn.Linear, got {type(linear).__name__}")
        weight = functional.to_sparse_2_4(linear.weight.detach(), column_scale=column_scale, backend=backend)
        if alg_id is not None:
            weight.alg_id_cusparselt = alg_id
        return cls(weight, linear.bias, linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, 2:4"


@dataclasses.dataclass
class Decision:
    """What sparsify or sparsify_for_training did with one layer.

    Attributes:
        name: the layer's name in the model.
        shape: its weight's (out_features, in_features).
        route: "sparse", "dense", or "unchanged" (not converted; `why` says why).
        dense_ms: the dense timing where measured (route "auto"), else None.
        sparse_ms: the 2:4 timing where measured, else None.
        why: the reason for the route.
        alg_id: the cuSPARSELt algorithm the router picked, or None.

    Examples:
        >>> import torch
        >>> import kp_sparsity
        >>> model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 128))
        >>> decisions = kp_sparsity.sparsify(model, route="dense")
        >>> decisions[0]
        Decision(name='0', shape=(64, 128), route='dense', dense_ms=None, sparse_ms=None, why='', alg_id=None)
    """

    name: str
    shape: tuple[int, int]
    route: str  # "sparse" or "dense"
    dense_ms: float | None = None
    sparse_ms: float | None = None
    why: str = ""
    alg_id: int | None = None  # the cuSPARSELt algorithm the router picked


_MEASURED: dict = {}


# cuSPARSELt algorithm ids the router tries per shape (the best of them was 0 or 1 at every Llama MLP shape
# measured on an H200; torch's default is 0)
ALG_IDS = (0, 1, 2, 3)


def measure(
    out_features: int, in_features: int, dtype: torch.dtype, tokens: int, device, backend: str | None = None
) -> tuple[float, float, int | None]:
    """(dense ms, 2:4 sparse ms, cuSPARSELt algorithm id or None) of F.linear for a (tokens, in_features) input on
    `device`: with cuSPARSELt, the fastest of ALG_IDS. Measured once per shape, dtype, token count, backend and GPU
    in this process."""
    key = (out_features, in_features, dtype, tokens, backend, torch.cuda.get_device_name(device))
    if key not in _MEASURED:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(out_features, in_features, device=device, dtype=dtype, generator=g)
        x = torch.randn(tokens, in_features, device=device, dtype=dtype, generator=g)
        sparse = functional.to_sparse_2_4(w, backend=backend)
        pruned = functional.prune_2_4(w)
        dense_ms = time_ms(lambda: F.linear(x, pruned))
        if isinstance(sparse, torch.sparse.SparseSemiStructuredTensorCUSPARSELT):
            times = {}
            for alg in ALG_IDS:
                sparse.alg_id_cusparselt = alg
                try:
                    times[alg] = time_ms(lambda: F.linear(x, sparse))
                except RuntimeError:  # an id this cuSPARSELt build or shape does not have
                    continue
            alg = min(times, key=times.get)
            _MEASURED[key] = (dense_ms, times[alg], alg)
        else:
            _MEASURED[key] = (dense_ms, time_ms(lambda: F.linear(x, sparse)), None)
    return _MEASURED[key]


def calibrate(model: nn.Module, calibration, names) -> dict[str, torch.Tensor]:
    """Wanda's column scales: per named layer, the L2 norm over every calibration token of each input feature."""
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name in names:
        layer = model.get_submodule(name)

        def hook(_m, args, name=name):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sums[name] = sums.get(name, 0) + x.square().sum(0)

        hooks.append(layer.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for batch in calibration:
                model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    finally:
        for h in hooks:
            h.remove()
    missing = [n for n in names if n not in sums]
    if missing:
        raise ValueError(f"sparsify: the calibration batches never reached {missing[:3]}")
    return {n: s.sqrt() for n, s in sums.items()}


def sparsify(
    model: nn.Module,
    *,
    module_filter_fn=None,
    method: str = "magnitude",
    calibration=None,
    route: str = "auto",
    tokens: int = 4096,
    backend: str | None = None,
) -> list[Decision]:
    """Prune model's nn.Linear layers to 2:4 in place and run each through the faster kernel.

    module_filter_fn(module, fqn) -> bool picks layers (default: every eligible nn.Linear: fp16 / bf16 on a GPU,
    out_features % 32 == 0, in_features % 64 == 0; with route "dense", any float dtype and device with
    in_features % 4 == 0). method "magnitude" or "wanda" (needs calibration: an
    iterable of model inputs, a tensor or a tuple of positional arguments per batch). route "auto" measures
    dense and 2:4 F.linear at `tokens` rows per distinct layer shape and keeps dense where 2:4 is not faster;
    "sparse" / "dense" force one. Returns one Decision per layer considered (why a layer was skipped, or which
    kernel it got and the times measured).

    Examples:
        On a CPU, route "dense" prunes the weights in place (the model then computes what the 2:4 model does):

        >>> import torch
        >>> import kp_sparsity
        >>> model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 128))
        >>> [d.route for d in kp_sparsity.sparsify(model, route="dense")]
        ['dense', 'dense']
        >>> int((model[0].weight != 0).view(64, 32, 4).sum(-1).max())
        2
        >>> batches = [torch.randn(16, 128) for _ in range(4)]  # Wanda: calibration inputs weigh |w|
        >>> model = torch.nn.Sequential(torch.nn.Linear(128, 64))
        >>> [d.route for d in kp_sparsity.sparsify(model, method="wanda", calibration=batches, route="dense")]
        ['dense']
    """
    kp_core.check_module("sparsify", "model", model)
    kp_core.check_callable("sparsify", "module_filter_fn", module_filter_fn)
    if method not in ("magnitude", "wanda"):
        raise ValueError(f"sparsify: method must be 'magnitude' or 'wanda', got {method!r}")
    if route not in ("auto", "sparse", "dense"):
        raise ValueError(f"sparsify: route must be 'auto', 'sparse' or 'dense', got {route!r}")
    if method == "wanda" and calibration is None:
        raise ValueError("sparsify: method='wanda' needs calibration (model inputs whose activations weigh |w|)")
    decisions, chosen = [], []
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or (module_filter_fn is not None and not module_filter_fn(m, name)):
            continue
        why = (
            "the root module (sparsify its parent)"
            if not name
            else eligible(m.weight.shape, m.weight.dtype, m.weight.device, route != "dense")
        )
        if why:
            decisions.append(Decision(name, tuple(m.weight.shape), "unchanged", why=why))
        else:
            chosen.append(name)
    scales = calibrate(model, calibration, chosen) if method == "wanda" else {}
    for name in chosen:
        layer = model.get_submodule(name)
        out_f, in_f = layer.weight.shape
        d = Decision(name, (out_f, in_f), route)
        if route == "auto":
            d.dense_ms, d.sparse_ms, d.alg_id = measure(
                out_f, in_f, layer.weight.dtype, tokens, layer.weight.device, backend
            )
            d.route = "sparse" if d.sparse_ms < d.dense_ms else "dense"
            d.why = f"measured at {tokens} tokens"
        scale = scales.get(name)
        if d.route == "sparse":
            new = SparseLinear.from_dense(layer, column_scale=scale, backend=backend, alg_id=d.alg_id)
        else:
            new = layer
            with torch.no_grad():
                layer.weight.copy_(functional.prune_2_4(layer.weight, column_scale=scale))
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
        decisions.append(d)
    return decisions
