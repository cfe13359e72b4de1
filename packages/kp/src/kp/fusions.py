"""Fusions across packages, applied by kp.optimize after the per-layer choices.

A kp norm (kp_norms.RMSNorm / LayerNorm) whose output is read only by float8 layers of one recipe (Float8Linear
tensorwise or rowwise with dynamic scaling, or Float8InferenceLinear) casts its output to float8 in its own kernel
(kp_norms.norm_float8) and hands the copy to those layers (kp_precision.attach_float8): in a transformer block the
attention's q, k and v projections (and the MLP's gate and up) then share one cast made without reading the norm's
output back, where each layer would cast it again. Likewise a kp_norms.GatedMLP whose down projection is such a
float8 layer makes the float8 copy of its gated activation with it (kp_norms.glu_float8). Neither package can do
this alone: the kernel making an activation does not know who reads it, the layers do not know where their input
came from.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import kp_norms
import kp_precision
from kp.sites import run_hooked
from kp_precision.float8 import GRANULARITIES, attached_float8
from kp_precision.shared import cast

NORMS = (kp_norms.RMSNorm, kp_norms.LayerNorm)
_BLOCKS = {name: block for block, name in GRANULARITIES.items()}  # "tensorwise" -> (0, 0), "rowwise" -> (1, 0)


def _attach(out, granularity: str, power_of_2: bool, uses: int | None) -> torch.Tensor:
    """out.output (a kp_norms NormFloat8 / GLUFloat8) with its float8 copy attached for the layers that read it."""
    copy = kp_precision.Float8Tensor(out.data, out.scale, out.amax, _BLOCKS[granularity])
    return kp_precision.attach_float8(out.output, copy, power_of_2=power_of_2, uses=uses)


class Float8Norm(nn.Module):
    """A kp norm whose output also comes cast to float8 (`granularity`, `power_of_2`), attached to the output for
    the float8 layers that read it (`readers` of them: the copy is released after that many took it; None: kept
    while the output lives). It holds the norm's own parameters under the same names (the state_dict is the
    norm's) and returns the norm's output bit for bit."""

    def __init__(self, norm: nn.Module, granularity: str, power_of_2: bool, readers: int | None = None):
        super().__init__()
        if not isinstance(norm, NORMS) or len(norm.normalized_shape) != 1:
            raise TypeError(f"kp.Float8Norm: norm must be a kp_norms RMSNorm or LayerNorm over one dim, got {norm!r}")
        if granularity not in _BLOCKS:
            raise ValueError(f"kp.Float8Norm: granularity must be 'tensorwise' or 'rowwise', got {granularity!r}")
        self.rms = isinstance(norm, kp_norms.RMSNorm)
        self.weight = norm.weight
        self.bias = None if self.rms else norm.bias
        self.eps, self.normalized_shape = norm.eps, norm.normalized_shape
        self.offset, self.casting = (norm.offset, norm.casting) if self.rms else (0.0, "torch")
        self.granularity, self.power_of_2, self.readers = granularity, bool(power_of_2), readers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # Under torch.compile the readers cast for themselves (an attached copy is eager only): the plain
            # norm, the same output bit for bit, without a float8 copy nobody takes.
            return (kp_norms.RMSNorm if self.rms else kp_norms.LayerNorm).forward(self, x)
        kind = dict(kind="rms", offset=self.offset, casting=self.casting) if self.rms else dict(kind="layer")
        cast = dict(granularity=self.granularity, power_of_2=self.power_of_2)
        out = kp_norms.norm_float8(x, self.weight, self.bias, self.eps, **kind, **cast)
        return _attach(out, self.granularity, self.power_of_2, self.readers)

    def extra_repr(self) -> str:
        norm = "RMSNorm" if self.rms else "LayerNorm"
        return f"{norm}{self.normalized_shape}, eps={self.eps}, float8 {self.granularity}, power_of_2={self.power_of_2}"


class Float8GatedMLP(nn.Module):
    """A kp_norms.GatedMLP whose gated activation also comes cast to float8 (kp_norms.glu_float8), attached for
    its down projection. The same projections under the same names (the state_dict is the MLP's); the output is
    the MLP's own, bit for bit."""

    def __init__(self, mlp: nn.Module, granularity: str, power_of_2: bool):
        super().__init__()
        if not isinstance(mlp, kp_norms.GatedMLP):
            raise TypeError(f"kp.Float8GatedMLP: mlp must be a kp_norms.GatedMLP, got {type(mlp).__name__}")
        if granularity not in _BLOCKS:
            raise ValueError(f"kp.Float8GatedMLP: granularity must be 'tensorwise' or 'rowwise', got {granularity!r}")
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.activation, self.granularity, self.power_of_2 = mlp.activation, granularity, bool(power_of_2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the down projection casts for itself there: the plain gated MLP
            return kp_norms.GatedMLP.forward(self, x)
        cast = dict(granularity=self.granularity, power_of_2=self.power_of_2)
        out = kp_norms.glu_float8(self.gate_proj(x), self.up_proj(x), self.activation, **cast)
        return self.down_proj(_attach(out, self.granularity, self.power_of_2, uses=1))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, float8 {self.granularity}, power_of_2={self.power_of_2}"


def recipe_of(layer: nn.Module) -> tuple[str, bool] | None:
    """(granularity, power_of_2) of the cast a float8 layer makes of its input, when an attached copy can stand
    for it (dynamic scaling; tensorwise or rowwise); else None."""
    if isinstance(layer, kp_precision.Float8Linear):
        config = layer.config
        if config.scaling != "dynamic" or config.recipe not in _BLOCKS:
            return None
        return config.recipe, bool(config.pow2)
    if isinstance(layer, kp_precision.Float8InferenceLinear) and layer.recipe in _BLOCKS:
        return layer.recipe, False
    return None


@dataclasses.dataclass
class Fusable:
    """A kp norm of the model and the float8 layers that read its output on the example batch, or a kp gated MLP
    and its float8 down projection."""

    name: str  # the module's qualified name
    module: nn.Module
    readers: list[str]
    granularity: str
    power_of_2: bool

    def fused(self) -> nn.Module:
        if isinstance(self.module, kp_norms.GatedMLP):
            return Float8GatedMLP(self.module, self.granularity, self.power_of_2)
        # the copy is dropped once every reader took it (not kept with the output until the backward)
        return Float8Norm(self.module, self.granularity, self.power_of_2, len(self.readers))


def fusable(model: nn.Module, example_inputs: tuple) -> list[Fusable]:
    """The kp gated MLPs whose down projection is a float8 layer an attached copy can serve, then (from one run of
    the model without gradients) the kp norms whose output only float8 layers of one recipe read (matched by tensor
    identity: a layer reads the very tensor the norm returned; modules with children are taken to pass it on)."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, kp_norms.GatedMLP) and recipe_of(module.down_proj) is not None:
            found.append(Fusable(name, module, [f"{name}.down_proj"], *recipe_of(module.down_proj)))
    outputs: dict[str, torch.Tensor] = {}
    read: dict[str, list[tuple[str, nn.Module]]] = {}
    hooks = []

    def norm_hook(name):
        def hook(module, args, output):
            outputs.setdefault(name, output)  # kept alive for the run, so identities stay unique

        return hook

    def reader_hook(name):
        def hook(module, args, kwargs):
            for norm, out in outputs.items():
                if any(a is out for a in (*args, *kwargs.values())):
                    read.setdefault(norm, []).append((name, module))

        return hook

    norms = {n: m for n, m in model.named_modules() if isinstance(m, NORMS) and len(m.normalized_shape) == 1}
    for name, module in model.named_modules():
        if name in norms:
            hooks.append(module.register_forward_hook(norm_hook(name)))
        elif name and not any(True for _ in module.children()):  # a container passes its input on to its layers
            hooks.append(module.register_forward_pre_hook(reader_hook(name), with_kwargs=True))
    run_hooked(model, example_inputs, hooks)
    for name, layers in read.items():
        recipes = {recipe_of(m) for _, m in layers}
        if len(recipes) == 1 and None not in recipes:
            granularity, pow2 = recipes.pop()
            found.append(Fusable(name, norms[name], [n for n, _ in layers], granularity, pow2))
    return found


def check(f: Fusable, x: torch.Tensor) -> str | None:
    """None when the fused module gives the module's own output bit for bit on x (its input on the example batch)
    and, for a norm, attaches the cast its readers would make, bit for bit; else why not."""
    fused = f.fused()
    with torch.no_grad():
        y = f.module(x)
        got = fused(x)
    if not torch.equal(got, y):
        return "the fused module's output differs from the module's"
    if isinstance(fused, Float8GatedMLP):  # the output is the down projection's: it read the attached copy
        return None
    pre = attached_float8(got, _BLOCKS[f.granularity], torch.float8_e4m3fn, f.power_of_2)
    if pre is None:
        return "no float8 copy was attached"
    want = kp_precision.quantize(y, granularity=f.granularity, power_of_2=f.power_of_2)
    same = torch.equal(pre.data.view(torch.uint8), want.data.reshape(pre.data.shape).view(torch.uint8))
    if not same or not torch.equal(pre.scale.reshape(-1), want.scale.reshape(-1)):
        return "the fused cast differs from the layers' own cast"
    return None


def unfused_run(f: Fusable, x: torch.Tensor):
    """The forward work a fusion replaces: a norm and each reader's cast of its output; an MLP as it is."""
    block = _BLOCKS[f.granularity]

    def run():
        with torch.no_grad():
            y = f.module(x)
            if isinstance(f.module, kp_norms.GatedMLP):
                return y
            y2 = y.reshape(-1, y.shape[-1])
            for _ in f.readers:  # as the layers cast (kp_precision.shared: no argument checks)
                cast(y2, torch.float8_e4m3fn, block, f.power_of_2)
            return y

    return run


def fused_run(fused: nn.Module, x: torch.Tensor):
    def run():
        with torch.no_grad():
            return fused(x)

    return run
