"""Checkpoints that are complete or absent, and an exact resume.

Layout: ``<run>/checkpoints/step00000120/`` holds the engine's files (DeepSpeed's sharded
``mp_rank_*``/``*_optim_states.pt``, or ``torch_state.pt``), one ``rng_rank<R>.pt`` per rank, and
last of all ``COMPLETE.json``. The marker is written by rank 0 after a barrier, through a
temporary file and an atomic rename, so a run killed while saving leaves a folder without it:
resume ignores such folders and the next save deletes them.

What an exact resume needs, and where it lives: model, optimizer and scheduler (engine files);
step, epoch and batches consumed in the epoch (client state); Python, NumPy, torch CPU and CUDA
generator states (per rank, since each rank draws its own dropout and masking).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from zerotrain.engine import Engine
from zerotrain.errors import UserError

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


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(engine: Engine, ckpt_dir: Path, step: int, client_state: dict[str, Any], keep_last: int) -> Path:
    """Save a checkpoint for ``step`` on every rank; return its folder. Collective."""
    folder = step_folder(ckpt_dir, step)
    if is_complete(folder):
        return folder  # already saved (e.g. a resumed run that had finished): never delete a good checkpoint
    if engine.rank == 0 and folder.exists():
        shutil.rmtree(folder)  # a leftover from a killed save of the same step
    engine.barrier()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        engine.save(folder, client_state)
        torch.save(rng_state(), folder / f"rng_rank{engine.rank}.pt")
    except OSError as exc:
        raise UserError(
            f"could not write checkpoint {folder}: {exc.strerror or exc}. Free disk space or point "
            "--trainer.output_dir at a disk with room; the last complete checkpoint is untouched"
        ) from None
    engine.barrier()
    if engine.rank == 0:
        tmp = folder / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"step": step, "world_size": engine.world_size, **_plain(client_state)}))
        os.replace(tmp, folder / MARKER)
        _prune(ckpt_dir, keep_last)
    engine.barrier()
    return folder


def _plain(client_state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in client_state.items() if isinstance(v, (int, float, str, bool))}


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


def load(engine: Engine, folder: Path) -> dict[str, Any]:
    """Restore engine state and this rank's RNG from ``folder``; return the client state."""
    meta = json.loads((folder / MARKER).read_text())
    if meta.get("world_size") != engine.world_size:
        raise UserError(
            f"--checkpoint.resume: {folder} was written by {meta.get('world_size')} processes, this run has "
            f"{engine.world_size}. Resume with the same number of processes for an exact resume"
        )
    client = engine.load(folder)
    rng_file = folder / f"rng_rank{engine.rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return client
