"""kp-sparsity's pruning and packing beyond the conformance spec: the kernel and the PyTorch reference path agree,
and kp's packed weight multiplies on the GPU exactly as torch's own semi-structured tensor. Tensors are made on
the device under test."""

import pytest
import torch
import torch.nn.functional as F

import kp_core
import kp_sparsity
from kp_sparsity.ops import prune as prune_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = "interpret" if kp_core.interpreter_enabled() else kp_core.TRITON


def weight(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_and_reference_path_agree(dtype, monkeypatch):
    w = weight(96, 192, dtype)
    scale = torch.rand(192, device=DEVICE)

    def calls():
        return [
            kp_sparsity.mask_2_4(w, column_scale=scale),
            kp_sparsity.prune_2_4(w),
            *kp_sparsity.pack_2_4(w),
            kp_sparsity.mask_2_4(w, column_scale=scale, transposable=True),  # no near ties in these blocks
        ]

    with kp_core.record_launches() as rec:
        got = calls()
    assert rec.backends(prune_mod.OP) == rec.backends(prune_mod.OP_T) == {KERNEL}
    monkeypatch.setenv("KP_BACKEND", "reference")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with kp_core.record_launches() as rec:
        want = calls()
    assert rec.backends(prune_mod.OP) == rec.backends(prune_mod.OP_T) == {kp_core.REFERENCE}
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_unpack_inverts_pack():
    w = weight(64, 128, torch.bfloat16, seed=1)
    assert torch.equal(kp_sparsity.unpack_2_4(*kp_sparsity.pack_2_4(w)), kp_sparsity.prune_2_4(w))


def sm() -> int:
    return torch.cuda.get_device_capability()[0] if DEVICE == "cuda" else 0


@pytest.mark.skipif(DEVICE != "cuda", reason="2:4 sparse tensor cores: GPU only")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["cutlass", "cusparselt"])
def test_to_sparse_2_4_multiplies_as_torch_semi_structured(dtype, backend):
    """F.linear with kp's sparse weight equals F.linear with torch's own semi-structured tensor of the same pruned
    weight, bit for bit (same data, same kernel), and the dense product of the pruned weight within fp rounding.
    torch runs CUTLASS's 2:4 matmul on sm80 only; cuSPARSELt where torch was built with it."""
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    if backend == "cutlass" and sm() != 8:
        pytest.skip("not covered here: torch's CUTLASS 2:4 matmul runs on sm80 only")
    if backend == "cusparselt" and not torch.backends.cusparselt.is_available():
        pytest.skip("not covered here: torch was built without cuSPARSELt")
    w = weight(256, 512, dtype, seed=2)
    x = weight(64, 512, dtype, seed=3)
    with kp_core.record_launches() as rec:
        sparse = kp_sparsity.to_sparse_2_4(w, backend=backend)
    assert rec.backends(prune_mod.OP) == {KERNEL}
    torch_type = SparseSemiStructuredTensorCUTLASS if backend == "cutlass" else SparseSemiStructuredTensorCUSPARSELT
    assert isinstance(sparse, torch_type)
    ours = F.linear(x, sparse)
    theirs = F.linear(x, torch_type.from_dense(kp_sparsity.prune_2_4(w)))
    assert torch.equal(ours, theirs)
    dense = F.linear(x.double(), kp_sparsity.prune_2_4(w).double())
    torch.testing.assert_close(ours.double(), dense, rtol=2e-2, atol=2e-2)


def test_to_sparse_2_4_backend_is_checked():
    with pytest.raises(ValueError, match="backend must be"):
        kp_sparsity.to_sparse_2_4(weight(32, 64, torch.float16), backend="dense")
