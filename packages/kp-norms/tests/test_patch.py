"""kp_norms.patch / unpatch on plain torch modules and tiny random Hugging Face models (no downloads).

Numbers follow the conformance rule: the patched model's logits and every parameter gradient are at most twice
as far from the float64 model as the unpatched model in the same dtype is (kp_conformance.check_close).
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import kp_core
import kp_norms
from kp_conformance.tolerance import check_close
from kp_norms.modules import GatedMLP
from kp_norms.patch import _activation

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = kp_core.INTERPRET if kp_core.interpreter_enabled() else kp_core.TRITON
NORM, GLU = "kp::norm", "kp::glu"
# Under the interpreter, fp32 -> bf16 casts truncate instead of rounding, so bf16 runs only on a GPU.
DTYPES = [
    torch.float32,
    torch.float64,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(DEVICE == "cpu", reason="bf16 under the Triton interpreter truncates; GPU only"),
    ),
]


def _perturb(model: nn.Module, seed: int = 1) -> nn.Module:
    """Norm weights and biases away from their 1 / 0 init, so a wrong offset or a dropped weight shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))
    return model


def _step(model: nn.Module, x: torch.Tensor, probe: torch.Tensor):
    """Output and every parameter's gradient of sum(out * probe): its gradient is `probe` in every dtype."""
    model.zero_grad(set_to_none=True)
    out = model(x) if x.is_floating_point() else model(input_ids=x).logits
    (out * probe.to(out.dtype)).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _module_step(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """(output, input gradient, parameter gradients) of one module for output gradient dy."""
    x = x.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(dy.to(out.dtype))
    return [out.detach(), x.grad, *(p.grad for p in module.parameters())]


def _check_against(name, patched, lowp, ref64, x, out_shape, dtype):
    """Every module kp swapped in `patched` meets the conformance rule where it sits in the model: its output, its
    input gradient and its parameters' gradients, on the activations and output gradients the float64 model
    `ref64` gives that module, against the float64 module and against the module it replaced (from `lowp`)
    run in `dtype`. Returns the launch record of one full step of the patched model.

    Why module by module: a whole model's max error is a noisy statistic of how rounding errors happen to
    propagate. PyTorch's own norms computed in float64 and rounded once (more accurate than Hugging Face's fp32
    modules) fail the rule applied to a whole fp32 model's gradients on some seeds (up to 1.25x the bound over 8
    seeds of Qwen3 and Gemma3), so that check measured luck, not accuracy. In place, each module is judged on its
    own rounding; a wrong variant (offset, casting, activation, eps) misses by orders of magnitude. Attention
    uses SDPA's math backend (deterministic) so runs are reproducible."""
    swapped = [n for n, m in patched.named_modules() if type(m).__module__.startswith("kp_norms")]
    assert swapped, f"{name}: nothing was patched"
    x64 = x.to(torch.float64) if x.is_floating_point() else x
    probe = torch.randn(out_shape, device=DEVICE).to(dtype)
    inputs, grads, hooks = {}, {}, []
    for n in swapped:
        m = ref64.get_submodule(n)
        hooks.append(m.register_forward_hook(lambda mod, a, out, n=n: inputs.__setitem__(n, a[0].detach())))
        hooks.append(m.register_full_backward_hook(lambda mod, gi, go, n=n: grads.__setitem__(n, go[0].detach())))
    with sdpa_kernel(SDPBackend.MATH):
        _step(ref64, x64, probe)
        for h in hooks:
            h.remove()
        with kp_core.record_launches() as rec:
            _step(patched, x, probe)
    for n in swapped:
        x64_n, dy64 = inputs[n], grads[n]
        ours = _module_step(patched.get_submodule(n), x64_n.to(dtype), dy64.to(dtype))
        theirs = _module_step(lowp.get_submodule(n), x64_n.to(dtype), dy64.to(dtype))
        ref = _module_step(ref64.get_submodule(n), x64_n, dy64)
        labels = ["output", "input grad", *(f"grad {p}" for p, _ in patched.get_submodule(n).named_parameters())]
        assert len(ours) == len(theirs) == len(ref) == len(labels)
        for label, a, lo, r in zip(labels, ours, theirs, ref):
            check_close(f"{name} {n} {label}", a, r, lo, dtype)
    return rec


# ---- plain torch modules (no transformers needed) ----


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(24, eps=1e-6)
        self.lin = nn.Linear(24, 24)
        self.ln = nn.LayerNorm(24)
        self.inner = nn.Sequential(nn.RMSNorm((3, 8)), nn.LayerNorm(24, bias=False), nn.RMSNorm(24, None, False))
        self.no_affine = nn.LayerNorm(24, elementwise_affine=False)

    def forward(self, x):
        h = self.ln(self.lin(self.norm(x)))
        h = self.inner[0](h.unflatten(-1, (3, 8))).flatten(-2)
        return self.no_affine(self.inner[2](self.inner[1](h)))


NET_NAMES = ["norm", "ln", "inner.0", "inner.1", "inner.2", "no_affine"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_modules_match_and_run_the_kernels(dtype):
    torch.manual_seed(0)
    lowp = _perturb(Net()).to(DEVICE, dtype)
    ref64 = copy.deepcopy(lowp).to(torch.float64)
    patched = copy.deepcopy(lowp)
    assert kp_norms.patch(patched) == NET_NAMES
    x = torch.randn(5, 7, 24, device=DEVICE, dtype=dtype)
    rec = _check_against("Net", patched, lowp, ref64, x, x.shape, dtype)
    assert rec.backends(NORM) == {KERNEL} and rec.count(op=NORM) == 6


def test_torch_modules_swap_in_place_share_parameters_and_unpatch():
    model = _perturb(Net())
    keys, params = model.state_dict().keys(), list(model.parameters())
    originals = dict(model.named_modules())

    assert kp_norms.patch(model) == NET_NAMES
    assert type(model.norm) is kp_norms.RMSNorm and model.norm.casting == "torch" and model.norm.eps == 1e-6
    assert type(model.ln) is kp_norms.LayerNorm and type(model.no_affine) is kp_norms.LayerNorm
    assert model.inner[1].bias is None and model.no_affine.weight is None and model.inner[2].weight is None
    assert model.inner[0].normalized_shape == (3, 8)
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))  # optimizer state stays valid
    assert model.state_dict().keys() == keys
    assert kp_norms.patch(model) == []  # idempotent: never wraps a kp module

    fresh = Net()
    fresh.load_state_dict(model.state_dict())  # patched -> plain
    model.load_state_dict(_perturb(Net(), seed=2).state_dict())  # plain -> patched (copies into the shared params)

    assert kp_norms.unpatch(model) == NET_NAMES
    assert all(m is originals[n] for n, m in model.named_modules())
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert kp_norms.unpatch(model) == []


def test_flags_and_filter_choose_what_is_patched():
    assert kp_norms.patch(Net(), layer_norm=False) == ["norm", "inner.0", "inner.2"]
    assert kp_norms.patch(Net(), rms_norm=False) == ["ln", "inner.1", "no_affine"]
    assert kp_norms.patch(Net(), rms_norm=False, layer_norm=False) == []
    only_inner = kp_norms.patch(Net(), module_filter_fn=lambda m, name: name.startswith("inner."))
    assert only_inner == ["inner.0", "inner.1", "inner.2"]


def test_a_shared_module_becomes_one_kp_module_at_every_name():
    norm = nn.RMSNorm(8)
    model = nn.Sequential(norm, nn.Linear(8, 8), norm)
    assert kp_norms.patch(model) == ["0", "2"]
    assert model[0] is model[2] and type(model[0]) is kp_norms.RMSNorm
    assert kp_norms.unpatch(model) == ["0", "2"]
    assert model[0] is norm and model[2] is norm


def test_the_root_module_and_subclasses_are_left_alone():
    class MyNorm(nn.RMSNorm):  # may compute something else
        pass

    root = nn.RMSNorm(8)
    assert kp_norms.patch(root) == [] and kp_norms.patch(nn.Sequential(MyNorm(8))) == []


def test_patch_rejects_a_non_module():
    with pytest.raises(TypeError, match=r"kp_norms.patch: model must be a torch.nn.Module, got str"):
        kp_norms.patch("not a model")
    with pytest.raises(TypeError, match=r"kp_norms.unpatch: model must be a torch.nn.Module, got dict"):
        kp_norms.unpatch({})


class LlamaStyleMLP(nn.Module):
    def __init__(self, dim, hidden, act_fn):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down_proj, self.act_fn = nn.Linear(hidden, dim, bias=False), act_fn

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_your_own_mlp_class_is_swapped_when_named(dtype):
    torch.manual_seed(0)
    lowp = nn.Sequential(nn.RMSNorm(16), LlamaStyleMLP(16, 40, nn.SiLU()), LlamaStyleMLP(16, 24, nn.GELU())).to(
        DEVICE, dtype
    )
    assert kp_norms.patch(copy.deepcopy(lowp)) == ["0"]  # not known unless named
    patched = copy.deepcopy(lowp)
    assert kp_norms.patch(patched, mlp_classes=[LlamaStyleMLP]) == ["0", "1", "2"]
    assert [patched[1].activation, patched[2].activation] == ["silu", "gelu"]
    x = torch.randn(3, 5, 16, device=DEVICE, dtype=dtype)
    rec = _check_against("MLPs", patched, lowp, copy.deepcopy(lowp).to(torch.float64), x, x.shape, dtype)
    assert rec.backends(GLU) == {KERNEL} and rec.count(op=GLU) == 2
    assert kp_norms.unpatch(patched) == ["0", "1", "2"] and type(patched[2]) is LlamaStyleMLP
    with pytest.raises(TypeError, match="mlp_classes must hold nn.Module subclasses, got 'MLP'"):
        kp_norms.patch(lowp, mlp_classes=["MLP"])


def test_activation_is_identified_by_what_it_computes():
    assert _activation(nn.SiLU()) == "silu" and _activation(F.silu) == "silu"
    assert _activation(nn.GELU()) == "gelu" and _activation(nn.GELU(approximate="tanh")) == "gelu_tanh"
    assert _activation(lambda t: 0.5 * t * (1 + torch.tanh(0.7978845608028654 * (t + 0.044715 * t**3)))) == "gelu_tanh"
    assert _activation(lambda t: t * torch.sigmoid(1.702 * t)) is None  # "quick gelu"
    assert _activation(nn.ReLU()) is None and _activation(nn.PReLU()) is None and _activation(None) is None


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_gated_mlp_module(activation):
    torch.manual_seed(0)
    m = GatedMLP(16, 40, activation, bias=True, device=DEVICE)
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    x = torch.randn(3, 5, 16, device=DEVICE)
    with kp_core.record_launches() as rec:
        y = m(x)
    assert rec.backends(GLU) == {KERNEL}
    torch.testing.assert_close(y, m.down_proj(act(m.gate_proj(x)) * m.up_proj(x)))
    assert list(m.state_dict()) == [
        f"{p}.{t}" for p in ("gate_proj", "up_proj", "down_proj") for t in ("weight", "bias")
    ]
    with pytest.raises(ValueError, match="activation must be"):
        GatedMLP(4, 8, "relu")


# ---- Hugging Face transformers: tiny random configs ----

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=64,
    initializer_range=0.05,
)
# family -> (config class, model class, config overrides, kp variant of its norms, activation of its MLP)
LLAMA, GEMMA = {"casting": "llama", "offset": 0.0}, {"casting": "torch", "offset": 1.0}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, LLAMA, "silu"),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, LLAMA, "silu"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, LLAMA, "silu"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}, LLAMA, "silu"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}, GEMMA, "gelu_tanh"),
    # Gemma2 has no SDPA path; its eager attention takes the softmax in fp32, even in the float64 reference.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"attn_implementation": "eager"}, GEMMA, "gelu_tanh"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}, GEMMA, "gelu_tanh"),
}


def _hf_model(family: str, **overrides) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config_cls, model_cls, extra, _, _ = FAMILIES[family]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    # SDPA computes in the model's dtype (eager attention's softmax is fp32 even in a float64 model).
    config = getattr(transformers, config_cls)(**{"attn_implementation": "sdpa", **TINY, **extra, **overrides})
    torch.manual_seed(0)
    return _perturb(getattr(transformers, model_cls)(config)).eval()


class _RMSNorm64(nn.Module):
    """The float64 reference for a transformers RMSNorm, from the maths: x * rsqrt(mean(x^2) + eps) * (offset + w)
    in the input's dtype. (Those modules normalise in fp32 even in a float64 model: `hidden_states.to(float32)`.)"""

    def __init__(self, weight: nn.Parameter, eps: float, offset: float):
        super().__init__()
        self.weight, self.eps, self.offset = weight, eps, offset

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (self.offset + self.weight)


def _hf_float64(family: str, model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model).to(torch.float64)
    offset = FAMILIES[family][3]["offset"]
    for name, m in list(ref.named_modules()):
        if type(m).__name__.endswith("RMSNorm"):
            parent, _, child = name.rpartition(".")
            eps = getattr(m, "variance_epsilon", getattr(m, "eps", None))
            setattr(ref.get_submodule(parent), child, _RMSNorm64(m.weight, eps, offset))
    return ref


def _expected(model: nn.Module) -> list[str]:
    """Names of the modules a reader would expect swapped: every *RMSNorm and *MLP, in module order."""
    return [n for n, m in model.named_modules() if type(m).__name__.endswith(("RMSNorm", "MLP"))]


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_patch_swaps_the_norms_and_mlps_and_unpatch_restores(family):
    model = _hf_model(family)
    _, _, _, variant, activation = FAMILIES[family]
    expected, keys, params = _expected(model), model.state_dict().keys(), list(model.parameters())
    originals = dict(model.named_modules())
    norm, mlp = model.model.norm, model.model.layers[0].mlp

    changed = kp_norms.patch(model)
    assert changed == expected and "model.norm" in changed and "model.layers.1.mlp" in changed
    new_norm, new_mlp = model.model.norm, model.model.layers[0].mlp
    assert type(new_norm) is kp_norms.RMSNorm and new_norm.weight is norm.weight
    assert (new_norm.casting, new_norm.offset) == (variant["casting"], variant["offset"])
    assert new_norm.eps == getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    assert type(new_mlp) is GatedMLP and new_mlp.activation == activation and new_mlp.gate_proj is mlp.gate_proj
    assert model.state_dict().keys() == keys
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert kp_norms.patch(model) == []

    fresh = _hf_model(family)
    fresh.load_state_dict(model.state_dict())
    model.load_state_dict(fresh.state_dict())

    assert kp_norms.unpatch(model) == expected
    assert model.model.norm is norm and model.model.layers[0].mlp is mlp
    assert all(m is originals[n] for n, m in model.named_modules())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_patched_logits_and_gradients_match(family, dtype):
    lowp = _hf_model(family).to(DEVICE, dtype)
    ref64 = _hf_float64(family, lowp)
    patched = copy.deepcopy(lowp)
    changed = kp_norms.patch(patched)
    ids = torch.randint(0, TINY["vocab_size"], (2, 9), device=DEVICE)
    rec = _check_against(family, patched, lowp, ref64, ids, (*ids.shape, TINY["vocab_size"]), dtype)
    n_norms = sum(not n.endswith("mlp") for n in changed)
    assert rec.backends(NORM) == {KERNEL} and rec.count(op=NORM) == n_norms
    assert rec.backends(GLU) == {KERNEL} and rec.count(op=GLU) == TINY["num_hidden_layers"]
    assert rec.backends() == {KERNEL}  # backward too, and nothing fell back to the reference path


def test_hf_unknown_activation_is_left_alone_with_a_warning():
    model = _hf_model("llama", hidden_act="relu")
    with pytest.warns(
        UserWarning, match=r"left 2 gated MLPs .* not one of silu, gelu, gelu_tanh: model.layers.0.mlp \(Ll"
    ):
        changed = kp_norms.patch(model)
    assert changed == [n for n in _expected(model) if not n.endswith("mlp")]
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_hf_exact_gelu_becomes_geglu_and_swiglu_false_keeps_the_mlps():
    model = _hf_model("llama", hidden_act="gelu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "model.layers.0.mlp" not in kp_norms.patch(model, swiglu=False)
        assert kp_norms.patch(model) == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert model.model.layers[1].mlp.activation == "gelu"
