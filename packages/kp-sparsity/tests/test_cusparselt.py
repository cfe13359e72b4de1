"""kp::pack_2_4_cusparselt: the kernel against its reference path, and (GPU) against cuSPARSELt's own compression
bit for bit, with the packed weight multiplying as torch's own. Tensors are made on the device under test."""

import pytest
import torch
import torch.nn.functional as F

import kp_core
import kp_sparsity
from kp_sparsity.ops import cusparselt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL = "interpret" if kp_core.interpreter_enabled() else kp_core.TRITON
SHAPES = [(64, 64), (128, 192), (192, 320)]


def case(m, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    # no exact zeros: cuSPARSELt may encode a kept 0 at another index of its group (the same matrix either way)
    w = torch.where(w == 0, torch.ones_like(w), w)
    return w, kp_sparsity.mask_2_4(w, transposable=True)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_and_reference_path_agree(shape, dtype, monkeypatch):
    w, mask = case(*shape, dtype)
    with kp_core.record_launches() as rec:
        packed, packed_t = cusparselt.PACK(w, mask, True)
        alone, empty = cusparselt.PACK(w, mask, False)
    assert rec.backends(cusparselt.OP) == {KERNEL}
    assert torch.equal(alone, packed) and empty.numel() == 0
    assert packed.shape == (shape[0], shape[1] // 2 + shape[1] // 16)
    want = cusparselt.reference_pack(w, mask)
    want_t = cusparselt.reference_pack(w.t().contiguous(), mask.t().contiguous())
    assert torch.equal(packed.view(torch.int16), want.view(torch.int16))
    assert torch.equal(packed_t.view(torch.int16), want_t.view(torch.int16))
    # the values half is the kept entries in row-major order
    assert torch.equal(packed.flatten()[: w.numel() // 2], w[mask])


@pytest.mark.skipif(DEVICE != "cuda", reason="cuSPARSELt: GPU only")
@pytest.mark.parametrize("shape", SHAPES + [(4096, 1024)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_equals_cusparselt_compression_bit_for_bit(shape, dtype):
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT

    w, mask = case(*shape, dtype, seed=1)
    w_s = torch.where(mask, w, torch.zeros_like(w))
    packed, packed_t = cusparselt.PACK(w, mask, True)
    for ours, theirs in ((packed, torch._cslt_compress(w_s)), (packed_t, torch._cslt_compress(w_s.t().contiguous()))):
        differ = (ours.view(torch.int16) != theirs.view(torch.int16)).flatten()
        values = ours.shape[0] * (ours.shape[1] * 8 // 9)  # entries of the values half
        assert not differ.any(), (
            f"{int(differ[:values].sum())} values and {int(differ[values:].sum())} metadata words differ, "
            f"first at {int(differ.nonzero()[0])} of {differ.numel()}"
        )
    ours = SparseSemiStructuredTensorCUSPARSELT(w.shape, packed, None, packed_t, None, None, requires_grad=False)
    theirs = SparseSemiStructuredTensorCUSPARSELT.from_dense(w_s)
    x = torch.randn(96, shape[1], device=DEVICE, dtype=dtype)
    assert torch.equal(F.linear(x, ours), F.linear(x, theirs))
    dy = torch.randn(96, shape[0], device=DEVICE, dtype=dtype)
    theirs_t = SparseSemiStructuredTensorCUSPARSELT.from_dense(w_s.t().contiguous())
    assert torch.equal(torch.mm(dy, ours), F.linear(dy, theirs_t))
