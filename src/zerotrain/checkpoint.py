"""Checkpoints that are complete or absent, an exact resume, and the component that decides when to save.

Layout: ``<run>/checkpoints/step00000120/`` holds the engine's files (DeepSpeed's sharded
``mp_rank_*``/``*_optim_states.pt``, or ``torch_state.pt``), one ``train_state_rank<R>.pt`` per rank
(:class:`~zerotrain.train_state.TrainState`: step, data position, log window, RNG), and last of all
``COMPLETE.json``. The marker is written by rank 0 after a barrier, through a temporary file and an
atomic rename, so a run killed while saving leaves a folder without it: resume ignores such folders
and the next save deletes them.

The split of an exact resume: model, optimizer and scheduler are the engine's (they are sharded
differently by every ZeRO stage); everything else is the train state's. :class:`Checkpointer` is
the only code that writes or reads either.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from zerotrain.config import CheckpointConfig
from zerotrain.data.io import atomic_write_text
from zerotrain.engine import Engine
from zerotrain.errors import UserError
from zerotrain.train_state import TrainState

MARKER = "COMPLETE.json"


def step_folder(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step{step:08d}"


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step") and is_complete(p))


def state_file(folder: Path, rank: int) -> Path:
    return folder / f"train_state_rank{rank}.pt"


class Checkpointer:
    """Saves ``engine`` + ``state`` every ``cfg.every_steps`` steps and at the end; resumes them.

    Every method is collective: all ranks call it at the same step.
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, engine: Engine, state: TrainState):
        self.cfg, self.engine, self.state = cfg, engine, state
        self.dir = run_dir / "checkpoints"
        self.last_saved: Optional[int] = None
        """Step of the newest checkpoint this run wrote or resumed from."""

    def should_save(self, step: int, last_step: bool = False) -> bool:
        if step == self.last_saved:
            return False  # e.g. a resumed run that had finished: never rewrite its checkpoint
        if last_step:
            return self.cfg.save_final
        return bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0

    def save(self) -> Path:
        """Write a checkpoint of the current step; return its folder."""
        rank, step = self.engine.rank, self.state.step
        folder = step_folder(self.dir, step)
        if is_complete(folder):
            # Written before (a resume from an older checkpoint replays the same steps exactly):
            # never delete a good checkpoint.
            self.last_saved = step
            return folder
        if rank == 0 and folder.exists():
            shutil.rmtree(folder)  # a leftover from a killed save of the same step
        self.engine.barrier()
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.engine.save(folder)
            torch.save(self.state.state_dict(), state_file(folder, rank))
        except OSError as exc:
            raise UserError(
                f"could not write checkpoint {folder}: {exc.strerror or exc}. Free disk space or point "
                "--trainer.output_dir at a disk with room; the last complete checkpoint is untouched"
            ) from None
        self.engine.barrier()
        if rank == 0:
            meta = {"world_size": self.engine.world_size, **self.state.plain()}
            atomic_write_text(folder / MARKER, json.dumps(meta))
            _prune(self.dir, self.cfg.keep_last)
        self.engine.barrier()
        self.last_saved = step
        return folder

    def load(self, folder: Path) -> None:
        """Restore the engine and this rank's train state from ``folder``."""
        meta = json.loads((folder / MARKER).read_text())
        if meta.get("world_size") != self.engine.world_size:
            raise UserError(
                f"--checkpoint.resume: {folder} was written by {meta.get('world_size')} processes, this run has "
                f"{self.engine.world_size}. Resume with the same number of processes for an exact resume"
            )
        mine = state_file(folder, self.engine.rank)
        if not mine.is_file():
            raise UserError(f"--checkpoint.resume: {mine} is missing, so the run cannot continue exactly. "
                            "Pass an older checkpoint folder, or start a new run")
        self.engine.load(folder)
        self.state.load_state_dict(torch.load(mine, weights_only=True))
        self.last_saved = self.state.step


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    complete = complete_checkpoints(ckpt_dir)
    doomed = complete[:-keep_last]
    newest = complete[-1] if complete else None
    for p in ckpt_dir.iterdir():
        # Incomplete folders older than the newest complete one are debris of killed saves.
        if p.is_dir() and not is_complete(p) and newest is not None and p.name < newest.name:
            doomed.append(p)
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)


def find_resume_folder(resume: str, run_dir_default: Optional[Path]) -> Optional[Path]:
    """Resolve ``--checkpoint.resume``: ``auto`` (newest complete in this run, or None), a run folder, or a step folder."""
    flag = "--checkpoint.resume"
    if resume == "auto":
        if run_dir_default is None:
            return None
        found = complete_checkpoints(run_dir_default / "checkpoints")
        return found[-1] if found else None
    p = Path(resume).expanduser()
    if not p.exists():
        raise UserError(f"{flag}: {p} does not exist. Pass a run folder, one of its checkpoints/step* folders, or auto")
    if is_complete(p):
        return p
    for candidate in (p / "checkpoints", p):
        found = complete_checkpoints(candidate)
        if found:
            return found[-1]
    if p.name.startswith("step"):
        raise UserError(f"{flag}: {p} is an incomplete checkpoint (no {MARKER}: the save was interrupted). "
                        "Pass an older step folder or the run folder to take the newest complete one")
    raise UserError(f"{flag}: no complete checkpoint under {p}")
