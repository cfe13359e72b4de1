"""kp-sparsity: 2:4 structured sparsity for PyTorch: masks, pruning, packing, sparse linears and a router."""

from kp_sparsity.activations import SparseActivationLinear
from kp_sparsity.functional import mask_2_4, pack_2_4, prune_2_4, to_sparse_2_4, unpack_2_4
from kp_sparsity.linear import Decision, SparseLinear, sparsify
from kp_sparsity.training import SparseTrainingLinear, sparsify_for_training

__all__ = [
    "Decision",
    "SparseActivationLinear",
    "SparseLinear",
    "SparseTrainingLinear",
    "mask_2_4",
    "pack_2_4",
    "prune_2_4",
    "sparsify",
    "sparsify_for_training",
    "to_sparse_2_4",
    "unpack_2_4",
]
__version__ = "0.1.1"
