"""Gated activations (SwiGLU, GeGLU): launchers, the PyTorch reference path and the op declarations.

    y = act(gate) * up          act: silu(g) = g * sigmoid(g)               (Shazeer 2020, "GLU Variants")
                                     gelu(g) = 0.5 g (1 + erf(g / sqrt(2)))
                                     gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * sigmoid(2 z),
                                                    z = sqrt(2 / pi) (g + 0.044715 g^3)
    dgate = dy * up * act'(gate)      dup = dy * act(gate)

Computed in fp32 for fp16/bf16 inputs and in fp64 for fp32/fp64 ones, rounded once at the store. The backward
recomputes act from gate: only gate and up are saved. kp::glu_float8 also returns y cast to float8 (kp_core.float8's
cast, tensorwise or rowwise): the forward kernel leaves y's amax (atomic maxes: a row spans several programs) and
_glu_cast_float8 casts y with it, so y is never read back for its amax; its backward is kp::glu's.

The packed op takes one [..., 2H] tensor,
`gate, up = input.chunk(2, -1)`; its halves are row-strided views read in place, and its backward writes both
halves of one [..., 2H] gradient. Kernels: kp_norms.ops.glu_kernels; the activations' Triton forms are
kp_core.activation_kernels, and the reference path (CPU without the interpreter, or KP_BACKEND=reference) takes
the same formulas in PyTorch from kp_core.activation.
"""

import functools
import math

import torch

import kp_core
from kp_core import float8
from kp_core.activation import reference_with_grad

if kp_core.has_triton():
    import triton.language as tl

    from kp_norms.ops import glu_kernels as kernels

OP = "kp::glu"
OP_BWD = f"{OP}_backward"
OP_PACKED = "kp::glu_packed"
OP_PACKED_BWD = f"{OP_PACKED}_backward"
OP_FP8 = "kp::glu_float8"
OP_FP8_BWD = f"{OP_FP8}_backward"
FP8_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the inputs a float8 output is made from
PACKAGE = "kp-norms"
SPEC = "glu"
DTYPES = kp_core.FLOAT_DTYPES
# Elements per program and warps: ~4 elements a thread. Measured best on an H100 (bf16, 16384x14336 and 8192^2,
# benchmarks/bench_glu.py --tune): bigger tiles (4-16K elements, 4-8 warps) lose 1-2% in the forward, nothing in
# the backward. With a float8 copy the forward has its own tiles (fewer programs: fewer atomic maxes on the amax)
# and so does the cast. The interpreter runs programs one after another: 16x bigger tiles there are ~15x faster
# (the float8 kernels take the forward's, at most 1024 wide, so the specs' small cases span several blocks).
TILES = {
    "_glu_fwd": dict(elements=1024, num_warps=8),
    "_glu_bwd": dict(elements=2048, num_warps=16),
    "_glu_fwd_float8": dict(elements=4096, max_block_n=4096, num_warps=4),
    "_glu_cast_float8": dict(elements=4096, max_block_n=2048, num_warps=4),
}
MAX_BLOCK_N = 1024
INTERPRET_ELEMENTS = {"_glu_bwd": 16 * 2048}  # others: 16 * 1024


def _config(kernel: str, m: int, h: int, interpret: bool) -> tuple[int, int, int]:
    return _config_for(kernel, m, h, interpret, kp_core.tuning.generation())


@functools.lru_cache(maxsize=1024)
def _config_for(kernel: str, m: int, h: int, interpret: bool, _generation: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) of a launch over an (m, h) problem; whole rows when narrow."""
    s = kp_core.settings(kernel, **{"max_block_n": MAX_BLOCK_N, **TILES[kernel]})
    elements = INTERPRET_ELEMENTS.get(kernel, 16 * 1024) if interpret else s["elements"]
    max_n = min(s["max_block_n"], MAX_BLOCK_N) if interpret else s["max_block_n"]
    block_n = min(kp_core.next_power_of_2(h), max_n)
    block_m = min(max(1, elements // block_n), kp_core.next_power_of_2(m))
    return block_m, block_n, s["num_warps"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16, fp64 for fp32 and fp64 (as kp_norms.ops.norm, for the same reason)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else torch.float64


def _as_rows(t: torch.Tensor, h: int) -> torch.Tensor:
    """t as (rows, h) with unit column stride (rows may be strided); copies only when it must."""
    t = t.reshape(t.numel() // h, h)
    return t if t.stride(1) == 1 or h == 1 else t.contiguous()


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.shape[-1] // 2
    x2 = _as_rows(x, 2 * h)
    return x2[:, :h], x2[:, h:]


# ---- launchers: 2-D (rows, H) views with unit column stride; y / dg / du are written in place ----


def _launch(op, kernel, backend, gate, tensors, consts, extra=(), tile="") -> None:
    """One launch of `kernel` over gate's (rows, H) tiles (the tiles of `tile`, by default the kernel's own):
    `tensors` are its (tensor, row stride) operands, `extra` its arguments after the sizes."""
    m, h = gate.shape
    block_m, block_n, num_warps = _config(tile or kernel.fn.__name__, m, h, backend == kp_core.INTERPRET)
    n_col_blocks = kp_core.cdiv(h, block_n)
    grid = kp_core.cdiv(m, block_m) * n_col_blocks
    kp_core.check_index_fits(op, "the launch grid (programs)", grid)
    args = (*(a for t in tensors for a in (t, t.stride(0))), m, h, n_col_blocks, *extra)
    kp_core.launch(op, backend, kernel, (grid,), args, dict(BLOCK_M=block_m, BLOCK_N=block_n, **consts), num_warps)


def _act_consts(gate, act) -> dict:
    return dict(ACT=act, ACC=tl.float32 if gate.dtype in (torch.float16, torch.bfloat16) else tl.float64)


def _launch_forward(op, gate, up, y, act, fp8=None):
    """y = act(gate) * up written in place; fp8: None, or (float8 dtype, rowwise, power_of_2, data (as y, rows),
    scale, amax) for y's float8 copy, written in place (scale and amax (rows,) rowwise, 0-d tensorwise)."""
    backend = kp_core.choose_backend(op, gate)
    if backend == kp_core.REFERENCE:
        kp_core.reference(op)
        acc = _acc_dtype(gate.dtype)
        y.copy_(reference_with_grad(gate.to(acc), act)[0] * up.to(acc))
        if fp8 is not None:
            dtype8, rowwise, pow2, *outs = fp8
            for out, value in zip(outs, float8.reference_cast(y, dtype8, rowwise, pow2)):
                out.copy_(value)
        return
    if fp8 is None:
        _launch(op, kernels._glu_fwd, backend, gate, (gate, up, y), dict(**_act_consts(gate, act), FP8=0), (y,))
        return
    dtype8, rowwise, pow2, data, scale, amax = fp8
    bits = torch.zeros(amax.shape, dtype=torch.int32, device=y.device)  # float32 bits, for atomic maxes
    mode = kernels.ROW.value if rowwise else kernels.TENSOR.value
    consts = dict(**_act_consts(gate, act), FP8=mode)
    _launch(op, kernels._glu_fwd, backend, gate, (gate, up, y), consts, (bits,), tile="_glu_fwd_float8")
    soft = float8.soft_float8(backend)
    cast = dict(ROWWISE=rowwise, **float8.cast_constexprs(dtype8, pow2, soft))
    q = data.view(torch.uint8) if soft else data
    _launch(op, kernels._glu_cast_float8, backend, y, (y, q), cast, (scale, bits))
    amax.copy_(bits.view(torch.float32))


def _launch_backward(op, dy, gate, up, dg, du, act):
    backend = kp_core.choose_backend(op, gate)
    if backend == kp_core.REFERENCE:
        kp_core.reference(op)
        acc = _acc_dtype(gate.dtype)
        a, da = reference_with_grad(gate.to(acc), act)
        dyf = dy.to(acc)
        dg.copy_(dyf * up.to(acc) * da)
        du.copy_(dyf * a)
        return
    _launch(op, kernels._glu_bwd, backend, gate, (dy, gate, up, dg, du), _act_consts(gate, act))


def forward(gate: torch.Tensor, up: torch.Tensor, act: int) -> torch.Tensor:
    """act(gate) * up, any shape (the last dim is H)."""
    y = gate.new_empty(gate.shape)
    if y.numel():  # empty: no launch
        h = gate.shape[-1] if gate.dim() else 1
        _launch_forward(OP, _as_rows(gate, h), _as_rows(up, h), y.view(-1, h), act)
    return y


def backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup)."""
    return _backward(OP_BWD, dy, gate, up, act)


def _backward(op, dy, gate, up, act):
    dg = gate.new_empty(gate.shape)
    du = gate.new_empty(gate.shape)
    if dg.numel():
        h = gate.shape[-1] if gate.dim() else 1
        _launch_backward(op, *(_as_rows(t, h) for t in (dy, gate, up, dg, du)), act)
    return dg, du


def forward_float8(
    gate: torch.Tensor, up: torch.Tensor, act: int, fp8: torch.dtype, rowwise: bool, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, data, scale, amax): forward's y and its float8 copy, data as uint8 (the float8 bytes: autograd and opcheck
    take a float8 output for a differentiable one); scale and amax (rows,) rowwise, 0-d tensorwise."""
    h = gate.shape[-1]
    rows = math.prod(gate.shape[:-1])  # a row even when it is empty (h = 0)
    y = gate.new_empty(gate.shape)
    data = torch.empty(gate.shape, dtype=fp8, device=gate.device)
    shape = (rows,) if rowwise else ()
    scale, amax = (torch.empty(shape, dtype=torch.float32, device=gate.device) for _ in range(2))
    if y.numel():
        cast = (fp8, rowwise, power_of_2, data.view(-1, h), scale, amax)
        _launch_forward(OP_FP8, _as_rows(gate, h), _as_rows(up, h), y.view(-1, h), act, cast)
    else:  # no launch: every block empty, amax 0
        _, scale, amax = float8.reference_cast(y.view(rows, h), fp8, rowwise, power_of_2)
    return y, data.view(torch.uint8), scale, amax


def backward_float8(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, act: int, fp8: torch.dtype, rowwise: bool, power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """backward, for kp::glu_float8 (the float8 copy is not differentiable)."""
    return _backward(OP_FP8_BWD, dy, gate, up, act)


def forward_packed(x: torch.Tensor, act: int) -> torch.Tensor:
    """act(gate) * up with gate, up = x.chunk(2, -1)."""
    y = x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
    if y.numel():
        _launch_forward(OP_PACKED, *_halves(x), y.view(-1, y.shape[-1]), act)
    return y


def backward_packed(dy: torch.Tensor, x: torch.Tensor, act: int) -> torch.Tensor:
    """d(input) as one [..., 2H] tensor: dgate in the first half, dup in the second."""
    dx = x.new_empty(x.shape)
    if dx.numel():
        _launch_backward(OP_PACKED_BWD, _as_rows(dy, dy.shape[-1]), *_halves(x), *_halves(dx), act)
    return dx


# ---- declarations ----


def _like(t: torch.Tensor, shape=None) -> torch.Tensor:
    return t.new_empty(t.shape if shape is None else shape)


GLU = kp_core.op(
    OP,
    forward,
    lambda gate, up, act: _like(gate),
    backward=backward,
    backward_fake=lambda dy, gate, up, act: (_like(gate), _like(gate)),
    save=lambda args, outputs: args[:2],
    grad_inputs=("gate", "up"),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
    inline=True,  # traced into compiled graphs: packages/kp/tests/test_inline.py
)


def _float8_fake(gate, up, act, fp8, rowwise, power_of_2):
    shape = (math.prod(gate.shape[:-1]),) if rowwise else ()
    scale, amax = (gate.new_empty(shape, dtype=torch.float32) for _ in range(2))  # two tensors, not one twice
    return _like(gate), gate.new_empty(gate.shape, dtype=torch.uint8), scale, amax


GLU_FLOAT8 = kp_core.op(
    OP_FP8,
    forward_float8,
    _float8_fake,
    backward=backward_float8,
    backward_fake=lambda dy, gate, up, act, fp8, rowwise, power_of_2: (_like(gate), _like(gate)),
    save=lambda args, outputs: args[:2],
    grad_inputs=("gate", "up"),
    differentiable_outputs=1,  # y; the float8 copy is not
    package=PACKAGE,
    spec=SPEC,
    dtypes=FP8_DTYPES,
    inline=True,  # traced into compiled graphs: packages/kp/tests/test_inline.py
)

GLU_PACKED = kp_core.op(
    OP_PACKED,
    forward_packed,
    lambda x, act: _like(x, (*x.shape[:-1], x.shape[-1] // 2)),
    backward=backward_packed,
    backward_fake=lambda dy, x, act: _like(x),
    save=lambda args, outputs: args[:1],
    grad_inputs=("x",),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)
