"""2:4 packing into cuSPARSELt's compressed layout (kp::pack_2_4_cusparselt): launcher, PyTorch reference path
and op declaration. The layout is described in kp_sparsity.ops.cusparselt_kernels.

Given a 16-bit weight W (M, K) and a 2:4 keep mask along K, it writes what torch._cslt_compress returns for
W * mask: (M, K / 2 + K / 16) in W's dtype, the kept values then the metadata. With transpose=True the mask must
be 2:4 along M as well (kp's transposable mask) and W^T (K, M) is packed too, in the same pass, for the
backward's dy @ W. M and K multiples of 64.
"""

import torch

import kp_core

if kp_core.has_triton():
    from kp_sparsity.ops import cusparselt_kernels as kernels

OP = "kp::pack_2_4_cusparselt"
PACKAGE = "kp-sparsity"
SPEC = "sparsity"
DTYPES = (torch.float16, torch.bfloat16)
BLOCK = 64


def _positions(rows: int, cols: int, device) -> torch.Tensor:
    """Nibble index, in the metadata, of every group (r, g) of an (rows, cols) matrix: (rows, cols / 4)."""
    r = torch.arange(rows, device=device)[:, None]
    g = torch.arange(cols // 4, device=device)[None, :]
    inside = (((r >> 3) & 1) | (((g >> 2) & 1) << 1) | ((g & 1) << 2) | (((g >> 1) & 1) << 3) | ((r & 7) << 4)) + (
        ((r >> 4) & 3) << 7
    )
    return ((r >> 6) * (cols // 32) + (g >> 3)) * 512 + inside


def reference_pack(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The compressed (M, K / 2 + K / 16) matrix in plain PyTorch (mask 2:4 along K)."""
    m, k = weight.shape
    values = weight[mask].view(m, k // 2)
    idx = torch.arange(4, device=weight.device).expand(m, k // 4, 4)
    kept = mask.view(m, k // 4, 4)
    first = torch.where(kept, idx, 4).amin(-1)
    second = torch.where(kept, idx, -1).amax(-1)
    nibbles = torch.zeros(m * k // 4, dtype=torch.int32, device=weight.device)
    nibbles[_positions(m, k, weight.device).flatten()] = (first | (second << 2)).flatten().int()
    words = (nibbles.view(-1, 4) << torch.tensor([0, 4, 8, 12], device=weight.device, dtype=torch.int32)).sum(-1)
    meta = (words - ((words >> 15) & 1) * 65536).to(torch.int16).view(weight.dtype)
    return torch.cat([values.flatten(), meta]).view(m, k // 2 + k // 16)


def forward(weight: torch.Tensor, mask: torch.Tensor, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(W packed, W^T packed); the second is empty (0, 0) when transpose is False."""
    m, k = weight.shape
    out = torch.empty((m, k // 2 + k // 16), dtype=weight.dtype, device=weight.device)
    out_t = torch.empty((k, m // 2 + m // 16) if transpose else (0, 0), dtype=weight.dtype, device=weight.device)
    if weight.numel() == 0:
        return out, out_t
    backend = kp_core.choose_backend(OP, weight)
    if backend == kp_core.REFERENCE:
        kp_core.reference(OP)
        out.copy_(reference_pack(weight, mask))
        if transpose:
            out_t.copy_(reference_pack(weight.t().contiguous(), mask.t().contiguous()))
        return out, out_t
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    mask = mask.contiguous()
    grid = (m // BLOCK) * (k // BLOCK)
    kp_core.check_index_fits("kp_sparsity.to_sparse_2_4", "the launch grid (programs)", grid)

    def meta_of(t, rows, cols):
        return t.view(torch.int16).view(-1)[rows * cols // 2 :]

    args = (
        weight,
        weight.stride(0),
        mask.view(torch.int8),
        out,
        meta_of(out, m, k),
        out_t if transpose else out,
        meta_of(out_t, k, m) if transpose else meta_of(out, m, k),
        m,
        k,
    )
    # 8 warps: 123 us against 157 with 4 for a 14336 x 4096 bf16 weight and its transpose on an H100
    warps = kp_core.settings("_pack_cusparselt", num_warps=8)["num_warps"]
    kp_core.launch(OP, backend, kernels._pack_cusparselt, (grid,), args, dict(BLOCK=BLOCK, TRANSPOSE=transpose), warps)
    return out, out_t


def _fake(weight, mask, transpose):
    m, k = weight.shape
    return (
        weight.new_empty((m, k // 2 + k // 16)),
        weight.new_empty((k, m // 2 + m // 16) if transpose else (0, 0)),
    )


PACK = kp_core.op(OP, forward, _fake, package=PACKAGE, spec=SPEC, dtypes=DTYPES)
