"""Gated activations (SwiGLU, GeGLU): Triton forward/backward kernels, launchers, custom ops, functional API.

    y = act(gate) * up          act: silu(g) = g * sigmoid(g)               (Shazeer 2020, "GLU Variants")
                                     gelu(g) = 0.5 g (1 + erf(g / sqrt(2)))
                                     gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * sigmoid(2 z),
                                                    z = sqrt(2 / pi) (g + 0.044715 g^3)
    dgate = dy * up * act'(gate)      dup = dy * act(gate)

Computed in fp32 (fp64 for fp64 input), rounded once at the store. The backward recomputes act from gate:
only gate and up are saved. Packed forms take one [..., 2H] tensor, `gate, up = input.chunk(2, -1)`; their
halves are row-strided views read in place, and the backward writes both halves of one [..., 2H] gradient.
"""

import math

import torch

import kp_core
from kp_norms.ops import activation

OP = "kp::glu"
OP_BWD = "kp::glu_backward"
OP_PACKED = "kp::glu_packed"
OP_PACKED_BWD = "kp::glu_packed_backward"
PACKAGE = "kp-norms"
DTYPES = kp_core.FLOAT_DTYPES
ACTIVATIONS = {name: i for name, i in activation.IDS.items() if name}  # op-level name -> kernels' ACT switch

if kp_core.has_triton():
    import triton
    import triton.language as tl

    from kp_norms.ops.activation import act

    @triton.jit
    def _tile(pid, n_col_blocks, M, H, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Row offsets (int64, to multiply by each tensor's row stride), column offsets and the mask."""
        rows = (pid // n_col_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (pid % n_col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < H)[None, :]
        return rows.to(tl.int64)[:, None], cols[None, :], mask

    @triton.jit
    def _glu_fwd(
        G,
        stride_g,
        U,
        stride_u,
        Y,
        stride_y,
        M,
        H,
        n_col_blocks,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACT: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """y = act(g) * u on one BLOCK_M x BLOCK_N tile (1-D grid: row blocks x column blocks)."""
        r, c, mask = _tile(tl.program_id(0), n_col_blocks, M, H, BLOCK_M, BLOCK_N)
        g = tl.load(G + r * stride_g + c, mask=mask, other=0.0).to(ACC)
        u = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(ACC)
        a, _ = act(g, ACT, False)
        tl.store(Y + r * stride_y + c, (a * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd(
        DY,
        stride_dy,
        G,
        stride_g,
        U,
        stride_u,
        DG,
        stride_dg,
        DU,
        stride_du,
        M,
        H,
        n_col_blocks,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        ACT: tl.constexpr,
        ACC: tl.constexpr,
    ):
        """dgate = dy * u * act'(g), dup = dy * act(g); act recomputed from g."""
        r, c, mask = _tile(tl.program_id(0), n_col_blocks, M, H, BLOCK_M, BLOCK_N)
        dy = tl.load(DY + r * stride_dy + c, mask=mask, other=0.0).to(ACC)
        g = tl.load(G + r * stride_g + c, mask=mask, other=0.0).to(ACC)
        u = tl.load(U + r * stride_u + c, mask=mask, other=0.0).to(ACC)
        a, da = act(g, ACT, True)
        tl.store(DG + r * stride_dg + c, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + r * stride_du + c, (dy * a).to(DU.dtype.element_ty), mask=mask)


# (block_m, block_n, num_warps) a benchmark sweep may pin per op (OP or OP_BWD; benchmarks/bench_glu.py --tune);
# empty in normal use. The packed forms use the same launchers, hence the same entries.
CONFIG_OVERRIDE: dict[str, tuple[int, int, int]] = {}
# (elements per program, num_warps): ~4 elements a thread. Measured best on an H100 (bf16, 16384x14336 and
# 8192^2, --tune): bigger tiles (4-16K elements, 4-8 warps) lose 1-2% in the forward, nothing in the backward.
TILE = {OP: (1024, 8), OP_BWD: (2048, 16)}
MAX_BLOCK_N = 1024
INTERPRET_TILE_SCALE = 16  # the interpreter runs programs one after another: 16x fewer is ~15x faster there


def _config(op: str, m: int, h: int, interpret: bool = False) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps) for op (OP or OP_BWD) on an (m, h) problem; whole rows when narrow."""
    if op in CONFIG_OVERRIDE:
        return CONFIG_OVERRIDE[op]
    elements, num_warps = TILE[op]
    elements *= INTERPRET_TILE_SCALE if interpret else 1
    block_n = min(kp_core.next_power_of_2(h), MAX_BLOCK_N)
    block_m = min(max(1, elements // block_n), kp_core.next_power_of_2(m))
    return block_m, block_n, num_warps


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)  # not triton.cdiv: a JIT function, ~7 us a call from Python


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _as_rows(t: torch.Tensor, h: int) -> torch.Tensor:
    """t as (rows, h) with unit column stride (rows may be strided); copies only when it must."""
    t = t.reshape(t.numel() // h, h)
    return t if t.stride(1) == 1 or h == 1 else t.contiguous()


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.shape[-1] // 2
    x2 = _as_rows(x, 2 * h)
    return x2[:, :h], x2[:, h:]


# ---- reference path (CPU without the interpreter, or KP_BACKEND=reference) ----


def _reference_act(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(g), act'(g)) with torch ops in g's dtype; 1 - sigmoid(x) as sigmoid(-x), as the kernel does."""
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * math.sqrt(0.5)))
        return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    if activation == "silu":
        s, s_c = torch.sigmoid(g), torch.sigmoid(-g)
        return g * s, s * (1 + g * s_c)
    z2 = 2 * math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)
    s, s_c = torch.sigmoid(z2), torch.sigmoid(-z2)
    return g * s, s * (1 + 2 * math.sqrt(2 / math.pi) * g * s_c * (1 + 3 * 0.044715 * g * g))


# ---- launchers: 2-D (rows, H) views with unit column stride; y / dg / du are written in place ----


def _launch_settings(op, tuning_op, backend, gate, activation) -> tuple[int, int, dict]:
    """(grid, column blocks, keyword arguments) of a launch over gate's (rows, H) tiles."""
    m, h = gate.shape
    block_m, block_n, num_warps = _config(tuning_op, m, h, backend == kp_core.INTERPRET)
    n_col_blocks = _cdiv(h, block_n)
    grid = _cdiv(m, block_m) * n_col_blocks
    kp_core.check_index_fits(op, "the launch grid (programs)", grid)
    acc = tl.float64 if gate.dtype == torch.float64 else tl.float32
    kwargs = dict(BLOCK_M=block_m, BLOCK_N=block_n, ACT=ACTIVATIONS[activation], ACC=acc, num_warps=num_warps)
    return grid, n_col_blocks, kwargs


def _launch_forward(op, gate, up, y, activation):
    backend = kp_core.choose_backend(op, gate)
    if backend == kp_core.REFERENCE:
        kp_core.note_launch(op, "reference", kp_core.REFERENCE)
        acc = _acc_dtype(gate.dtype)
        y.copy_(_reference_act(gate.to(acc), activation)[0] * up.to(acc))
        return
    grid, n_col_blocks, kwargs = _launch_settings(op, OP, backend, gate, activation)
    m, h = gate.shape
    _glu_fwd[(grid,)](gate, gate.stride(0), up, up.stride(0), y, y.stride(0), m, h, n_col_blocks, **kwargs)
    kp_core.note_launch(op, "_glu_fwd", backend)


def _launch_backward(op, dy, gate, up, dg, du, activation):
    backend = kp_core.choose_backend(op, gate)
    if backend == kp_core.REFERENCE:
        kp_core.note_launch(op, "reference", kp_core.REFERENCE)
        acc = _acc_dtype(gate.dtype)
        a, da = _reference_act(gate.to(acc), activation)
        dyf = dy.to(acc)
        dg.copy_(dyf * up.to(acc) * da)
        du.copy_(dyf * a)
        return
    grid, n_col_blocks, kwargs = _launch_settings(op, OP_BWD, backend, gate, activation)
    strided = [arg for t in (dy, gate, up, dg, du) for arg in (t, t.stride(0))]
    _glu_bwd[(grid,)](*strided, *gate.shape, n_col_blocks, **kwargs)
    kp_core.note_launch(op, "_glu_bwd", backend)


def _forward_impl(gate, up, activation):
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if y.numel():  # empty: no launch
        h = gate.shape[-1] if gate.dim() else 1
        _launch_forward(OP, _as_rows(gate, h), _as_rows(up, h), y.view(-1, h), activation)
    return y


def _backward_impl(dy, gate, up, activation):
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty_like(dg)
    if dg.numel():
        h = gate.shape[-1] if gate.dim() else 1
        rows = [_as_rows(t, h) for t in (dy, gate, up, dg, du)]
        _launch_backward(OP_BWD, *rows, activation)
    return dg, du


def _packed_forward_impl(x, activation):
    y = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype, device=x.device)
    if y.numel():
        _launch_forward(OP_PACKED, *_halves(x), y.view(-1, y.shape[-1]), activation)
    return y


def _packed_backward_impl(dy, x, activation):
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if dx.numel():
        h = dy.shape[-1]
        _launch_backward(OP_PACKED_BWD, _as_rows(dy, h), *_halves(x), *_halves(dx), activation)
    return dx


# ---- torch.library ops (what torch.compile sees) and the eager autograd path ----


def _like(t, shape=None):
    return torch.empty(t.shape if shape is None else shape, dtype=t.dtype, device=t.device)


def _setup(ctx, inputs, output):
    *tensors, ctx.activation = inputs
    ctx.save_for_backward(*tensors)


def _glu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return *glu_backward_op(dy, gate, up, ctx.activation), None


def _glu_packed_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return glu_packed_backward_op(dy, x, ctx.activation), None


def _register(name, fake, **autograd):
    return kp_core.custom_op(name, package=PACKAGE, spec="glu", dtypes=DTYPES, fake=fake, **autograd)


@_register(OP_BWD, lambda dy, gate, up, activation: (_like(gate), _like(gate)))
def glu_backward_op(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup)."""
    return _backward_impl(dy, gate, up, activation)


@_register(OP, lambda gate, up, activation: _like(gate), backward=_glu_backward, setup_context=_setup)
def glu_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    return _forward_impl(gate, up, activation)


@_register(OP_PACKED_BWD, lambda dy, x, activation: _like(x))
def glu_packed_backward_op(dy: torch.Tensor, x: torch.Tensor, activation: str) -> torch.Tensor:
    """d(input) as one [..., 2H] tensor: dgate in the first half, dup in the second."""
    return _packed_backward_impl(dy, x, activation)


@_register(
    OP_PACKED,
    lambda x, activation: _like(x, (*x.shape[:-1], x.shape[-1] // 2)),
    backward=_glu_packed_backward,
    setup_context=_setup,
)
def glu_packed_op(x: torch.Tensor, activation: str) -> torch.Tensor:
    return _packed_forward_impl(x, activation)


class _GLUFunction(torch.autograd.Function):
    """Eager calls skip the custom-op dispatch (its CPU cost); the same launchers run either way."""

    @staticmethod
    def forward(ctx, gate, up, activation):
        ctx.activation = activation
        ctx.save_for_backward(gate, up)
        return _forward_impl(gate, up, activation)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        return *_backward_impl(dy, gate, up, ctx.activation), None


class _GLUPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, activation):
        ctx.activation = activation
        ctx.save_for_backward(x)
        return _packed_forward_impl(x, activation)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        return _packed_backward_impl(dy, x, ctx.activation), None


# ---- functional API ----


def _gelu_activation(name: str, approximate: str) -> str:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"{name}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return "gelu" if approximate == "none" else "gelu_tanh"


def _glu(name: str, gate, up, activation: str) -> torch.Tensor:
    kp_core.check_tensor(name, "gate", gate, dtypes=DTYPES)
    kp_core.check_tensor(name, "up", up, dtypes=DTYPES)
    kp_core.check_same_dtype(name, "up", up, gate, "gate")
    kp_core.check_same_device(name, gate=gate, up=up)
    kp_core.check_shape(name, "up", up, gate.shape)
    if torch.compiler.is_compiling():
        return glu_op(gate, up, activation)
    return _GLUFunction.apply(gate, up, activation)


def _glu_packed(name: str, input, activation: str) -> torch.Tensor:
    kp_core.check_tensor(name, "input", input, dtypes=DTYPES, min_ndim=1)
    if input.shape[-1] % 2:
        raise ValueError(f"{name}: input's last dimension must be even (gate and up halves), got {input.shape[-1]}")
    if torch.compiler.is_compiling():
        return glu_packed_op(input, activation)
    return _GLUPackedFunction.apply(input, activation)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up`, fused; gate and up have the same shape, dtype and device."""
    return _glu("kp_norms.swiglu", gate, up, "silu")


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """`F.gelu(gate, approximate=approximate) * up`, fused."""
    return _glu("kp_norms.geglu", gate, up, _gelu_activation("kp_norms.geglu", approximate))


def swiglu_packed(input: torch.Tensor) -> torch.Tensor:
    """`swiglu(*input.chunk(2, -1))` without copying the halves: input is [..., 2H], the result [..., H]."""
    return _glu_packed("kp_norms.swiglu_packed", input, "silu")


def geglu_packed(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """`geglu(*input.chunk(2, -1), approximate)` without copying the halves."""
    name = "kp_norms.geglu_packed"
    return _glu_packed(name, input, _gelu_activation(name, approximate))
