"""DCP checkpoints on real processes: a resumed run continues the uninterrupted run's losses exactly, a checkpoint
of 4 ranks loads onto 2, half-written checkpoints are never loaded, another model's checkpoint is refused on
every rank, and export writes the whole model for inference."""

from pathlib import Path

import pytest
import torch
from dist_workers import full_params, make, spawn, train

import kp_distributed


def _run(rank, world, folder, steps, first, save, kw):
    """Shard, resume from folder's latest checkpoint when there is one, train, and save at the end if asked."""
    model = kp_distributed.shard(make(), mixed_precision=None, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = kp_distributed.Checkpointer(folder, keep=2)
    step, extra = ckpt.load(model, opt)
    assert step == first, (step, first)
    losses = train(model, opt, steps, rank, world, first=first)
    if save:
        ckpt.save(first + steps, model, opt, extra={"rank": rank, "rng": torch.get_rng_state()})
    return {"losses": losses, "params": full_params(model), "extra": extra, "steps": ckpt.steps()}


def test_resume_continues_the_same_losses(tmp_path):
    whole = spawn(2, _run, tmp_path / "a", 6, 0, False, {})
    spawn(2, _run, tmp_path / "b", 3, 0, True, {})
    resumed = spawn(2, _run, tmp_path / "b", 3, 3, False, {})
    assert resumed[0]["losses"] == whole[0]["losses"][3:]  # fp32 on the CPU: bit for bit
    for name, p in whole[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], p), name
    assert [r["extra"]["rank"] for r in resumed] == [0, 1]  # each rank's own state back


def test_load_onto_fewer_ranks_reshards(tmp_path):
    four = spawn(4, _run, tmp_path, 2, 0, True, {"strategy": "hybrid"})
    two = spawn(2, _run, tmp_path, 1, 2, False, {})
    # the 2-rank run starts from the 4-rank run's weights and optimizer state: its next step is the one the
    # uninterrupted single-process run takes
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    want = train(model, opt, 3)
    torch.testing.assert_close(torch.tensor(four[0]["losses"] + two[0]["losses"]), torch.tensor(want))
    for name, p in full_params(model).items():
        torch.testing.assert_close(two[0]["params"][name], p, rtol=1e-5, atol=1e-6)
    assert two[0]["extra"] == {} or two[0]["extra"]["rank"] == 0  # ranks 0 and 1 saved; their state returns


def _async(rank, world, folder):
    model = kp_distributed.shard(make(), mixed_precision=None)
    ckpt = kp_distributed.Checkpointer(folder, async_save=True)
    ckpt.save(1, model)
    before = ckpt.latest()  # not complete until wait()
    ckpt.wait()
    return before, ckpt.latest()


def test_async_save_completes_on_wait(tmp_path):
    assert spawn(2, _async, tmp_path) == [(None, 1), (None, 1)]


def _keep_and_partial(rank, world, folder):
    model = kp_distributed.shard(make(), mixed_precision=None)
    ckpt = kp_distributed.Checkpointer(folder, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, model)
    if rank == 0:  # a save killed midway: its files are there, never renamed
        partial = Path(folder) / "step-00000009.tmp"
        partial.mkdir()
        (partial / "__0_0.distcp").write_bytes(b"half")
    torch.distributed.barrier()
    return ckpt.steps(), ckpt.load(model)[0]


def test_partial_checkpoints_are_never_loaded_and_old_ones_pruned(tmp_path):
    assert spawn(2, _keep_and_partial, tmp_path) == [([2, 3], 3)] * 2


def _other_model(rank, world, folder):
    ckpt = kp_distributed.Checkpointer(folder)
    ckpt.save(1, kp_distributed.shard(make(), mixed_precision=None))
    try:
        ckpt.load(kp_distributed.shard(make(dim=8), mixed_precision=None))
    except ValueError as err:
        return str(err)
    return "loaded"


def test_another_models_checkpoint_is_refused_on_every_rank(tmp_path):
    results = spawn(2, _other_model, tmp_path)
    assert results[0] == results[1]
    assert "is a checkpoint of another model" in results[0] and "shapes differ" in results[0]


def _export(rank, world, path):
    model = kp_distributed.shard(make(), mixed_precision=None)
    kp_distributed.export(model, path)
    return full_params(model)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_export_writes_the_whole_model(tmp_path, suffix):
    if suffix == ".safetensors":
        pytest.importorskip("safetensors", reason="the safetensors extra is not installed here")
    path = tmp_path / f"model{suffix}"
    params = spawn(2, _export, path)[0]
    if suffix == ".pt":
        saved = torch.load(path, weights_only=True)
    else:
        from safetensors.torch import load_file

        saved = load_file(str(path))
    assert saved.keys() == params.keys()
    for name, p in params.items():
        assert torch.equal(saved[name], p), name
    plain = make()
    plain.load_state_dict(saved)  # loads into the unsharded model as is


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="keep must be"):
        kp_distributed.Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="step must be"):
        kp_distributed.Checkpointer(tmp_path).save(-1, make())
    with pytest.raises(ValueError, match="no complete checkpoint of step 4"):
        kp_distributed.Checkpointer(tmp_path).load(make(), step=4)
    assert kp_distributed.Checkpointer(tmp_path / "none").load(make()) == (0, {})
