"""2:4 pruning and packing: launcher, the PyTorch reference path and the op declaration.

The weight is (M, K), K the reduction dimension (nn.Linear's (out_features, in_features)). Per group of 4
consecutive entries along K, the 2 with the largest score are kept: score = |w|, or |w| * column_scale[k]
(Wanda: column_scale the input activations' L2 norm per input feature), computed in float32. Ties go to the lower
index; a NaN weight scores above every number (it is kept, so it shows). Outputs, as asked:
- mask: bool (M, K), True where kept;
- pruned: the weight with the others set to 0;
- values (M, K / 2) and meta (M, K / 16) int16: the packed form CUTLASS's sparse GEMM reads (torch's
  SparseSemiStructuredTensorCUTLASS): each group's 2 kept values in index order, and its two indices in 4 bits
  (first | second << 2), 4 groups per int16, scattered into CUTLASS's interleaved column-major metadata layout.
  Packing needs M % 32 == 0 and K % 64 == 0 (CUTLASS's tile) and a 16-bit weight.
The transposable mask (kp::mask_2_4_transposable) keeps 2 of every 4 along K and along M at once: per 4 x 4
block, of the 90 patterns with 2 ones in every row and column (patterns(), in a fixed order), the one whose
scores sum highest, the first in that order on a tie. The kernel sums the scores in one matmul of the
blocks by the pattern table, accumulated in float32, the scores split in three tensor-core products on a GPU
(tf32x3: 22 of float32's 24 bits), so two patterns whose sums differ by less than that rounding may go either
way; exact ties (scores that tf32 holds exactly, as small multiples of powers of 2) go to the first.
NaN and inf score as the largest finite float there.
Kernels: kp_sparsity.ops.prune_kernels.
"""

import functools
import itertools

import torch

import kp_core

if kp_core.has_triton():
    from kp_sparsity.ops import prune_kernels as kernels

OP = "kp::prune_2_4"
OP_T = "kp::mask_2_4_transposable"
PACKAGE = "kp-sparsity"
SPEC = "sparsity"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PACK_DTYPES = (torch.float16, torch.bfloat16)
# (BLOCK_M, BLOCK_K, num_warps) of a program on a GPU: the best of benchmarks/bench_sparsity.py --tune on an H100
# (bf16, 4096^2, 14336x4096, 8192^2; 16-128 x 64-512, 2-8 warps; 2716 GB/s at 14336x4096, against 2437 with
# (64, 128, 8)). Under the interpreter a 64 x 128 tile: the spec's packed shapes (32-96 rows, 64-192 columns) then
# end inside a tile at both edges, where the stores are masked.
TILE = (32, 128, 4)
INTERPRET_TILE = (64, 128, 4)


def scores(weight: torch.Tensor, column_scale: torch.Tensor | None) -> torch.Tensor:
    """The float32 score of each entry (NaN as +inf), as the kernel computes it."""
    s = weight.float().abs()
    if column_scale is not None:
        s = s * column_scale.float()
    return torch.where(s.isnan(), torch.full_like(s, float("inf")), s)


def reference_mask(weight: torch.Tensor, column_scale: torch.Tensor | None) -> torch.Tensor:
    """The keep mask in plain PyTorch: an entry is kept when fewer than 2 of its group beat it (a larger score,
    or an equal one at a lower index)."""
    s = scores(weight, column_scale).view(*weight.shape[:-1], -1, 4)
    a, b = s[..., :, None], s[..., None, :]  # a: the entry i, b: the others j
    idx = torch.arange(4, device=weight.device)
    beats = (b > a) | ((b == a) & (idx[None, :] < idx[:, None]))
    return (beats.sum(-1) < 2).view(weight.shape)


def forward(
    weight: torch.Tensor, column_scale: torch.Tensor | None, want_mask: bool, want_dense: bool, want_packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mask, pruned, values, meta); None for an output not asked for (the module docstring)."""
    m, k = weight.shape
    dev = weight.device
    mask = torch.empty((m, k), dtype=torch.bool, device=dev) if want_mask else None
    pruned = torch.empty((m, k), dtype=weight.dtype, device=dev) if want_dense else None
    values = torch.empty((m, k // 2), dtype=weight.dtype, device=dev) if want_packed else None
    meta = torch.empty((m, k // 16), dtype=torch.int16, device=dev) if want_packed else None
    if weight.numel() == 0:
        return mask, pruned, values, meta
    backend = kp_core.choose_backend(OP, weight)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP)
        keep = reference_mask(weight, column_scale)
        kept = torch.where(keep, weight, torch.zeros_like(weight))
        if want_mask:
            mask.copy_(keep)
        if want_dense:
            pruned.copy_(kept)
        if want_packed:
            from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass

            v, mt = sparse_semi_structured_from_dense_cutlass(kept)
            values.copy_(v)
            meta.copy_(mt)
        return mask, pruned, values, meta
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if backend == kp_core.INTERPRET:
        bm, bk, warps = INTERPRET_TILE
    else:
        t = kp_core.settings("_prune_2_4", block_m=TILE[0], block_k=TILE[1], num_warps=TILE[2])
        bm, bk, warps = t["block_m"], t["block_k"], t["num_warps"]
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
    kp_core.check_index_fits("kp_sparsity.prune_2_4", "the launch grid (programs)", grid)
    dummy = weight  # stands for an output the call does not write (its constexpr switch is off)
    args = (
        weight,
        weight.stride(0),
        column_scale if column_scale is not None else dummy,
        mask.view(torch.int8) if want_mask else dummy,
        pruned if want_dense else dummy,
        values if want_packed else dummy,
        meta if want_packed else dummy,
        m,
        k,
    )
    consts = dict(
        HAS_SCALE=column_scale is not None,
        WRITE_MASK=want_mask,
        WRITE_DENSE=want_dense,
        WRITE_PACKED=want_packed,
        BLOCK_M=bm,
        BLOCK_K=bk,
    )
    kp_core.launch(OP, backend, kernels._prune_2_4, (grid,), args, consts, warps)
    return mask, pruned, values, meta


# ---- the transposable mask ----


@functools.cache
def patterns() -> torch.Tensor:
    """The 90 4 x 4 0/1 patterns with 2 ones in every row and every column, flattened row-major, in the order of
    their rows' pairs ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)) read as base-6 digits, first row first."""
    pairs = list(itertools.combinations(range(4), 2))
    rows = []
    for choice in itertools.product(pairs, repeat=4):
        block = [[1.0 if j in pair else 0.0 for j in range(4)] for pair in choice]
        if all(sum(block[i][j] for i in range(4)) == 2 for j in range(4)):
            rows.append([v for r in block for v in r])
    return torch.tensor(rows)


def _table(device) -> torch.Tensor:
    """patterns() padded to 128 rows (the kernel's tile), on device, made once per device."""
    key = str(device)
    if key not in _TABLES:
        t = torch.zeros(128, 16)
        t[: len(patterns())] = patterns()
        _TABLES[key] = t.to(device)
    return _TABLES[key]


_TABLES: dict = {}


def mask_transposable(weight: torch.Tensor, column_scale: torch.Tensor | None) -> torch.Tensor:
    """The transposable 2:4 mask (module docstring of the kernel): weight (M, K), both multiples of 4."""
    m, k = weight.shape
    mask = torch.empty((m, k), dtype=torch.bool, device=weight.device)
    if weight.numel() == 0:
        return mask
    backend = kp_core.choose_backend(OP_T, weight)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP_T)
        s = scores(weight, column_scale).clamp(max=3.0e38).double()
        blocks = s.view(m // 4, 4, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
        best = (blocks @ patterns().to(blocks).T).argmax(-1)
        bits = patterns().to(weight.device)[best].view(m // 4, k // 4, 4, 4).permute(0, 2, 1, 3).reshape(m, k)
        return mask.copy_(bits != 0)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if backend == kp_core.INTERPRET:
        bm, bk, warps, precision = 16, 16, 4, "ieee"
    else:
        # tf32x3: three tensor-core products, 22 of float32's 24 bits (2x the speed of "ieee" on an H200)
        t = kp_core.settings("_mask_2_4_transposable", block_m=32, block_k=64, num_warps=4, precision="tf32x3")
        bm, bk, warps, precision = t["block_m"], t["block_k"], t["num_warps"], t["precision"]
    grid = kp_core.cdiv(m, bm) * kp_core.cdiv(k, bk)
    kp_core.check_index_fits(OP_T, "the launch grid (programs)", grid)
    scale = column_scale if column_scale is not None else weight
    args = (weight, weight.stride(0), scale, _table(weight.device), mask.view(torch.int8), m, k, len(patterns()))
    consts = dict(HAS_SCALE=column_scale is not None, BLOCK_M=bm, BLOCK_K=bk, PRECISION=precision)
    kp_core.launch(OP_T, backend, kernels._mask_2_4_transposable, (grid,), args, consts, warps)
    return mask


def _fake(weight, column_scale, want_mask, want_dense, want_packed):
    m, k = weight.shape
    return (
        weight.new_empty((m, k), dtype=torch.bool) if want_mask else None,
        weight.new_empty((m, k)) if want_dense else None,
        weight.new_empty((m, k // 2)) if want_packed else None,
        weight.new_empty((m, k // 16), dtype=torch.int16) if want_packed else None,
    )


PRUNE = kp_core.op(OP, forward, _fake, package=PACKAGE, spec=SPEC, dtypes=DTYPES)
MASK_T = kp_core.op(
    OP_T,
    mask_transposable,
    lambda weight, column_scale: weight.new_empty(weight.shape, dtype=torch.bool),
    package=PACKAGE,
    spec=SPEC,
    dtypes=DTYPES,
)
