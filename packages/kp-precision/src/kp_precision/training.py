"""Float8 training: Float8Linear and convert_to_float8_training.

Each of a linear layer's three matmuls runs in float8 through kp's quantize and scaled_mm ops (one
torch.autograd.Function orchestrates them, so torch.compile sees only declared ops):

    forward       y  = x  @ w.T        contraction over K (in_features)
    grad input    gx = gy @ w          contraction over N (out_features)
    grad weight   gw = gy.T @ x        contraction over M (the rows of x)

Every operand is scaled along its contraction dimension, per recipe:

    tensorwise  one scale per tensor; x and w e4m3fn, the gradient e5m2 (its range is wider than its precision
                needs); the float8 data of w and x is transposed for the backward, not re-quantised
    rowwise     one scale per row of the contraction (torchao's rowwise recipe: e4m3fn everywhere, power-of-two
                scales); the backward quantises w, x and gy again along their other dimension
    blockwise   1 x 128 blocks of x and gy, 128 x 128 blocks of w (DeepSeek-V3): w's float8 data is transposed
                for the backward (square blocks are symmetric), x and gy are quantised again along M

Delayed scaling (tensorwise only) keeps an amax history per tensor (x, w, gy): the scale is the history's
maximum / FP8_MAX, the cast is one pass, and the amax the cast returns is pushed into the history. The first
call fills the history from the current amaxes (dynamic scaling once). The histories are buffers outside the
state_dict, so a Float8Linear's state_dict is an nn.Linear's; after a load the histories start again.

Rows of x are padded to a multiple of 16 only where the float8 matmul needs it (M is the contraction of the
weight gradient); in_features and out_features must be multiples of 16 (convert_to_float8_training skips the
layers that are not, and says which).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kp_precision.auto import auto_filter
from kp_precision.fsdp import Float8AllGatherWeight, Float8GatheredWeight, plain_weight
from kp_precision.functional import quantize, scaled_mm
from kp_precision.ops.quantize import TRANSPOSE
from kp_precision.swap import swap_linears

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
RECIPES = ("tensorwise", "rowwise", "blockwise")


@dataclass(frozen=True)
class Float8Config:
    """How a Float8Linear casts: `recipe` ('tensorwise', 'rowwise', 'blockwise'), `scaling` ('dynamic': each
    tensor's own amax; 'delayed': an amax history of `history_len` steps, tensorwise only), `grad_dtype`
    (the gradient's float8 format; None: e5m2 for tensorwise, e4m3fn otherwise) and `power_of_2` (scales
    floored to powers of two; None: True for rowwise, as torchao's recipe) and `fast_accum_output` (the
    forward's matmul sums all of K in the float8 tensor cores' own accumulator, as torchao's recipes do; the two
    gradient matmuls always add every 128-deep partial sum to float32: see kp_precision.scaled_mm) and
    `fsdp_float8_all_gather` (under FSDP2, each rank casts its weight shard to float8 before the all-gather, which
    then moves half the bytes of bf16, and the forward uses the gathered float8 weight: tensorwise, dynamic scaling
    only; see kp_precision.fsdp)."""

    recipe: str = "tensorwise"
    scaling: str = "dynamic"
    history_len: int = 16
    grad_dtype: torch.dtype | None = None
    power_of_2: bool | None = None
    fast_accum_output: bool = True
    fsdp_float8_all_gather: bool = False

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"Float8Config: recipe must be one of {RECIPES}, got {self.recipe!r}")
        if self.scaling not in ("dynamic", "delayed"):
            raise ValueError(f"Float8Config: scaling must be 'dynamic' or 'delayed', got {self.scaling!r}")
        if self.scaling == "delayed" and self.recipe != "tensorwise":
            raise ValueError(f"Float8Config: delayed scaling is for the tensorwise recipe, got {self.recipe!r}")
        if not isinstance(self.history_len, int) or self.history_len < 1:
            raise ValueError(f"Float8Config: history_len must be a positive int, got {self.history_len!r}")
        if not isinstance(self.fast_accum_output, bool):
            raise TypeError(f"Float8Config: fast_accum_output must be a bool, got {self.fast_accum_output!r}")
        if not isinstance(self.fsdp_float8_all_gather, bool):
            raise TypeError(f"Float8Config: fsdp_float8_all_gather must be a bool, got {self.fsdp_float8_all_gather!r}")
        if self.fsdp_float8_all_gather and (self.recipe, self.scaling) != ("tensorwise", "dynamic"):
            raise ValueError(
                "Float8Config: fsdp_float8_all_gather is for the tensorwise recipe with dynamic scaling, got "
                f"recipe={self.recipe!r}, scaling={self.scaling!r}"
            )
        if self.grad_dtype not in (None, E4M3, E5M2):
            raise TypeError(f"Float8Config: grad_dtype must be float8_e4m3fn or float8_e5m2, got {self.grad_dtype}")

    @property
    def gradient(self) -> torch.dtype:
        return self.grad_dtype or (E5M2 if self.recipe == "tensorwise" else E4M3)

    @property
    def pow2(self) -> bool:
        return self.recipe == "rowwise" if self.power_of_2 is None else self.power_of_2


def _cast(t, fp8, config, *, weight=False, scale=None):
    """t (2-D) quantised along its last dim per the recipe (a weight gets 128 x 128 blocks in blockwise)."""
    if config.recipe == "tensorwise":
        return quantize(t, fp8, scale=scale, power_of_2=config.pow2 and scale is None)
    if config.recipe == "rowwise":
        return quantize(t, fp8, granularity="rowwise", power_of_2=config.pow2)
    return quantize(t, fp8, granularity="blockwise", block=(128, 128) if weight else (1, 128), power_of_2=config.pow2)


def _column_major(data):
    """float8 (R, C) row-major data as the same matrix laid out column-major (one tiled transposing copy)."""
    return TRANSPOSE(data).t()


def _scale_t(scale):
    return scale.t() if scale.dim() else scale


def _delayed_scale(history, fp8):
    return history.amax().clamp(min=1e-12) / torch.finfo(fp8).max


def _delayed_cast(t, fp8, config, history, first, *, weight=False):
    """Tensorwise cast with the history's scale, then push the amax; on the first call a dynamic cast whose
    amax fills the whole history."""
    q = _cast(t, fp8, config, weight=weight, scale=None if first else _delayed_scale(history, fp8))
    with torch.no_grad():
        if first:
            history.copy_(q.amax.reshape(1).expand_as(history))
        else:  # [amax, history[:-1]]: the newest first
            history.copy_(torch.cat([q.amax.reshape(1).float(), history[:-1]]))
    return q


class _Float8Matmul(torch.autograd.Function):
    """x2 (M, K) @ weight.T (+ bias) with float8 matmuls forward and backward; M a multiple of 16."""

    @staticmethod
    def forward(ctx, x2, weight, bias, config, histories, first):
        if isinstance(weight, Float8AllGatherWeight):  # not sharded: kernels take the wrapped tensor itself
            weight = weight._tensor
        if histories is not None:
            qx = _delayed_cast(x2, E4M3, config, histories[0], first)
            qw = _delayed_cast(weight, E4M3, config, histories[1], first, weight=True)
        else:
            qx = _cast(x2, E4M3, config)
            # a weight FSDP2 all-gathered in float8 comes with its scale
            gathered = isinstance(weight, Float8GatheredWeight)
            qw = weight.float8() if gathered else _cast(weight, E4M3, config, weight=True)
        y = scaled_mm(
            qx.data,
            qw.data.t(),
            qx.scale,
            _scale_t(qw.scale),
            bias=bias,
            out_dtype=x2.dtype,
            use_fast_accum=config.fast_accum_output,
        )
        hg = None if histories is None else histories[2]
        # Only what the backward reads stays alive: the 16-bit input only where it is cast again along M
        if config.recipe == "rowwise":  # the backward quantises along the other dims: keep the originals
            ctx.save_for_backward(x2, weight, hg)
        elif config.recipe == "tensorwise":  # reuses the forward's float8 data, transposed
            ctx.save_for_backward(qx.data, qx.scale, qw.data, qw.scale, hg)
        else:  # blockwise: the weight's float8 data for gx, the input cast again along M for gw
            ctx.save_for_backward(qw.data, qw.scale, x2)
        ctx.config, ctx.first, ctx.dtypes = (
            config,
            first,
            (x2.dtype, weight.dtype, None if bias is None else bias.dtype),
        )
        return y

    @staticmethod
    def backward(ctx, gy):
        config = ctx.config
        dtype, w_dtype, b_dtype = ctx.dtypes
        gy = gy.contiguous()
        saved = ctx.saved_tensors
        gfp8 = config.gradient
        if config.recipe == "rowwise":
            x2, weight, _ = saved
            qg = _cast(gy, gfp8, config)  # along N, for gx
            qwt = _cast(TRANSPOSE(weight), E4M3, config)  # w.T (K, N) along N
            gx = scaled_mm(qg.data, qwt.data.t(), qg.scale, qwt.scale.t(), out_dtype=dtype)
            gw = _weight_grad_along_m(gy, x2, gfp8, config, dtype)
        elif config.recipe == "tensorwise":
            x_data, x_scale, w_data, w_scale, hg = saved
            qg = _cast(gy, gfp8, config) if hg is None else _delayed_cast(gy, gfp8, config, hg, ctx.first)
            gx = _input_grad(qg, w_data, w_scale, dtype)
            gw = scaled_mm(TRANSPOSE(qg.data), _column_major(x_data), qg.scale, x_scale, out_dtype=dtype)
        else:  # blockwise
            w_data, w_scale, x2 = saved
            qg = _cast(gy, gfp8, config)  # 1 x 128 along N
            # b = w (N, K) column-major, contracted over N: w's (N/128, K/128) scale is (K-blocks, N-blocks) of b
            gx = _input_grad(qg, w_data, w_scale, dtype)
            gw = _weight_grad_along_m(gy, x2, gfp8, config, dtype)
        gb = None if b_dtype is None else gy.sum(0, dtype=torch.float32).to(b_dtype)
        return gx, gw.to(w_dtype), gb, None, None, None


def _input_grad(qg, w_data, w_scale, dtype):
    """gy @ w from the forward's float8 weight (tensorwise and blockwise reuse it)."""
    return scaled_mm(qg.data, _column_major(w_data), qg.scale, w_scale, out_dtype=dtype)


def _weight_grad_along_m(gy, x2, gfp8, config, dtype):
    """gy.T @ x with gy.T (N, M) and x.T (K, M) cast again along M (rowwise: per row; blockwise: 1 x 128)."""
    qgt = _cast(TRANSPOSE(gy), gfp8, config)
    qxt = _cast(TRANSPOSE(x2), E4M3, config)
    return scaled_mm(qgt.data, qxt.data.t(), qgt.scale, qxt.scale.t(), out_dtype=dtype)


def _all_gather_weight(weight: nn.Parameter, config: Float8Config) -> nn.Parameter:
    if isinstance(weight, Float8AllGatherWeight):
        return weight
    return nn.Parameter(Float8AllGatherWeight(weight.data, config.pow2), requires_grad=weight.requires_grad)


def check_input(layer: str, x, in_features: int) -> None:
    """A linear's input: a float16 / bfloat16 / float32 tensor whose last dim is in_features."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{layer}: input must be a float16, bfloat16 or float32 tensor, got {got}")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"{layer}: input's last dim must be in_features = {in_features}, got shape {tuple(x.shape)}")


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls (forward and backward) run in float8 (see the module docstring). Parameters,
    their names and the state_dict are nn.Linear's: `Float8Linear.from_linear(lin)` shares lin's parameters,
    and state_dicts load both ways. With `fsdp_float8_all_gather` the weight is a new Parameter over the same
    data, a Float8AllGatherWeight (convert before building the optimizer)."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, config=None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.config = config or Float8Config()
        if in_features % 16 or out_features % 16:
            raise ValueError(
                f"Float8Linear: in_features and out_features must be multiples of 16, got {in_features}, {out_features}"
            )
        if self.config.scaling == "delayed":
            n = self.config.history_len
            for name in ("amax_history_x", "amax_history_w", "amax_history_grad"):
                self.register_buffer(name, torch.zeros(n, device=device), persistent=False)
        self._history_filled = False
        if self.config.fsdp_float8_all_gather:
            self.weight = _all_gather_weight(self.weight, self.config)
            self._register_state_dict_hook(plain_weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, config=None) -> "Float8Linear":
        """A Float8Linear on linear's own parameters (no copy: optimisers and FSDP see the same tensors)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, config=config)
        new.weight = (
            _all_gather_weight(linear.weight, new.config) if new.config.fsdp_float8_all_gather else linear.weight
        )
        new.bias = linear.bias
        if new.config.scaling == "delayed":
            for name in ("amax_history_x", "amax_history_w", "amax_history_grad"):
                setattr(new, name, torch.zeros(new.config.history_len, device=linear.weight.device))
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input("Float8Linear", x, self.in_features)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        if m % 16:  # M is the weight gradient's contraction: float8 matmuls take multiples of 16
            x2 = F.pad(x2, (0, 0, 0, -m % 16))
        bias = self.bias
        if bias is not None and bias.dtype not in (torch.float32, x.dtype):
            bias = bias.float()
        histories, first = None, False
        if self.config.scaling == "delayed":
            histories = (self.amax_history_x, self.amax_history_w, self.amax_history_grad)
            first, self._history_filled = not self._history_filled, True
        y = _Float8Matmul.apply(x2, self.weight, bias, self.config, histories, first)
        if x2.shape[0] == m and x.dim() == 2:
            return y
        # Unpadded and reshaped as torch.matmul does (_unsafe_view): not a view, as nn.Linear's output is not, so
        # an in-place op on it keeps FSDP2's pre-backward hook (FSDP2 warns of a view output for that reason).
        return torch.ops.aten._unsafe_view(y[:m], (*lead, self.out_features))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.config.recipe}, scaling={self.config.scaling}"


def convert_to_float8_training(
    model: nn.Module,
    *,
    module_filter_fn=None,
    recipe: str | None = None,
    config: Float8Config | None = None,
    verbose: bool = False,
) -> nn.Module:
    """Swap model's nn.Linear layers for Float8Linear in place (sharing their parameters) and return model.

    `module_filter_fn(module, fqn) -> bool` picks layers (all by default; "auto": those measured faster in
    float8 on their GPU, see kp_precision.auto_filter); `recipe` is a shortcut for `Float8Config(recipe=...)`,
    `config` the whole setting. Layers whose in_features or out_features is not a multiple of 16 stay nn.Linear
    (one warning names them); `verbose=True` prints each converted layer."""
    if recipe is not None and config is not None:
        raise ValueError("convert_to_float8_training: give recipe or config, not both")
    config = config or Float8Config(recipe=recipe or "tensorwise")
    if isinstance(module_filter_fn, str):
        if module_filter_fn != "auto":
            raise ValueError(
                f"convert_to_float8_training: module_filter_fn must be a callable, None or 'auto', "
                f"got {module_filter_fn!r}"
            )
        module_filter_fn = auto_filter(config)
    make = lambda linear: Float8Linear.from_linear(linear, config=config)  # noqa: E731
    label = f"{config.recipe}, {config.scaling}"
    return swap_linears(model, "convert_to_float8_training", module_filter_fn, make, verbose, label)
