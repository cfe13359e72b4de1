"""kp-sparsity's functions: 2:4 masks, pruning and packing of (out_features, in_features) weights."""

import torch

import kp_core
from kp_sparsity.ops import prune as prune_op


def _check(fn: str, weight, column_scale, packed: bool):
    kp_core.check_tensor(fn, "weight", weight, dtypes=prune_op.PACK_DTYPES if packed else prune_op.DTYPES, ndim=2)
    m, k = weight.shape
    if k % 4:
        raise ValueError(f"{fn}: weight's last dimension (in_features) must be a multiple of 4, got {k}")
    if packed and (m % 32 or k % 64):
        raise ValueError(
            f"{fn}: packing for CUTLASS needs weight of shape (a multiple of 32, a multiple of 64), got {(m, k)}"
        )
    if column_scale is not None:
        kp_core.check_tensor(fn, "column_scale", column_scale, dtypes=(torch.float32,), device=weight.device, ndim=1)
        kp_core.check_shape(fn, "column_scale", column_scale, (k,))
        column_scale = column_scale.contiguous()
    return column_scale


def mask_2_4(
    weight: torch.Tensor, *, column_scale: torch.Tensor | None = None, transposable: bool = False
) -> torch.Tensor:
    """The 2:4 keep mask of weight (M, K) along K: per group of 4, the 2 largest |w| (times column_scale[k] when
    given: Wanda's |w| * ||x_k||), ties to the lower index, NaN kept. Bool, weight's shape.

    transposable: 2:4 along K and along M at once (the weight and its transpose both 2:4, so the backward's
    matmul with W^T is sparse too): per 4 x 4 block, of the 90 patterns with 2 kept in every row and column, the
    one whose scores sum highest (the first in the documented order on a tie). M a multiple of 4 too.

    Args:
        weight: (M, K), K a multiple of 4; float16, bfloat16 or float32.
        column_scale: (K,) float32 on weight's device, or None.
        transposable: also 2:4 along M.

    Examples:
        >>> import torch
        >>> import kp_sparsity
        >>> w = torch.tensor([[0.1, -3.0, 2.0, 0.5, 1.0, 1.0, -1.0, 0.0]])
        >>> kp_sparsity.mask_2_4(w)
        tensor([[False,  True,  True, False,  True,  True, False, False]])
        >>> m = kp_sparsity.mask_2_4(torch.randn(64, 128), transposable=True)
        >>> bool((m.view(64, 32, 4).sum(-1) == 2).all()), bool((m.t().reshape(128, 16, 4).sum(-1) == 2).all())
        (True, True)
    """
    column_scale = _check("kp_sparsity.mask_2_4", weight, column_scale, packed=False)
    if transposable:
        if weight.shape[0] % 4:
            raise ValueError(
                f"kp_sparsity.mask_2_4: a transposable mask needs weight's rows a multiple of 4, got {weight.shape[0]}"
            )
        return prune_op.MASK_T(weight, column_scale)
    return prune_op.PRUNE(weight, column_scale, True, False, False)[0]


def prune_2_4(
    weight: torch.Tensor, *, column_scale: torch.Tensor | None = None, transposable: bool = False
) -> torch.Tensor:
    """weight with the entries mask_2_4 drops set to 0 (a new tensor; weight is not changed).

    Args:
        weight: (M, K), K a multiple of 4 (M too when transposable); float16, bfloat16 or float32.
        column_scale: (K,) float32 on weight's device (Wanda's activation norms), or None.
        transposable: a mask that is also 2:4 along M.

    Returns:
        weight's shape and dtype.

    Examples:
        >>> import torch
        >>> import kp_sparsity
        >>> w = torch.randn(64, 128, dtype=torch.bfloat16)
        >>> pruned = kp_sparsity.prune_2_4(w, column_scale=torch.rand(128))  # Wanda: |w| * ||x_k||
        >>> pruned.dtype, int((pruned != 0).view(64, 32, 4).sum(-1).max())
        (torch.bfloat16, 2)
    """
    if transposable:
        mask = mask_2_4(weight, column_scale=column_scale, transposable=True)
        return torch.where(mask, weight, torch.zeros_like(weight))
    column_scale = _check("kp_sparsity.prune_2_4", weight, column_scale, packed=False)
    return prune_op.PRUNE(weight, column_scale, False, True, False)[1]


def pack_2_4(weight: torch.Tensor, *, column_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """weight pruned to 2:4 and packed in one pass, for CUTLASS's sparse GEMM: (values (M, K / 2) in weight's
    dtype, meta (M, K / 16) int16 in CUTLASS's reordered layout), what torch's SparseSemiStructuredTensorCUTLASS
    holds. fp16 / bf16, M a multiple of 32, K of 64.

    Args:
        weight: (M, K), float16 or bfloat16, M a multiple of 32 and K of 64.
        column_scale: (K,) float32 on weight's device, or None.

    Examples:
        >>> import torch
        >>> import kp_sparsity
        >>> w = torch.randn(64, 128, dtype=torch.float16)
        >>> values, meta = kp_sparsity.pack_2_4(w)
        >>> values.shape, meta.shape, meta.dtype
        (torch.Size([64, 64]), torch.Size([64, 8]), torch.int16)
    """
    column_scale = _check("kp_sparsity.pack_2_4", weight, column_scale, packed=True)
    _, _, values, meta = prune_op.PRUNE(weight, column_scale, False, False, True)
    return values, meta


def unpack_2_4(values: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The dense (M, K) weight that (values, meta) hold, zeros elsewhere (PyTorch's own CUTLASS conversion).

    Args:
        values: (M, K / 2), float16 or bfloat16, K / 2 a multiple of 8.
        meta: (M, K / 16) int16 on values' device.

    Examples:
        >>> import torch
        >>> import kp_sparsity
        >>> w = torch.randn(64, 128, dtype=torch.bfloat16)
        >>> torch.equal(kp_sparsity.unpack_2_4(*kp_sparsity.pack_2_4(w)), kp_sparsity.prune_2_4(w))
        True
    """
    from torch.sparse._semi_structured_conversions import sparse_semi_structured_to_dense_cutlass

    kp_core.check_tensor("kp_sparsity.unpack_2_4", "values", values, dtypes=prune_op.PACK_DTYPES, ndim=2)
    kp_core.check_tensor("kp_sparsity.unpack_2_4", "meta", meta, dtypes=(torch.int16,), device=values.device, ndim=2)
    if values.shape[1] % 8:
        raise ValueError(
            f"kp_sparsity.unpack_2_4: values must have a multiple of 8 columns (K / 2), got shape {tuple(values.shape)}"
        )
    kp_core.check_shape("kp_sparsity.unpack_2_4", "meta", meta, (values.shape[0], values.shape[1] // 8))
    return sparse_semi_structured_to_dense_cutlass(values, meta)


def to_sparse_2_4(weight: torch.Tensor, *, column_scale: torch.Tensor | None = None, backend: str | None = None):
    """weight pruned to 2:4 by kp as one of torch's semi-structured sparse tensors, for F.linear / torch.mm on a GPU
    with sparse tensor cores. backend "cutlass": kp also packs it (one pass) into SparseSemiStructuredTensorCUTLASS,
    whose matmul torch runs on sm80 only; "cusparselt": cuSPARSELt compresses kp's pruned weight into its own
    format (SparseSemiStructuredTensorCUSPARSELT, sm80 and sm90). None: as torch's to_sparse_semi_structured picks,
    cuSPARSELt where torch was built with it.

    Args:
        weight: (M, K), float16 or bfloat16, M a multiple of 32 and K of 64.
        column_scale: (K,) float32 on weight's device, or None.
        backend: "cutlass", "cusparselt" or None.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> import kp_sparsity
        >>> w = torch.randn(4096, 4096, dtype=torch.float16, device="cuda")  # needs a GPU with sparse tensor cores
        >>> x = torch.randn(2048, 4096, dtype=torch.float16, device="cuda")
        >>> y = F.linear(x, kp_sparsity.to_sparse_2_4(w))  # x @ prune_2_4(w).T on sparse tensor cores
    """
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    if backend is None:
        backend = "cusparselt" if torch.backends.cusparselt.is_available() else "cutlass"
    if backend not in ("cutlass", "cusparselt"):
        raise ValueError(f"kp_sparsity.to_sparse_2_4: backend must be 'cutlass', 'cusparselt' or None, got {backend!r}")
    if backend == "cutlass":
        values, meta = pack_2_4(weight, column_scale=column_scale)
        return SparseSemiStructuredTensorCUTLASS(weight.shape, values, meta, None, None, None, requires_grad=False)
    column_scale = _check("kp_sparsity.to_sparse_2_4", weight, column_scale, packed=True)
    pruned = prune_op.PRUNE(weight, column_scale, False, True, False)[1]
    return SparseSemiStructuredTensorCUSPARSELT.from_dense(pruned)
