"""FusedLinearActivation beyond the conformance spec: it drops into a model in place of Linear + activation."""

import torch
from torch import nn

import kp_precision

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_fused_layer_replaces_linear_and_gelu():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96, device=DEVICE, dtype=torch.float16)
    fused = kp_precision.FusedLinearActivation.from_linear(linear, "gelu")
    assert fused.weight is linear.weight and fused.bias is linear.bias
    x = torch.randn(5, 7, 64, device=DEVICE, dtype=torch.float16)
    ours = fused(x).float()
    ref = nn.functional.gelu(nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()))
    assert ((ours - ref).norm() / ref.norm()).item() < 2e-3
    assert "activation=gelu" in repr(fused)
