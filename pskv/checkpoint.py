"""Resumable training: a directory with one checkpoint per completed epoch, ``epoch-N/`` holding the
model's weights (``model.pt``), the optimizer's states, read from the servers when they run it
(``optimizer.pt``), and the caller's progress (``progress.json``). Each is written as
``epoch-N.tmp``, flushed to disk and renamed into place, so a job killed at any moment (the machine too)
leaves the last complete one; a job resumed from it may have another number of workers or servers
(docs/SPEC.md, "Resuming"). To resume:
:func:`latest` and :func:`load_weights` before making the Trainer (it sends worker 0's weights to the
servers), :func:`load_states` after; :func:`save` after each epoch (as pskv/app/train.py does)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from . import optim
from .errors import TrainerError
from .trainer import Trainer

PREFIX = "epoch-"


def _epoch(path: Path) -> int:
    tail = path.name[len(PREFIX) :]
    return int(tail) if path.name.startswith(PREFIX) and tail.isdigit() else -1


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest(directory: Union[str, Path]) -> Optional[Path]:
    """The newest complete checkpoint in ``directory``; None if it has none."""
    done = [p for p in Path(directory).glob(f"{PREFIX}*") if _epoch(p) >= 0 and (p / "progress.json").is_file()]
    return max(done, key=_epoch, default=None)


def save(directory: Union[str, Path], epoch: int, model: nn.Module, trainer: Trainer, progress: dict[str, Any], writer: int = 0) -> None:
    """Every worker calls this at the same point, after ``epoch`` epochs: worker ``writer`` writes the
    checkpoint while the others wait at a barrier (the servers' states are read while no one
    pushes); older checkpoints are then removed."""
    kv = trainer.kvstore
    trainer.synchronize()  # with the exchange overlapped, the last step's weights may still be coming
    if kv is None or kv.rank == writer:
        final = Path(directory) / f"{PREFIX}{epoch}"
        temp = final.with_name(final.name + ".tmp")
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
        torch.save(model.state_dict(), temp / "model.pt")
        trainer.save_states(temp / "optimizer.pt")
        (temp / "progress.json").write_text(json.dumps({**progress, "epoch": epoch}) + "\n")
        for path in [*temp.iterdir(), temp]:  # on disk before the rename (else a crash of the machine can leave
            _fsync(path)  # the renamed files empty, and the checkpoint before is removed below)
        shutil.rmtree(final, ignore_errors=True)
        temp.rename(final)
        _fsync(final.parent)  # the rename itself
        for old in Path(directory).glob(f"{PREFIX}*"):
            if old != final and (0 <= _epoch(old) < epoch or old.name.endswith(".tmp")):
                shutil.rmtree(old, ignore_errors=True)
    if kv is not None:
        kv.barrier()


def load_weights(path: Path, models: Sequence[nn.Module]) -> dict[str, Any]:
    """Put the weights of checkpoint ``path`` into each of ``models``; the progress it saved (with
    ``"epoch"``, the epochs done). Call it before making the Trainer, which sends these weights."""
    try:
        weights = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
        progress: dict[str, Any] = json.loads((path / "progress.json").read_text())
        for m in models:
            m.load_state_dict(weights)
    except (OSError, RuntimeError, ValueError) as exc:
        raise TrainerError(f"cannot resume from {path}: {exc}") from None
    return progress


def load_states(path: Path, trainer: Trainer, updates: Optional[int] = None) -> None:
    """Every worker: the optimizer's states of checkpoint ``path`` (onto the servers when they run it;
    the schedule goes on from the saved step), then a barrier, so no one pushes before they are in.
    ``updates``: the step to go on from instead, where the epochs done take another number of steps now
    (another number of workers): the saved counts are scaled to it, so the schedule is where it was."""
    with tempfile.TemporaryDirectory() as temp:
        file = path / "optimizer.pt"
        if updates is not None and (state := optim.load_states(file))["num_update"] not in (0, updates):  # (read to scale)
            scale, state["num_update"] = updates / state["num_update"], updates
            for key in state["keys"].values():
                key["step"] = max(1, round(key["step"] * scale)) if key["step"] else 0
            torch.save(state, file := Path(temp) / "optimizer.pt")
        trainer.load_states(file)
    if trainer.kvstore is not None:
        trainer.kvstore.barrier()
