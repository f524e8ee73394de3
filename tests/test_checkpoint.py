"""The checkpointer: when it saves, what a complete folder holds, pruning, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerotrain.checkpoint import MARKER, Checkpointer, complete_checkpoints, find_resume_folder, state_file, step_folder
from zerotrain.config import CheckpointConfig
from zerotrain.errors import UserError
from zerotrain.train_state import TrainState


class FakeEngine:
    """One rank; its 'sharded state' is one tensor file."""

    rank, world_size = 0, 1

    def __init__(self):
        self.weight = torch.arange(4.0)

    def barrier(self) -> None: ...

    def save(self, folder: Path) -> None:
        torch.save({"w": self.weight}, folder / "engine.pt")

    def load(self, folder: Path) -> None:
        self.weight = torch.load(folder / "engine.pt", weights_only=True)["w"]


def checkpointer(tmp_path: Path, **cfg) -> Checkpointer:
    return Checkpointer(CheckpointConfig(**cfg), tmp_path, FakeEngine(), TrainState())


def test_should_save_every_n_steps_and_at_the_end_once(tmp_path):
    ck = checkpointer(tmp_path, every_steps=3, save_final=True)
    assert [s for s in range(1, 10) if ck.should_save(s)] == [3, 6, 9]
    assert ck.should_save(10, last_step=True)
    ck.state.step = 9
    ck.save()
    assert not ck.should_save(9, last_step=True)  # the final step was just saved
    assert not checkpointer(tmp_path, every_steps=0, save_final=False).should_save(5, last_step=True)


def test_save_writes_engine_state_marker_last_and_prunes(tmp_path):
    ck = checkpointer(tmp_path, every_steps=1, keep_last=2)
    for step in (1, 2, 3):
        ck.state.step = step
        folder = ck.save()
        assert json.loads((folder / MARKER).read_text())["step"] == step
        assert state_file(folder, 0).is_file() and (folder / "engine.pt").is_file()
    assert [p.name for p in complete_checkpoints(tmp_path / "checkpoints")] == ["step00000002", "step00000003"]


def test_debris_of_a_killed_save_is_removed_and_never_resumed(tmp_path):
    ck = checkpointer(tmp_path, every_steps=1, keep_last=3)
    ck.state.step = 2
    ck.save()
    debris = step_folder(tmp_path / "checkpoints", 1)  # older, no marker: a save that was killed
    debris.mkdir()
    killed_later = step_folder(tmp_path / "checkpoints", 5)
    killed_later.mkdir()
    assert find_resume_folder("auto", tmp_path) == step_folder(tmp_path / "checkpoints", 2)
    ck.state.step = 3
    ck.save()
    assert not debris.exists()
    with pytest.raises(UserError, match="incomplete checkpoint"):
        find_resume_folder(str(killed_later), None)


def test_load_restores_engine_and_state(tmp_path):
    ck = checkpointer(tmp_path)
    ck.state.advance(0.5, epoch=2, batches_in_epoch=4)
    folder = ck.save()
    fresh = checkpointer(tmp_path)
    fresh.engine.weight = torch.zeros(4)
    fresh.load(folder)
    assert torch.equal(fresh.engine.weight, torch.arange(4.0))
    assert fresh.state.plain() == {"step": 1, "epoch": 2, "batches_in_epoch": 4}
    assert not fresh.should_save(1, last_step=True)  # resumed at its own checkpoint: nothing to rewrite


def test_missing_train_state_is_refused_not_resumed_inexactly(tmp_path):
    ck = checkpointer(tmp_path)
    folder = ck.save()
    state_file(folder, 0).unlink()
    with pytest.raises(UserError, match="train_state_rank0.pt is missing"):
        checkpointer(tmp_path).load(folder)


def test_another_process_count_is_refused(tmp_path):
    folder = checkpointer(tmp_path).save()
    meta = json.loads((folder / MARKER).read_text())
    (folder / MARKER).write_text(json.dumps({**meta, "world_size": 2}))
    with pytest.raises(UserError, match="written by 2 processes"):
        checkpointer(tmp_path).load(folder)
