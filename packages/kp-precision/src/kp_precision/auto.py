"""auto_filter: which linear layers gain from float8 training, measured on the layer's own GPU once per shape.

    model = convert_to_float8_training(model, recipe="rowwise", module_filter_fn="auto")
    # or, to choose the token count, the margin and the layers never to touch:
    keep = kp_precision.auto_filter("rowwise", tokens=16384, min_speedup=1.1, skip=("lm_head",))
    model = convert_to_float8_training(model, recipe="rowwise", module_filter_fn=keep)

A float8 layer pays for its casts (and, in the rowwise and blockwise recipes, a second cast of each operand for
the backward) with faster matmuls, so small layers and few tokens lose. No fixed threshold holds for every GPU,
recipe and token count, so the filter times both forms of each distinct layer shape (in, out, bias, weight dtype)
on the device the layer is on: forward and backward of nn.Linear in the activation dtype (bf16, or fp16 for fp16
weights) against Float8Linear with the recipe, `tokens` rows of input, each under torch.compile by default (the
way float8 training runs: eager float8 pays a launch per cast and transpose). It keeps float8 where the float8
step is at least `min_speedup` times faster. Measurements are cached per process. On a CPU nothing is converted
(one warning): there is no float8 hardware to measure.
"""

import time
import warnings

import torch
from torch import nn

from kp_precision.recipes import Float8Config
from kp_precision.shared import unaligned
from kp_precision.training import Float8Linear

_MEASURED: dict[tuple, tuple[float, float]] = {}


def _step_ms(layer: nn.Module, x: torch.Tensor, iters: int = 10) -> float:
    """ms per forward + backward of layer on x, after warm-up (compilation, autotuning, the allocator)."""
    gy = torch.ones(x.shape[0], layer.out_features, device=x.device, dtype=x.dtype)

    def step():
        layer(x).backward(gy)

    for _ in range(3):
        step()
    torch.cuda.synchronize(x.device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize(x.device)
    return (time.perf_counter() - start) / iters * 1e3


def _measure(linear: nn.Linear, config, tokens: int, compiled: bool) -> tuple[float, float]:
    """(bf16 ms, float8 ms) of a training step's matmuls for linear's shape, on its device."""
    w, k, n, bias = linear.weight, linear.in_features, linear.out_features, linear.bias is not None
    act = torch.float16 if w.dtype == torch.float16 else torch.bfloat16
    dense = nn.Linear(k, n, bias=bias, device=w.device, dtype=act)
    f8 = Float8Linear.from_linear(nn.Linear(k, n, bias=bias, device=w.device, dtype=w.dtype), config=config)
    x = torch.randn(tokens, k, device=w.device, dtype=act, requires_grad=True)
    wrap = torch.compile if compiled else (lambda m: m)
    return _step_ms(wrap(dense), x), _step_ms(wrap(f8), x)


def _measured(linear: nn.Linear, config, tokens: int, compiled: bool) -> tuple[float, float]:
    """_measure, once per shape, weight dtype, device and setting in this process."""
    w = linear.weight
    key = (linear.in_features, linear.out_features, linear.bias is not None, w.dtype, w.device)
    key += (config, tokens, compiled)
    if key not in _MEASURED:
        _MEASURED[key] = _measure(linear, config, tokens, compiled)
    return _MEASURED[key]


def _on_gpu(module: nn.Module) -> bool:
    return module.weight.device.type == "cuda"


def auto_filter(recipe="tensorwise", *, tokens: int = 8192, min_speedup: float = 1.05, skip=(), compiled=True):
    """A module_filter_fn for convert_to_float8_training that keeps float8 only where it was measured faster.

    `recipe`: a recipe name or a Float8Config (the one the conversion will use); `tokens`: rows of input per
    step (batch x sequence); `min_speedup`: how much faster the float8 step must be; `skip`: substrings of
    layer names never converted (e.g. "lm_head"); `compiled`: time both forms under torch.compile.

    Returns a function (module, fqn) -> bool for `module_filter_fn`. Layers not on a CUDA device are never
    converted (with one warning).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> keep = kp_precision.auto_filter("rowwise", tokens=16384, min_speedup=1.1, skip=("lm_head",))
        >>> keep(torch.nn.Linear(64, 64), "layers.0.lm_head")
        False
        >>> model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, device="cuda"))  # needs a GPU
        >>> model = kp_precision.convert_to_float8_training(model, recipe="rowwise", module_filter_fn=keep)
    """
    config = recipe if isinstance(recipe, Float8Config) else Float8Config(recipe=recipe)
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"auto_filter: tokens must be a positive int, got {tokens!r}")
    if not isinstance(min_speedup, (int, float)) or min_speedup <= 0:
        raise ValueError(f"auto_filter: min_speedup must be a positive number, got {min_speedup!r}")
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    warned = []

    def keep(module: nn.Module, fqn: str) -> bool:
        if any(s in fqn for s in skip):
            return False
        if not _on_gpu(module):
            if not warned:
                warnings.warn("auto_filter: measures on a CUDA device; layers elsewhere stay nn.Linear", stacklevel=2)
                warned.append(True)
            return False
        if unaligned(module):
            return True  # the conversion skips it and says why
        dense_ms, float8_ms = _measured(module, config, tokens, compiled)
        return float8_ms * min_speedup <= dense_ms

    return keep
