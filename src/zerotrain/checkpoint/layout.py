"""The on-disk layout of a checkpoint, and its integrity: where a step's files go, the ``COMPLETE.json`` marker
that says they are all there (written last, with every file's size and sha256), and the checks that read it.

Nothing here knows an engine: the checkpointer, resume, export, the launcher's messages and the universal
conversion all read checkpoints through these functions."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Optional

import torch

from zerotrain.data.io import fsync_dir
from zerotrain.errors import UserError
from zerotrain.runtime.collectives import all_gather_object

log = logging.getLogger(__name__)

MARKER = "COMPLETE.json"


FORMAT = 2
"""Version of the marker's content. A marker must list every file of its folder (``"files"``); one that lists
none (format 1 had no list) is treated as damaged, since without a list nothing can be checked."""

STEP_NAME = re.compile(r"step\d+")
"""The name of a checkpoint folder: ``step`` and the step's digits, nothing else (a damaged checkpoint moved
aside, ``step00000040.damaged-...``, is not one)."""

DERIVED = ("universal", ".universal.tmp")
"""Subfolders of a step folder written after its marker (the universal-checkpoint cache, with its own marker):
not in the marker's list, and not a sign of tampering."""


_HASH_CHUNK = 1 << 22


def step_folder(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step{step:08d}"


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint folders (named as :data:`STEP_NAME`), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if STEP_NAME.fullmatch(p.name) and p.is_dir() and is_complete(p))


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


def _files(folder: Path, marker: str = MARKER) -> list[str]:
    """Every file under ``folder`` (relative, sorted), but the marker and temporary files."""
    out = []
    for root, _, names in os.walk(folder):
        for name in names:
            if name == marker or name.endswith(".tmp"):
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


def older_marker(folder: Path) -> Optional[str]:
    """One line saying that the complete checkpoint ``folder`` was written by an older zerotrain (a marker of an
    earlier :data:`FORMAT`, which listed no files), or None.

    Decision: such a checkpoint is neither resumed nor exported (nothing in it can be checked, so it is treated
    as :func:`problem` treats damage), but it is not damaged either: it is not moved aside, and the line says why
    it is refused and what to do, instead of calling it damaged.
    """
    try:
        meta = read_marker(folder)
    except UserError:
        return None
    version = meta.get("format", 1)
    if "files" in meta or not isinstance(version, int) or version >= FORMAT:
        return None
    return (f"{folder} was written by an older zerotrain (its {MARKER} is of format {version} and lists no files, so "
            "nothing in it can be checked); resume or export it with the zerotrain version that wrote it, or start "
            "a new run (another --trainer.run_name)")


def problem(folder: Path, checksums: bool, rank: int = 0, world_size: int = 1) -> Optional[str]:
    """What is wrong with the complete checkpoint ``folder`` (None: nothing). Collective when ``world_size > 1``."""
    try:
        meta = read_marker(folder)
    except UserError as exc:
        return str(exc).removeprefix("--checkpoint.resume: ")
    return listing_problem(folder, meta.get("files"), checksums, rank, world_size, folder / MARKER)


def listing_problem(folder: Path, files: Any, checksums: bool, rank: int = 0, world_size: int = 1,
                    marker: Optional[Path] = None) -> Optional[str]:
    """The first file of ``folder`` that differs from ``files`` (what :func:`seal` returned), or None.

    The listing must be complete: a ``marker`` (named in the answer) without a file list, with an
    empty one, or with names outside ``folder`` is damaged, and so is a file in ``folder`` it does
    not list (one added later would be read by DeepSpeed's loaders unchecked; only the
    :data:`DERIVED` caches are expected). Sizes are compared on every rank (cheap, and every rank
    sees the same answer); checksums are split as in :func:`seal`, and the problems gathered, so
    every rank agrees. Collective when ``world_size > 1`` and ``checksums``.
    """
    found = _listing_shape_problem(folder, files, marker)
    for name, entry in files.items() if found is None else ():
        path = folder / name
        if not path.is_file():
            found = f"{path} is missing"
            break
        size = path.stat().st_size
        if size != entry.get("bytes"):
            found = f"{path} has {size} bytes, {entry.get('bytes')} were written"
            break
    if found is None:
        present = _files(folder, marker.name if marker is not None else MARKER)
        unlisted = next((n for n in present if n not in files and n.split(os.sep)[0] not in DERIVED), None)
        if unlisted is not None:
            found = f"{folder / unlisted} is not among the files its marker lists (was it added after the save?)"
    if found is None and checksums:
        names = sorted(n for n, e in files.items() if "sha256" in e)
        for name in names[rank::world_size]:
            if _sha256(folder / name) != files[name]["sha256"]:
                found = f"{folder / name} does not match its sha256 checksum (the file was damaged after it was written)"
                break
    if world_size > 1 and checksums:
        found = next((p for p in _gather(found, world_size) if p is not None), None)
    return found


def _listing_shape_problem(folder: Path, files: Any, marker: Optional[Path]) -> Optional[str]:
    """What makes ``files`` no complete listing of ``folder`` (None: nothing)."""
    marker = marker or folder
    if not isinstance(files, dict) or not files:
        return f"{marker} lists no files (a marker must list every file with its size), so nothing in it can be checked"
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
            return f"{marker} lists {name!r} without its size"
        parts = Path(name).parts
        if not parts or Path(name).is_absolute() or ".." in parts:
            return f"{marker} lists {name!r}, a file outside {folder}"
    return None


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


def _newest_intact(candidates: list[Path], verify: bool, skipped: list[Path]) -> Optional[Path]:
    """The newest of ``candidates`` (oldest first) without a :func:`problem`; warns about each one skipped and
    adds it to ``skipped``."""
    rank, world_size = _rank_and_size()
    for folder in reversed(candidates):
        found = problem(folder, verify, rank, world_size)
        if found is None:
            return folder
        older = older_marker(folder)  # the same on every rank: each reads the same marker
        if older is not None:
            raise UserError(f"--checkpoint.resume: {older}")
        skipped.append(folder)
        if rank == 0:
            log.warning("checkpoint %s is damaged: %s; falling back to the previous complete checkpoint",
                        folder, found)
    return None


def find_resume_folder(resume: str, run_dir_default: Optional[Path], verify: bool = True) -> Optional[Path]:
    """The checkpoint to resume from (see :func:`resume_folder`), without the damaged ones it skipped."""
    return resume_folder(resume, run_dir_default, verify)[0]


def resume_folder(resume: str, run_dir_default: Optional[Path], verify: bool = True
                  ) -> tuple[Optional[Path], list[Path]]:
    """Resolve ``--checkpoint.resume``: ``auto`` (newest complete in this run, or None), a run folder, or a step
    folder; and the damaged checkpoints skipped on the way, newest first (for :func:`set_aside`).

    The checkpoint found is checked (:func:`problem`: sizes, and checksums with ``verify``); a damaged
    one is skipped for the previous complete one with a warning. A step folder named explicitly is
    not replaced by another: its damage is an error. Collective (all ranks call it) when ``verify``.
    """
    flag = "--checkpoint.resume"
    skipped: list[Path] = []
    if resume == "auto":
        if run_dir_default is None:
            return None, skipped
        found = complete_checkpoints(run_dir_default / "checkpoints")
        if not found:
            return None, skipped
        intact = _newest_intact(found, verify, skipped)
        if intact is None:
            raise UserError(f"{flag} auto: every checkpoint under {run_dir_default / 'checkpoints'} is damaged (see the "
                            "warnings above). Start a new run (another --trainer.run_name)")
        return intact, skipped
    p = Path(resume).expanduser()
    if not p.exists():
        raise UserError(f"{flag}: {p} does not exist. Pass a run folder, one of its checkpoints/step* folders, or auto")
    if is_complete(p):
        rank, world_size = _rank_and_size()
        damage = problem(p, verify, rank, world_size)
        if damage is not None and (older := older_marker(p)) is not None:
            raise UserError(f"{flag}: {older}")
        if damage is not None:
            raise UserError(f"{flag}: {damage}. Pass an older step folder, or the run folder to take the newest "
                            "intact checkpoint")
        return p, skipped
    for candidate in (p / "checkpoints", p):
        found = complete_checkpoints(candidate)
        if found:
            intact = _newest_intact(found, verify, skipped)
            if intact is None:
                raise UserError(f"{flag}: every checkpoint under {candidate} is damaged (see the warnings above)")
            return intact, skipped
    if p.name.startswith("step"):
        raise UserError(f"{flag}: {p} is an incomplete checkpoint (no {MARKER}: the save was interrupted). "
                        "Pass an older step folder or the run folder to take the newest complete one")
    raise UserError(f"{flag}: no complete checkpoint under {p}")


def set_aside(folder: Path) -> Path:
    """Rename the damaged checkpoint ``folder`` to ``<name>.damaged-<UTC time>`` beside it, and return the new path.

    Decision: a damaged checkpoint is moved aside, not deleted, and never deleted by zerotrain: what damaged it
    (a failing disk, a copy cut short, a replaced file) is worth a look, and the bytes may be all that is left of
    a step. Under its new name it is no checkpoint (:data:`STEP_NAME`): it does not count in
    ``--checkpoint.keep_last``, is never resumed, exported or named as the last good checkpoint, and the step it
    held is saved again when training passes it. The warning that names it says it can be deleted.
    """
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = folder.with_name(f"{folder.name}.damaged-{stamp}")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = folder.with_name(f"{folder.name}.damaged-{stamp}-{n}")
    os.rename(folder, target)
    fsync_dir(folder.parent)
    return target
