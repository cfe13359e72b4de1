"""Float8 casts in PyTorch and the constants every float8 kernel shares (kp-precision's casts and matmuls, the
float8 output of kp-norms' norms).

Per block of values, in float32:

    amax = max |x|              (NaN if the block holds a NaN, as torch.amax)
    q    = FP8_MAX / max(amax, EPS)          floored to a power of two when power_of_2
    data = float8(saturate(x * q))           saturate: clamp to +-FP8_MAX, NaN kept; round to nearest-even
    scale = 1 / q                            so that x ~ data * scale (torch._scaled_mm's convention)

FP8_MAX is 448 for float8_e4m3fn and 57344 for float8_e5m2, EPS 1e-12 (torchao's). The kernels' forms are
kp_core.float8_kernels.
"""

import torch

from kp_core.backend import INTERPRET
from kp_core.tuning import settings

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
EPS = 1e-12


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def soft_float8(backend: str) -> bool:
    """Convert to float8 in integer arithmetic (exact everywhere) instead of with the hardware's conversion:
    always under the interpreter, whose own float8 rounding is not round-to-nearest-even; on a GPU only when a
    test pins `kp_core.pinned("fp8_convert", soft=True)` to check one against the other."""
    soft = settings("fp8_convert", soft=None)["soft"]
    return backend == INTERPRET if soft is None else soft


def divide(a, b: torch.Tensor) -> torch.Tensor:
    """a / b in float32 rounded once, as the kernels divide: computed in float64 and rounded to float32 (a float64
    quotient of float32 operands rounds to the correctly rounded float32 one). Inductor's float32 division is not
    correctly rounded (1 ulp off on the H100), and this runs in compiled graphs (kp_precision.shared.cast)."""
    return (a / b.double()).float()


def multiplier(amax: torch.Tensor, fp8: torch.dtype, power_of_2: bool) -> torch.Tensor:
    """q = FP8_MAX / max(amax, EPS) (float32), floored to a power of two with power_of_2; the scale is 1 / q."""
    q = divide(fp8_max(fp8), amax.float().clamp(min=EPS))
    if power_of_2:
        q = torch.where(q.isnan(), q, (q.view(torch.int32) & 0x7F800000).view(torch.float32))
    return q


def saturating_cast(x: torch.Tensor, q: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """float8(saturate(x * q)) in float32, NaN kept: the kernels' cast, in PyTorch."""
    mx = fp8_max(fp8)
    y = x.float() * q
    return torch.where(y.isnan(), y, y.clamp(-mx, mx)).to(fp8)


def reference_cast(y: torch.Tensor, fp8: torch.dtype, rowwise: bool, power_of_2: bool):
    """(data, scale, amax) of 2-D y cast per row (scale and amax (M,)) or per tensor (0-d), in PyTorch: the
    reference path of the kernels that make a float8 copy of their output."""
    yf = y.float()
    if yf.numel() == 0:  # every block empty: amax 0
        amax = yf.new_zeros((yf.shape[0],) if rowwise else ())
    else:
        amax = yf.abs().amax(dim=1) if rowwise else yf.abs().amax()
    q = multiplier(amax, fp8, power_of_2)
    return saturating_cast(yf, q[:, None] if rowwise else q, fp8), divide(1.0, q), amax


def cast_constexprs(fp8: torch.dtype, power_of_2: bool, soft: bool) -> dict:
    """The constexprs of a kernel that casts with kp_core.float8_kernels: FP8_MAX, FP8_EPS, E5M2, SOFT, POW2."""
    return dict(FP8_MAX=fp8_max(fp8), FP8_EPS=EPS, E5M2=fp8 == torch.float8_e5m2, SOFT=soft, POW2=power_of_2)
