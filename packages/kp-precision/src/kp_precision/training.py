"""Float8 training: Float8Linear (kp_precision.convert.convert_to_float8_training swaps a model's layers for it).

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

Each recipe is an object of kp_precision.recipes, chosen once when the layer is built from its Float8Config: it
casts, and says what the forward keeps for the backward and how the backward multiplies. Casts and matmuls call
the declared ops directly (kp_precision.shared): inside a step no argument is checked again as user input.

Delayed scaling (tensorwise only) keeps an amax history per tensor (x, w, gy): the scale is the history's
maximum / FP8_MAX, the cast is one pass, and the amax the cast returns is pushed into the history. The first
call fills the history from the current amaxes (dynamic scaling once). The histories and whether they are filled
(`amax_history_filled`) are buffers in the state_dict, so a resumed run scales as the uninterrupted one would; an
nn.Linear's state_dict still loads (strict) into a delayed Float8Linear, whose histories then start again, and a
delayed Float8Linear's state_dict loads into an nn.Linear without those four keys (or with strict=False).
Dynamic scaling keeps no state: its state_dict is an nn.Linear's.

An input with a float8 copy attached (kp_precision.attach_float8: a norm that cast its output in its own kernel)
is not cast again when the copy is this recipe's cast (dynamic scaling, rows a multiple of 16).

Rows of x are padded to a multiple of 16 (shared.ALIGN) only where the float8 matmul needs it (M is the
contraction of the weight gradient); in_features and out_features must be multiples of 16
(convert_to_float8_training skips the layers that are not, and says which).
"""

import torch
import torch.nn.functional as F
from torch import nn

from kp_precision.fsdp import Float8AllGatherWeight, high_precision, plain_weight
from kp_precision.recipes import Float8Config, recipe_for
from kp_precision.shared import ALIGN, autocast_dtype, check_aligned, check_input, check_weight, matmul, scale_t

HISTORIES = ("amax_history_x", "amax_history_w", "amax_history_grad")  # delayed scaling: x, w, gy


class _Float8Matmul(torch.autograd.Function):
    """x2 (M, K) @ weight.T (+ bias) with float8 matmuls forward and backward, as `recipe` casts (M a multiple of
    ALIGN); the histories are delayed scaling's (x, w, gy), or None."""

    @staticmethod
    def forward(ctx, x2, weight, bias, recipe, histories, first, pre):
        weight = high_precision(weight)
        qx, qw = recipe.operands(x2, weight, histories, first, pre)
        y = matmul(qx.data, qw.data.t(), qx.scale, scale_t(qw.scale), x2.dtype, bias=bias, fast_accum=recipe.fast_accum)
        # Only what the backward reads stays alive (the recipe says what: the 16-bit input only where it is cast
        # again along M)
        ctx.save_for_backward(*recipe.keep(x2, weight, qx, qw, None if histories is None else histories[2]))
        ctx.recipe, ctx.first, ctx.dtypes = (
            recipe,
            first,
            (x2.dtype, weight.dtype, None if bias is None else bias.dtype),
        )
        return y

    @staticmethod
    def backward(ctx, gy):
        dtype, w_dtype, b_dtype = ctx.dtypes
        gy = gy.contiguous()
        gx, gw = ctx.recipe.backward(gy, ctx.saved_tensors, ctx.first, dtype)
        gb = None if b_dtype is None else gy.sum(0, dtype=torch.float32).to(b_dtype)
        return gx, gw.to(w_dtype), gb, None, None, None, None


def _all_gather_weight(weight: nn.Parameter, config: Float8Config) -> nn.Parameter:
    if isinstance(weight, Float8AllGatherWeight):
        return weight
    return nn.Parameter(Float8AllGatherWeight(weight.data, config.pow2), requires_grad=weight.requires_grad)


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls (forward and backward) run in float8 (see the module docstring). Parameters,
    their names and the state_dict are nn.Linear's: `Float8Linear.from_linear(lin)` shares lin's parameters,
    and state_dicts load both ways. With `fsdp_float8_all_gather` the weight is a new Parameter over the same
    data, a Float8AllGatherWeight (convert before building the optimizer). The config is read when the layer is
    built (its recipe object, its delayed scaling's buffers).

    Args:
        in_features: a multiple of 16.
        out_features: a multiple of 16.
        bias: as nn.Linear's.
        device: as nn.Linear's.
        dtype: the parameters' dtype (float16, bfloat16 or float32).
        config: a Float8Config (the default: tensorwise, dynamic scaling).

    The forward takes (*, in_features) in float16, bfloat16 or float32 and returns (*, out_features) in its
    dtype (under autocast, the autocast dtype).

    Examples:
        >>> import torch
        >>> import kp_precision
        >>> layer = kp_precision.Float8Linear(64, 32, config=kp_precision.Float8Config(recipe="rowwise"))
        >>> x = torch.randn(10, 64, requires_grad=True)
        >>> layer(x).sum().backward()  # three float8 matmuls: forward, grad input, grad weight
        >>> x.grad.shape, layer.weight.grad.shape
        (torch.Size([10, 64]), torch.Size([32, 64]))
        >>> shared = kp_precision.Float8Linear.from_linear(linear := torch.nn.Linear(64, 32))
        >>> shared.weight is linear.weight
        True
    """

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, *, config=None):
        if config is not None and not isinstance(config, Float8Config):
            raise TypeError(f"Float8Linear: config must be a kp_precision.Float8Config or None, got {config!r}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.config = config or Float8Config()
        check_aligned("Float8Linear", in_features, out_features)
        self._recipe = recipe_for(self.config)
        if self.config.scaling == "delayed":
            n = self.config.history_len
            for name in HISTORIES:
                self.register_buffer(name, torch.zeros(n, device=device))
            self.register_buffer("amax_history_filled", torch.zeros((), dtype=torch.bool, device=device))
        self._history_filled = False  # amax_history_filled's value, kept on the host (no read in forward)
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
            for name in HISTORIES:
                setattr(new, name, torch.zeros(new.config.history_len, device=linear.weight.device))
            new.amax_history_filled = torch.zeros((), dtype=torch.bool, device=linear.weight.device)
        return new

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)
        if self.config.scaling != "delayed":
            return
        keys = [prefix + name for name in (*HISTORIES, "amax_history_filled")]
        if all(k in state_dict for k in keys):
            self._history_filled = bool(self.amax_history_filled)  # one read, at load time
            return
        # An nn.Linear's (or a dynamic layer's) state_dict: no scaling state, so the histories start again.
        missing[:] = [k for k in missing if k not in keys]
        self._history_filled = False
        self.amax_history_filled.fill_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_input("Float8Linear", x, self.in_features)
        x = x if (cast := autocast_dtype(x)) is None else x.to(cast)  # under autocast, as nn.Linear
        weight = self.weight
        check_weight("Float8Linear", weight)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        pre = None
        if m % ALIGN:  # M is the weight gradient's contraction: float8 matmuls take multiples of ALIGN
            x2 = F.pad(x2, (0, 0, 0, -m % ALIGN))
        elif self.config.scaling == "dynamic":
            pre = self._recipe.attached(x)
        bias = self.bias
        if bias is not None and bias.dtype not in (torch.float32, x.dtype):
            bias = bias.float()
        histories, first = None, False
        if self.config.scaling == "delayed":
            histories = (self.amax_history_x, self.amax_history_w, self.amax_history_grad)
            first = not self._history_filled
            if first:
                self._history_filled = True
                self.amax_history_filled.fill_(True)
        y = _Float8Matmul.apply(x2, weight, bias, self._recipe, histories, first, pre)
        if x2.shape[0] == m and x.dim() == 2:
            return y
        # Unpadded and reshaped as torch.matmul does (_unsafe_view): not a view, as nn.Linear's output is not, so
        # an in-place op on it keeps FSDP2's pre-backward hook (FSDP2 warns of a view output for that reason).
        return torch.ops.aten._unsafe_view(y[:m], (*lead, self.out_features))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.config.recipe}, scaling={self.config.scaling}"
