"""Float8Config and the three recipes it names, one object each, chosen once when a layer is built.

A recipe owns what differs between them (kp_precision.training's docstring has the table): how it casts an
activation, a weight and a gradient, what the forward's matmul keeps for the backward, and the backward's two
matmuls. Float8Linear (training) runs all three matmuls through its recipe; Float8InferenceLinear uses a recipe's
casts. Casts and matmuls go through kp_precision.shared (no argument checks inside a step).
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

import kp_core
from kp_precision.float8 import attached_float8
from kp_precision.fsdp import Float8GatheredWeight
from kp_precision.shared import E4M3, E5M2, cast, column_major, matmul, transpose

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
    only; see kp_precision.fsdp).

    Frozen; invalid combinations raise when it is made. `gradient` is the gradient's float8 dtype and `pow2`
    whether scales are powers of two, with the defaults resolved.

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> config = kp_precision.Float8Config(recipe="rowwise")
        >>> config.gradient, config.pow2
        (torch.float8_e4m3fn, True)
        >>> kp_precision.Float8Config(scaling="delayed", history_len=32).gradient
        torch.float8_e5m2
        >>> kp_precision.Float8Config(recipe="rowwise", scaling="delayed")
        Traceback (most recent call last):
            ...
        ValueError: Float8Config: delayed scaling is for the tensorwise recipe, got 'rowwise'
    """

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
        kp_core.check_bool("Float8Config", "fast_accum_output", self.fast_accum_output)
        kp_core.check_bool("Float8Config", "fsdp_float8_all_gather", self.fsdp_float8_all_gather)
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


class Recipe(ABC):
    """A recipe of `config`: x2 (M, K) @ weight.T in float8 forward and backward (M a multiple of 16)."""

    def __init__(self, config: Float8Config):
        self.config = config
        self.pow2 = bool(config.pow2)
        self.grad_dtype = config.gradient
        self.fast_accum = config.fast_accum_output

    @abstractmethod
    def cast(self, t: torch.Tensor, fp8: torch.dtype, *, weight: bool = False):
        """t (2-D) quantised along its last dim, as the recipe casts an activation or gradient (or a weight)."""

    block = (1, 128)  # how cast() cuts an activation

    def attached(self, x):
        """The float8 copy attached to the layer's input x (attach_float8) as (M, K) rows, when it was cast as
        this recipe casts an activation (dynamic scaling); else None."""
        return attached_float8(x, self.block, E4M3, self.pow2)

    def operands(self, x2, weight, histories, first, pre=None):
        """(qx, qw): the forward's float8 operands (histories: delayed scaling's, tensorwise only; pre: x2's
        attached float8 copy, or None)."""
        return pre or self.cast(x2, E4M3), self.cast(weight, E4M3, weight=True)

    @abstractmethod
    def keep(self, x2, weight, qx, qw, history_grad) -> tuple:
        """What the backward reads, for ctx.save_for_backward (only that stays alive)."""

    @abstractmethod
    def backward(self, gy, saved, first, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gx, gw) from the contiguous output gradient and keep()'s tensors."""

    def input_grad(self, qg, w_data, w_scale, dtype):
        """gy @ w from the forward's float8 weight (tensorwise and blockwise reuse it)."""
        return matmul(qg.data, column_major(w_data), qg.scale, w_scale, dtype)

    def weight_grad_along_m(self, gy, x2, dtype):
        """gy.T @ x with gy.T (N, M) and x.T (K, M) cast again along M (rowwise: per row; blockwise: 1 x 128)."""
        qgt = self.cast(transpose(gy), self.grad_dtype)
        qxt = self.cast(transpose(x2), E4M3)
        return matmul(qgt.data, qxt.data.t(), qgt.scale, qxt.scale.t(), dtype)


class Tensorwise(Recipe):
    """One scale per tensor; the float8 data of w and x is transposed for the backward, not cast again. Delayed
    scaling and the float8 all-gather's weight are this recipe's only."""

    block = (0, 0)

    def cast(self, t, fp8, *, weight=False, scale=None):
        return cast(t, fp8, (0, 0), self.pow2 and scale is None, scale)

    def delayed_cast(self, t, fp8, history, first):
        """The cast with the history's scale (max / FP8_MAX), then the amax pushed into the history (the newest
        first); on the first call a dynamic cast whose amax fills the whole history."""
        scale = None if first else history.amax().clamp(min=1e-12) / torch.finfo(fp8).max
        q = self.cast(t, fp8, scale=scale)
        with torch.no_grad():
            if first:
                history.copy_(q.amax.reshape(1).expand_as(history))
            else:
                history.copy_(torch.cat([q.amax.reshape(1).float(), history[:-1]]))
        return q

    def operands(self, x2, weight, histories, first, pre=None):
        if histories is not None:
            return self.delayed_cast(x2, E4M3, histories[0], first), self.delayed_cast(
                weight, E4M3, histories[1], first
            )
        qx = pre or self.cast(x2, E4M3)
        # a weight FSDP2 all-gathered in float8 comes with its scale
        return qx, weight.float8() if isinstance(weight, Float8GatheredWeight) else self.cast(weight, E4M3)

    def keep(self, x2, weight, qx, qw, history_grad):
        return qx.data, qx.scale, qw.data, qw.scale, history_grad

    def backward(self, gy, saved, first, dtype):
        x_data, x_scale, w_data, w_scale, hg = saved
        qg = self.cast(gy, self.grad_dtype) if hg is None else self.delayed_cast(gy, self.grad_dtype, hg, first)
        gx = self.input_grad(qg, w_data, w_scale, dtype)
        gw = matmul(transpose(qg.data), column_major(x_data), qg.scale, x_scale, dtype)
        return gx, gw


class Rowwise(Recipe):
    """One scale per row of the contraction; the backward casts w, x and gy again along their other dimension,
    so the forward keeps the 16-bit originals."""

    block = (1, 0)

    def cast(self, t, fp8, *, weight=False):
        return cast(t, fp8, (1, 0), self.pow2)

    def keep(self, x2, weight, qx, qw, history_grad):
        return x2, weight

    def backward(self, gy, saved, first, dtype):
        x2, weight = saved
        qg = self.cast(gy, self.grad_dtype)  # along N, for gx
        qwt = self.cast(transpose(weight), E4M3)  # w.T (K, N) along N
        gx = matmul(qg.data, qwt.data.t(), qg.scale, qwt.scale.t(), dtype)
        return gx, self.weight_grad_along_m(gy, x2, dtype)


class Blockwise(Recipe):
    """1 x 128 blocks of x and gy, 128 x 128 of w: w's float8 data is transposed for the backward (square blocks
    are symmetric), x and gy are cast again along M, so the forward keeps the 16-bit input."""

    def cast(self, t, fp8, *, weight=False):
        return cast(t, fp8, (128, 128) if weight else (1, 128), self.pow2)

    def keep(self, x2, weight, qx, qw, history_grad):
        return qw.data, qw.scale, x2

    def backward(self, gy, saved, first, dtype):
        w_data, w_scale, x2 = saved
        qg = self.cast(gy, self.grad_dtype)  # 1 x 128 along N
        # b = w (N, K) column-major, contracted over N: w's (N/128, K/128) scale is (K-blocks, N-blocks) of b
        gx = self.input_grad(qg, w_data, w_scale, dtype)
        return gx, self.weight_grad_along_m(gy, x2, dtype)


_KINDS = {"tensorwise": Tensorwise, "rowwise": Rowwise, "blockwise": Blockwise}


def recipe_for(config: Float8Config) -> Recipe:
    """The recipe object of config (one per layer, made when the layer is built)."""
    return _KINDS[config.recipe](config)
