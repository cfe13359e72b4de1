"""Gradient compression on DDP replicas (real processes), and the overlap account of profiler intervals."""

import pytest
import torch
from dist_workers import full_params, make, spawn, train

import kp_distributed


def _compressed(rank, world, kind):
    model = kp_distributed.shard(make(), strategy="none", mixed_precision=None)
    state = kp_distributed.compress(model, kind, rank=2, start_iter=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train(model, opt, 6, rank, world)
    return {"losses": losses, "params": full_params(model), "state": type(state).__name__}


def reference(steps=6):
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return train(model, opt, steps), full_params(model)


def _bf16_on_gloo(rank, world):
    try:
        kp_distributed.compress(kp_distributed.shard(make(), strategy="none"), "bf16")
    except ValueError as err:
        return str(err)
    return "no error"


def test_bf16_compression_needs_nccl():
    assert spawn(2, _bf16_on_gloo) == ["compress: 'bf16' needs NCCL (torch's hook), the group runs gloo"] * 2


def _powersgd_on_cpu_with_cuda(rank, world):
    model = kp_distributed.shard(make(), strategy="none", mixed_precision=None)
    torch.cuda.is_available = lambda: True  # this worker process only: a machine with GPUs, CPU gradients
    try:
        kp_distributed.compress(model, "powersgd")
    except ValueError as err:
        return str(err)
    return "no error"


def test_powersgd_on_cpu_gradients_with_cuda_available_is_refused(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # CPU processes on a GPU machine too
    for message in spawn(2, _powersgd_on_cpu_with_cuda):
        assert message.startswith("compress: 'powersgd' needs the gradients on the GPU when CUDA is available")


@pytest.mark.parametrize("kind", ["fp16", "powersgd"])
def test_compressed_gradients_train(kind, monkeypatch):
    # CPU processes: torch's PowerSGD hook calls torch.cuda.synchronize on the gradients' device whenever CUDA is
    # available, which fails for CPU gradients; so the workers see no GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    results = spawn(2, _compressed, kind)
    want, want_params = reference()
    # replicas stay identical: every rank applies the same all-reduced (compressed) gradient
    for name, p in results[0]["params"].items():
        assert torch.equal(results[1]["params"][name], p), name
    if kind == "powersgd":  # exact for the first 2 steps, then a rank-2 approximation with error feedback
        torch.testing.assert_close(torch.tensor(results[0]["losses"][:3]), torch.tensor(want[:3]))
        assert results[0]["losses"][-1] < results[0]["losses"][0] and results[0]["state"] == "PowerSGDState"
    else:  # the all-reduce in half precision: AdamW's steps follow fp32's closely
        torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(want), rtol=1e-2, atol=1e-2)


def test_compress_bad_arguments():
    with pytest.raises(TypeError, match="must be a DistributedDataParallel"):
        kp_distributed.compress(make(), "fp16")


def test_overlap_counts_the_union_of_spans():
    spans = [
        ("gemm", 0, 10),
        ("elementwise", 8, 12),  # compute: [0, 12] and [20, 30]
        ("gemm", 20, 30),
        ("ncclDevKernel_AllGather", 5, 15),  # comm: [5, 15] and [18, 22]: 7 + 2 hidden of 12
        ("ncclDevKernel_ReduceScatter", 18, 22),
    ]
    got = kp_distributed.overlap(spans)
    assert got == {"comm": 14, "compute": 22, "overlapped": 9, "hidden": 9 / 14}
    assert kp_distributed.overlap([("gemm", 0, 1)])["hidden"] == 1.0
