"""Small models for kp.optimize's tests: a pre-norm residual block of torch.nn layers kp has candidates for."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 128, dtype=torch.float32, device="cpu"):
        super().__init__()
        f = {"dtype": dtype, "device": device}
        self.norm = nn.RMSNorm(dim, **f)
        self.up = nn.Linear(dim, hidden, **f)
        self.down = nn.Linear(hidden, dim, **f)
        self.out_norm = nn.LayerNorm(dim, **f)

    def forward(self, x):
        return self.out_norm(x + self.down(torch.relu(self.up(self.norm(x)))))


def block(device: str, seed: int = 0, dtype=torch.float32) -> tuple[Block, torch.Tensor]:
    torch.manual_seed(seed)
    return Block(dtype=dtype, device=device), torch.randn(2, 8, 64, device=device, dtype=dtype)


class FixedTimer:
    """kp.optimize's timer hook with set numbers: ms per (layer, candidate), "*" for any layer; the whole step
    "(whole step)" by label (unset: torch's 2.0, kp's 1.0, fast enough to keep). Every timed fn still runs once
    (it must work)."""

    def __init__(self, layers: dict, step: dict | None = None):
        self.layers, self.step, self.calls = layers, step or {"torch": 2.0, "kp": 1.0}, []

    def __call__(self, layer, candidate, fn):
        fn()
        self.calls.append((layer, candidate))
        if layer == "(whole step)":
            return self.step.get(candidate, self.step.get("kp", 1.0))
        return self.layers.get((layer, candidate), self.layers.get(("*", candidate), 1.0))


class FanOut(nn.Module):
    """A norm whose output three linears read (as an attention block's q, k and v projections)."""

    def __init__(self, dim: int = 64, dtype=torch.float32, device="cpu"):
        super().__init__()
        f = {"dtype": dtype, "device": device}
        self.norm = nn.RMSNorm(dim, eps=1e-6, **f)
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False, **f) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.q(h) * self.k(h) + self.v(h)


def fan_out(device: str, seed: int = 0, dtype=torch.float32) -> tuple[FanOut, torch.Tensor]:
    torch.manual_seed(seed)
    model = FanOut(dtype=dtype, device=device)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    return model, torch.randn(2, 8, 64, device=device, dtype=dtype)


def llama(device: str, vocab=128, hidden=64, intermediate=128, seq=16):
    """A 2-layer Hugging Face Llama (GQA 4/2, SDPA attention) and a batch of token ids (2 x seq)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device), torch.randint(0, vocab, (2, seq), device=device)
