"""shard() on real processes (gloo on CPU; NCCL where GPUs are): FSDP2 and HSDP train exactly as one process does
on the whole batch, with every option, and bad arguments fail alike on every rank."""

import pytest
import torch
from dist_workers import batch, full_params, loss_of, make, spawn, train
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

import kp_distributed

STEPS = 3


def reference(steps=STEPS, first=0, **model_kw):
    model = make(**model_kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return train(model, opt, steps, first=first), full_params(model)


def _sharded(rank, world, kw):
    kw = dict(kw)
    model = kp_distributed.shard(make(**kw.pop("model", {})), **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train(model, opt, STEPS, rank, world)
    w = model.layers[-1].up.weight if hasattr(model, "layers") else model.module.layers[-1].up.weight
    mesh = getattr(w, "device_mesh", None)
    return {
        "losses": losses,
        "params": full_params(model),
        "mesh": None if mesh is None else (tuple(mesh.shape), mesh.mesh_dim_names),
        "local_rows": w.to_local().shape[0] if hasattr(w, "to_local") else w.shape[0],
        "checkpointed": [isinstance(m, CheckpointWrapper) for m in getattr(model, "layers", [])],
    }


def assert_same_training(results, rtol=1e-5, atol=1e-6, **model_kw):
    want_losses, want_params = reference(**model_kw)
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(want_losses), rtol=rtol, atol=atol)
        for name, p in want_params.items():
            torch.testing.assert_close(res["params"][name], p, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_full_sharding_trains_as_one_process_on_the_whole_batch():
    results = spawn(2, _sharded, dict(strategy="full", mixed_precision=None))
    assert_same_training(results)
    assert results[0]["mesh"] == ((2,), ("shard",))
    assert results[0]["local_rows"] == 16  # (32, 16) weight: half on each rank


def test_a_head_tied_to_the_embedding():
    results = spawn(2, _sharded, dict(mixed_precision=None, model=dict(tied=True)))
    assert_same_training(results, tied=True)


def _all_gathers(rank, world, kw):
    """FSDP units all-gathered in the forward and in the backward of the second step (the first settles FSDP).
    Counted at FSDP2's one call per unit (a private name, there in torch 2.11 and 2.13): the collective it then
    calls differs between torch versions."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group

    model = kp_distributed.shard(make(layers=4), mixed_precision=None, **kw)
    count = [0]
    real = group.foreach_all_gather

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    group.foreach_all_gather = counted
    try:
        for step in range(2):
            count[0] = 0
            loss = loss_of(model, batch(step).chunk(world)[rank])
            forward = count[0]
            loss.backward()
    finally:
        group.foreach_all_gather = real
    return forward, count[0] - forward


def test_the_all_gathers_each_step():
    # forward: the root (embedding, norm, head) and 4 blocks. Backward: the root and the last block are kept from
    # the forward, so only blocks 0-2 are gathered again.
    assert spawn(2, _all_gathers, {}) == [(5, 3)] * 2
    # without resharding after the forward nothing is gathered twice
    assert spawn(2, _all_gathers, dict(reshard_after_forward=False)) == [(5, 0)] * 2


def test_hybrid_sharding_on_a_2x2_mesh():
    results = spawn(4, _sharded, dict(strategy="hybrid", mixed_precision=None))
    assert_same_training(results)
    assert results[0]["mesh"] == ((2, 2), ("replicate", "shard"))
    assert results[0]["local_rows"] == 16  # sharded over the 2 ranks of a shard group, not 4


def test_options_prefetch_checkpointing_compile_keep_the_numbers():
    kw = dict(strategy="full", mixed_precision=None, prefetch=2, activation_checkpointing=2)
    kw.update(compile_blocks={"backend": "eager"}, reshard_after_forward=False)
    results = spawn(2, _sharded, kw)
    assert_same_training(results)
    # every 2nd block checkpointed (wrapped in place), the others not
    assert results[0]["checkpointed"] == [True, False, True]


def test_bf16_parameters_fp32_reduction():
    results = spawn(2, _sharded, dict(strategy="full", mixed_precision=("bf16", "fp32")))
    want, _ = reference()
    # bf16 compute: the losses follow fp32's to bf16's precision; the optimizer's parameters stay fp32
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(want), rtol=2e-2, atol=2e-2)
    assert all(p.dtype == torch.float32 for p in results[0]["params"].values())


def test_no_sharding_is_ddp():
    results = spawn(2, _sharded, dict(strategy="none", mixed_precision=None))
    assert_same_training(results)
    assert results[0]["mesh"] is None  # whole parameters


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CPU offload moves parameters off a GPU: GPU only")
def test_cpu_offload():
    results = spawn(min(2, torch.cuda.device_count()), _sharded, dict(mixed_precision=None, offload=True))
    assert_same_training(results)


def _errors(rank, world):
    out = []
    for call in (
        lambda: kp_distributed.make_mesh("hybrid", replicate=3),
        lambda: kp_distributed.shard(torch.nn.Linear(4, 4)),
        lambda: kp_distributed.shard(make(), mixed_precision=("bf16", "int8")),
        lambda: kp_distributed.shard(make(), strategy="zero3"),
        lambda: kp_distributed.shard(make(), prefetch=-1),
        lambda: kp_distributed.shard(make(), activation_checkpointing="some"),
        lambda: kp_distributed.shard(make(), strategy="hybrid", mesh=kp_distributed.make_mesh("full")),
        lambda: kp_distributed.shard(make(), blocks=[torch.nn.Linear(2, 2)], activation_checkpointing="full"),
    ):
        try:
            call()
            out.append("no error")
        except ValueError as err:
            out.append(str(err))
    return out


def test_bad_arguments_fail_alike_on_every_rank():
    results = spawn(4, _errors)
    assert results[0] == results[1] == results[2] == results[3]
    wants = [
        "replicate to divide the world size 4, got replicate=3",
        "no transformer blocks found in Linear",
        "each one of ['bf16', 'fp16', 'fp32'], got ('bf16', 'int8')",
        "strategy must be one of ('full', 'hybrid', 'none'), got 'zero3'",
        "prefetch must be an int >= 0",
        "activation_checkpointing must be None, 'full' or an int",
        "strategy 'hybrid' takes a 2-D DeviceMesh",
        "blocks[0] (Linear) is not a submodule of the model",
    ]
    assert len(results[0]) == len(wants)
    for got, want in zip(results[0], wants):
        assert want in got, (got, want)


def test_find_blocks():
    model = make(layers=4)
    assert kp_distributed.find_blocks(model) == list(model.layers)
    assert kp_distributed.find_blocks(torch.nn.Linear(2, 2)) == []


def test_mesh_needs_a_process_group():
    with pytest.raises(RuntimeError, match="not initialized"):
        kp_distributed.make_mesh("full")
