import math

import torch

import kp_core


def test_rule_bound_is_twice_torchs_error_plus_an_ulp_at_the_outputs_scale():
    ref = torch.tensor([4.0, -2.0, 1.0], dtype=torch.float64)
    lowp = torch.tensor([4.0, -2.0, 1.0 + 2**-10], dtype=torch.float16)
    ours = torch.tensor([4.0, -2.0 - 2**-8, 1.0], dtype=torch.float16)
    err, bound = kp_core.rule_bound(ours, ref, lowp, torch.float16)
    atol = kp_core.atol_for(torch.float16, ref)
    assert err == 2**-8 and math.isclose(bound, 2 * 2**-10 + atol)
    assert math.isclose(atol, (2**-10 + 32 * 2**-52) * 4.0)


def test_rule_bound_makes_nan_an_infinite_error_and_empty_tensors_pass():
    ref = torch.ones(3, dtype=torch.float64)
    ours = torch.tensor([1.0, float("nan"), 1.0])
    assert kp_core.rule_bound(ours, ref, ref.float(), torch.float32)[0] == math.inf
    empty = torch.empty(0)
    assert kp_core.rule_bound(empty, empty.double(), empty, torch.float32) == (0.0, 0.0)
