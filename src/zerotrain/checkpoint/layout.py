"""The on-disk layout of a checkpoint, and its integrity: where a step's files go, the ``COMPLETE.json`` marker
that says they are all there (written last, with every file's size and sha256), and the checks that read it.

Nothing here knows an engine: the checkpointer, resume, export, the launcher's messages and the universal
conversion all read checkpoints through these functions."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from zerotrain.data.io import fsync_dir
from zerotrain.errors import UserError
from zerotrain.runtime.collectives import all_gather_object

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"


FORMAT = 2
"""Version of the marker's content. 1: step and world size only (read without file checks)."""


_HASH_CHUNK = 1 << 22


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


def read_marker(folder: Path) -> dict[str, Any]:
    """The marker's JSON; a UserError naming it when it cannot be read."""
    try:
        meta = json.loads((folder / MARKER).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"--checkpoint.resume: {folder / MARKER} cannot be read ({exc}). "
                        "Pass an older checkpoint folder") from None
    if not isinstance(meta, dict):
        raise UserError(f"--checkpoint.resume: {folder / MARKER} is not a checkpoint marker. Pass an older checkpoint folder")
    return meta


def _files(folder: Path) -> list[str]:
    """Every regular file under ``folder`` (relative, sorted), but the marker and temporary files."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            if name == MARKER or name.endswith(".tmp"):
                continue
            out.append(str((Path(root) / name).relative_to(folder)))
    return sorted(out)


def _sha256(path: Path, fsync: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())  # a read-only descriptor syncs the file's dirty pages too
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _gather(obj: Any, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    return all_gather_object(obj)


def seal(folder: Path, rank: int, world_size: int, checksums: bool) -> dict[str, dict[str, Any]]:
    """fsync every file of ``folder`` and return ``{file: {"bytes", "sha256"?}}`` on every rank. Collective.

    Each rank takes every world_size-th file, so hashing a large checkpoint is spread over the job.
    """
    names = _files(folder)
    mine: dict[str, Any] = {}
    try:
        for name in names[rank::world_size]:
            path = folder / name
            entry: dict[str, Any] = {"bytes": path.stat().st_size}
            if checksums:
                entry["sha256"] = _sha256(path, fsync=True)
            else:
                _fsync(path)
            mine[name] = entry
    except OSError as exc:
        mine = {_FAILED: exc}  # still joins the gather below: every rank raises, none waits
    parts = _gather(mine, world_size)
    failed = next((p[_FAILED] for p in parts if _FAILED in p), None)
    if failed is not None:
        raise failed
    listing: dict[str, dict[str, Any]] = {}
    for part in parts:
        listing.update(part)
    for root, _, _ in os.walk(folder):
        fsync_dir(Path(root))
    return dict(sorted(listing.items()))


_FAILED = "\0failed"  # never a file name


def problem(folder: Path, checksums: bool, rank: int = 0, world_size: int = 1) -> Optional[str]:
    """What is wrong with the complete checkpoint ``folder`` (None: nothing). Collective when ``world_size > 1``."""
    try:
        meta = read_marker(folder)
    except UserError as exc:
        return str(exc).removeprefix("--checkpoint.resume: ")
    files = meta.get("files")
    if not isinstance(files, dict):
        return None  # format 1: nothing recorded to compare with
    return listing_problem(folder, files, checksums, rank, world_size)


def listing_problem(folder: Path, files: dict[str, dict[str, Any]], checksums: bool, rank: int = 0,
                    world_size: int = 1) -> Optional[str]:
    """The first file of ``folder`` that differs from ``files`` (what :func:`seal` returned), or None.

    Sizes are compared on every rank (cheap, and every rank sees the same answer); checksums are
    split as in :func:`seal`, and the problems gathered, so every rank agrees. Collective when
    ``world_size > 1`` and ``checksums``.
    """
    found = None
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            found = f"{path} is missing"
            break
        size = path.stat().st_size
        if size != entry.get("bytes"):
            found = f"{path} has {size} bytes, {entry.get('bytes')} were written"
            break
    if found is None and checksums:
        names = sorted(n for n, e in files.items() if "sha256" in e)
        for name in names[rank::world_size]:
            if _sha256(folder / name) != files[name]["sha256"]:
                found = f"{folder / name} does not match its sha256 checksum (the file was damaged after it was written)"
                break
    if world_size > 1 and checksums:
        found = next((p for p in _gather(found, world_size) if p is not None), None)
    return found


def checkpoint_bytes(folder: Path) -> Optional[int]:
    """The bytes a checkpoint takes, as its marker lists them (None: not recorded)."""
    try:
        files = read_marker(folder).get("files")
    except UserError:
        return None
    return sum(int(e.get("bytes", 0)) for e in files.values()) if isinstance(files, dict) else None


def _rank_and_size() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _newest_intact(candidates: list[Path], verify: bool) -> Optional[Path]:
    """The newest of ``candidates`` (oldest first) without a :func:`problem`; warns about each one skipped."""
    rank, world_size = _rank_and_size()
    for folder in reversed(candidates):
        found = problem(folder, verify, rank, world_size)
        if found is None:
            return folder
        if rank == 0:
            log.warning("checkpoint %s is damaged: %s; falling back to the previous complete checkpoint",
                        folder, found)
    return None


def find_resume_folder(resume: str, run_dir_default: Optional[Path], verify: bool = True) -> Optional[Path]:
    """Resolve ``--checkpoint.resume``: ``auto`` (newest complete in this run, or None), a run folder, or a step folder.

    The checkpoint found is checked (:func:`problem`: sizes, and checksums with ``verify``); a damaged
    one is skipped for the previous complete one with a warning. A step folder named explicitly is
    not replaced by another: its damage is an error. Collective (all ranks call it) when ``verify``.
    """
    flag = "--checkpoint.resume"
    if resume == "auto":
        if run_dir_default is None:
            return None
        found = complete_checkpoints(run_dir_default / "checkpoints")
        if not found:
            return None
        intact = _newest_intact(found, verify)
        if intact is None:
            raise UserError(f"{flag} auto: every checkpoint under {run_dir_default / 'checkpoints'} is damaged (see the "
                            "warnings above). Start a new run (another --trainer.run_name)")
        return intact
    p = Path(resume).expanduser()
    if not p.exists():
        raise UserError(f"{flag}: {p} does not exist. Pass a run folder, one of its checkpoints/step* folders, or auto")
    if is_complete(p):
        rank, world_size = _rank_and_size()
        damage = problem(p, verify, rank, world_size)
        if damage is not None:
            raise UserError(f"{flag}: {damage}. Pass an older step folder, or the run folder to take the newest "
                            "intact checkpoint")
        return p
    for candidate in (p / "checkpoints", p):
        found = complete_checkpoints(candidate)
        if found:
            intact = _newest_intact(found, verify)
            if intact is None:
                raise UserError(f"{flag}: every checkpoint under {candidate} is damaged (see the warnings above)")
            return intact
    if p.name.startswith("step"):
        raise UserError(f"{flag}: {p} is an incomplete checkpoint (no {MARKER}: the save was interrupted). "
                        "Pass an older step folder or the run folder to take the newest complete one")
    raise UserError(f"{flag}: no complete checkpoint under {p}")
