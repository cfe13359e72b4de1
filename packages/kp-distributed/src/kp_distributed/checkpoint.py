"""Checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, and a checkpoint loads
onto any number of ranks (DCP reshards on load).

Layout: folder/step-00000100/ holds one step's DCP files and kp.json (the step, and every parameter's name and
global shape, to refuse a checkpoint of another model). A save first writes folder/step-00000100.tmp/ and rank 0
renames it once every rank has finished, so a process killed mid-save leaves only a .tmp folder, which latest()
and load() never read (and the next save of that step replaces). The folder must be one file system that every
rank sees (a shared one across nodes), as DCP needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from kp_distributed.mesh import check_model

_STEP = re.compile(r"^step-(\d{8})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def fingerprint(model: nn.Module) -> dict[str, list[int]]:
    """Every parameter's name and global shape (a sharded DTensor's full shape).

    Names drop the prefixes of activation checkpointing, torch.compile and DDP wrappers, as DCP's do.

    Examples:
        >>> import torch
        >>> import kp_distributed
        >>> kp_distributed.fingerprint(torch.nn.Linear(4, 2))
        {'weight': [2, 4], 'bias': [2]}
    """
    check_model("fingerprint", model)
    return {_clean(name): list(p.shape) for name, p in model.named_parameters()}


def _clean(name: str) -> str:
    # the names DCP's state dict uses: without the wrappers' prefixes (activation checkpointing, compile, DDP)
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod.", "module."):
        name = name.replace(prefix, "")
    return name


class Checkpointer:
    """Save and resume training in `folder` (the module docstring).

    ckpt = Checkpointer("ckpt", keep=3)
    step, extra = ckpt.load(model, optimizer)  # (0, {}) when there is none yet
    ...
    ckpt.save(step, model, optimizer, extra={"data": loader_state})

    Each rank's own buffers (plain tensors, not DTensors: float8 delayed scaling's amax histories, which follow
    the rank's activations) are saved per rank too and restored on load with as many ranks; more ranks than
    saved get rank 0's copy (DCP's).

    keep: how many complete checkpoints to keep (older ones are deleted after a save; None keeps all).
    async_save: write in the background (dcp.async_save); the checkpoint is complete once wait() or the next
    save() has returned.

    Args:
        folder: a path every rank sees (str or os.PathLike).
        keep: complete checkpoints kept, or None for all.
        async_save: save in the background.

    `path(step)` is a step's folder, `steps()` the complete ones, `latest()` the newest (None if none).

    Examples:
        On one process, as on every rank of a distributed job (every rank calls save and load):

        >>> import torch
        >>> import kp_distributed
        >>> model = torch.nn.Linear(16, 16)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> ckpt = kp_distributed.Checkpointer("ckpt", keep=2)
        >>> ckpt.load(model, optimizer)  # nothing saved yet
        (0, {})
        >>> ckpt.save(100, model, optimizer, extra={"epoch": 3}).name
        'step-00000100'
        >>> ckpt.latest(), ckpt.load(model, optimizer)
        (100, (100, {'epoch': 3}))
    """

    def __init__(self, folder, *, keep: int | None = 3, async_save: bool = False):
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"Checkpointer: keep must be None or an int >= 1, got {keep!r}")
        if not isinstance(folder, (str, os.PathLike)):
            raise TypeError(f"Checkpointer: folder must be a path (str or os.PathLike), got {type(folder).__name__}")
        self.folder = Path(folder)
        self.keep, self.async_save = keep, async_save
        self._pending = None  # (future, step, fingerprint) of an async save not yet made complete

    def path(self, step: int) -> Path:
        return self.folder / f"step-{step:08d}"

    def _staging(self, step: int) -> Path:
        """Where step's checkpoint is written before it is complete."""
        return self.folder / f"step-{step:08d}.tmp"

    def steps(self) -> list[int]:
        """The steps with a complete checkpoint, oldest first."""
        if not self.folder.is_dir():
            return []
        found = (_STEP.match(p.name) for p in self.folder.iterdir() if p.is_dir())
        return sorted(int(m[1]) for m in found if m and (self.folder / m[0] / "kp.json").is_file())

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, model: nn.Module, optimizer=None, *, extra: dict | None = None) -> Path:
        """Write step's checkpoint: model, optimizer, and extra, this rank's own state (a data loader's
        position, RNG states: tensors, numbers, strings, lists and dicts of them). Every rank must call it."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Checkpointer.save: step must be an int >= 0, got {step!r}")
        self.wait()
        tmp = self._staging(step)
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        # per-rank state (a data loader's position, RNG states) beside DCP's files, one file a rank; and this rank's
        # own buffers (DCP keeps one copy of a plain tensor: rank 0's), e.g. float8 delayed scaling's amax
        # histories, which follow each rank's own activations
        torch.save(extra or {}, tmp / f"extra-{_rank()}.pt")
        torch.save(_local_buffers(model), tmp / f"buffers-{_rank()}.pt")
        state = _state(model, optimizer)
        if self.async_save:
            self._pending = (dcp.async_save(state, checkpoint_id=str(tmp)), step, fingerprint(model))
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._complete(step, fingerprint(model))
        return self.path(step)

    def wait(self) -> None:
        """Finish an async save: wait for this rank's writes, then make the checkpoint complete."""
        if self._pending is not None:
            future, step, prints = self._pending
            self._pending = None
            future.result()
            self._complete(step, prints)

    def _complete(self, step: int, prints: dict) -> None:
        _barrier()  # every rank has written its shards
        if _rank() == 0:
            tmp, final = self._staging(step), self.path(step)
            (tmp / "kp.json").write_text(json.dumps({"step": step, "shapes": prints}))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            if self.keep is not None:
                for old in self.steps()[: -self.keep]:
                    shutil.rmtree(self.path(old), ignore_errors=True)
        _barrier()

    def load(self, model: nn.Module, optimizer=None, *, step: int | None = None) -> tuple[int, dict]:
        """Load step's checkpoint (default: the latest) into model and optimizer, whatever the number of ranks
        that wrote it; returns (step, this rank's extra: {} where no rank of that number saved), or (0, {}) when
        the folder holds no checkpoint. Raises ValueError on every rank when the checkpoint is another model's
        (parameter names or shapes differ)."""
        step = self.latest() if step is None else step
        if step is None:
            return 0, {}
        where = self.path(step)
        if not (where / "kp.json").is_file():
            raise ValueError(f"Checkpointer.load: no complete checkpoint of step {step} in {self.folder}")
        saved = json.loads((where / "kp.json").read_text())["shapes"]
        _check_same_model(saved, fingerprint(model), where)
        state = _state(model, optimizer)
        dcp.load(state, checkpoint_id=str(where))
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(model, state["model"])
        buffers = where / f"buffers-{_rank()}.pt"  # absent when more ranks load than saved: rank 0's copy stays
        if buffers.is_file():
            own = dict(model.named_buffers())
            with torch.no_grad():
                for name, value in torch.load(buffers, weights_only=True).items():
                    if name in own and own[name].shape == value.shape:
                        own[name].copy_(value)
        mine = where / f"extra-{_rank()}.pt"  # absent when more ranks load than saved
        return step, torch.load(mine, weights_only=True) if mine.is_file() else {}


def _local_buffers(model: nn.Module) -> dict:
    """The model's buffers held whole on each rank (not DTensors), as this rank has them."""
    return {name: b.detach().to("cpu", copy=True) for name, b in model.named_buffers() if not isinstance(b, DTensor)}


def _state(model, optimizer) -> dict:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _check_same_model(saved: dict, current: dict, where: Path) -> None:
    missing = sorted(set(saved) - set(current))
    unexpected = sorted(set(current) - set(saved))
    shapes = sorted(n for n in set(saved) & set(current) if saved[n] != current[n])
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"{len(missing)} saved tensors the model lacks (first: {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} model tensors the checkpoint lacks (first: {unexpected[0]})")
        if shapes:
            n = shapes[0]
            parts.append(f"{len(shapes)} shapes differ (first: {n}: saved {saved[n]}, model {current[n]})")
        raise ValueError(f"Checkpointer.load: {where} is a checkpoint of another model: " + "; ".join(parts))


def export(model: nn.Module, path) -> None:
    """Write the whole model's weights, unsharded, to one file on rank 0 for inference: safetensors where the
    path ends in .safetensors (needs the safetensors package), else torch.save. Every rank must call it (the
    shards are gathered).

    Examples:
        >>> import torch
        >>> import kp_distributed
        >>> model = torch.nn.Linear(16, 8)  # a sharded model the same way, on every rank
        >>> kp_distributed.export(model, "export/model.pt")
        >>> {name: tuple(t.shape) for name, t in torch.load("export/model.pt").items()}
        {'weight': (8, 16), 'bias': (8,)}
    """
    check_model("export", model)
    path = Path(path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if _rank() == 0:
        state = {_clean(k): v.contiguous() for k, v in state.items()}
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(state, str(path))
        else:
            torch.save(state, path)
    _barrier()
