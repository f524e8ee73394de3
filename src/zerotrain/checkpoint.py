"""Checkpoints that are complete and intact or not used, an exact resume, and the component that decides when to save.

Layout: ``<run>/checkpoints/step00000120/`` holds the engine's files (DeepSpeed's sharded
``mp_rank_*``/``*_optim_states.pt``, or ``torch_state.pt``), one ``train_state_rank<R>.pt`` per rank
(:class:`~zerotrain.train_state.TrainState`: step, data position, log window, RNG), and last of all
``COMPLETE.json``.

What makes a checkpoint trustworthy:

* **Complete.** After a barrier (every rank has written its files) every file is fsynced, then the
  folder; only then rank 0 writes the marker, through a temporary file and an atomic rename. A run
  killed while saving leaves a folder without it: resume ignores such folders, the next save deletes them.
* **Intact.** The marker lists every file with its size and sha256 (hashed on all ranks, each a
  share of the files, as they are fsynced). Resume checks the sizes always and, with
  ``--checkpoint.verify`` (the default), the checksums; a damaged checkpoint is named with the file
  and skipped for the previous complete one, with a warning.
* **Of this run's shape.** The marker records recipe, backend, ZeRO stage, precision, micro-batch,
  gradient accumulation and world size; :func:`check_compatible` refuses a resume that would silently
  continue differently, before anything in the run folder is rewritten.
* **Of any process count.** A resume on another world size keeps micro-batch x processes (the global
  batch and its data order, see :func:`check_compatible`) and is resharded by :meth:`Checkpointer.load`:
  ZeRO-1/2/3 through DeepSpeed's universal checkpoint, converted once and cached in
  ``<step>/universal/`` with its own marker (:func:`zerotrain.universal.universal_checkpoint`).
* **Loaded without running code.** zerotrain's own files load with ``weights_only=True``; the engine
  loads DeepSpeed's through an allow-list (see ``engine.py``). A file that is not what it should be
  ends in one :class:`UserError` line naming it.

The split of an exact resume: model, optimizer and scheduler are the engine's (they are sharded
differently by every ZeRO stage); everything else is the train state's. :class:`Checkpointer` is
the only code that writes or reads either.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from zerotrain import rundir
from zerotrain.config import CheckpointConfig
from zerotrain.data.io import atomic_write_text, fsync_dir
from zerotrain.distributed import run_on_main
from zerotrain.engine import Engine
from zerotrain.errors import UserError
from zerotrain.train_state import TrainState, load_safely

log = logging.getLogger("zerotrain")

MARKER = "COMPLETE.json"
FORMAT = 2
"""Version of the marker's content. 1: step and world size only (read without file checks)."""

SHAPE_KEYS = ("recipe", "backend", "zero_stage", "precision", "weights_dtype", "micro_batch_size", "grad_accum",
              "world_size")
"""What a resume must match (see :func:`check_compatible`)."""

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


def shape_of(engine: Engine, recipe: str) -> dict[str, Any]:
    """How this run trains, in the terms a checkpoint records (see :data:`SHAPE_KEYS`)."""
    ds = engine.ds_config
    return {
        "recipe": recipe,
        "backend": "deepspeed" if ds is not None else "ddp",
        "zero_stage": int(ds.get("zero_optimization", {}).get("stage", 0)) if ds is not None else None,
        "precision": engine.precision,
        # bf16 at ZeRO-0 keeps fp32 weights under the fast path's autocast and bf16 ones under DeepSpeed's
        # bf16 block: the same precision, different files.
        "weights_dtype": str(next(engine.module.parameters()).dtype).removeprefix("torch."),
        "micro_batch_size": int(engine.micro_batch_size),
        "grad_accum": int(engine.grad_accum),
        "world_size": int(engine.world_size),
    }


HARMLESS_MODEL_FIELDS = frozenset({"dropout", "lora_dropout", "merge_on_export", "init_from_mlm"})
"""Model settings that change no tensor's name or shape: a resume may change them."""


def check_same_model(checkpoint: Path, recipe: str, cfg: Any) -> None:
    """Raise a one-line :class:`UserError` when ``checkpoint`` was written by a run of another recipe or
    with other model settings than ``cfg`` (the ``--model.*`` flags that change tensors' names or shapes).

    The run that wrote a checkpoint left its config in ``hparams.json`` beside ``checkpoints/``. This
    runs before anything is built, so a wrong resume is refused at once; :func:`check_compatible`
    checks how the engine was set up once it exists, also before the run folder is rewritten."""
    hparams = checkpoint.parent.parent / "hparams.json"
    try:
        saved = json.loads(hparams.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # nothing to compare with (a checkpoint copied alone): the engine's loader decides
    if not isinstance(saved, dict):
        return
    theirs = saved.get("recipe")
    if theirs is not None and theirs != recipe:
        raise UserError(f"--checkpoint.resume: {checkpoint} was written by a {theirs} run, and this is a {recipe} "
                        f"run. Resume with zerotrain fit {saved.get('task') or theirs}, or start a new run (another "
                        "--trainer.run_name)")
    model = getattr(cfg, "model", None)
    old = saved.get("model")
    if not (dataclasses.is_dataclass(model) and isinstance(old, dict)):
        return
    now = json.loads(json.dumps(dataclasses.asdict(model), default=str))  # tuples as lists, as the file has them
    changed = [f"--model.{k} {now[k]} (the checkpoint's run had {old[k]})" for k in now
               if k in old and k not in HARMLESS_MODEL_FIELDS and now[k] != old[k]]
    if changed:
        raise UserError(f"--checkpoint.resume: {checkpoint} holds another model: {'; '.join(changed)}. Pass the "
                        "run's own model flags (its hparams.json has them) or start a new run")


def check_compatible(folder: Path, shape: dict[str, Any]) -> None:
    """Refuse, in one line, a resume from ``folder`` by a run of another ``shape`` (see :func:`shape_of`).

    Called before anything in the run folder is rewritten. Each difference would continue the run
    silently wrong or crash in the engine: accumulation sets the global batch the schedule and
    optimizer state were made for; the engine's files are sharded by stage and backend, and
    precision decides which of them hold the master weights.

    **Another process count** is converted (see :meth:`Checkpointer.load`), under one rule: the
    global batch and its data order stay exactly as they were, so micro-batch x processes must
    stay the same (and accumulation, as always). The sampler plans global batches of micro x world
    examples and cuts one micro-batch per rank, and the data position counts those global
    micro-steps: with micro x world unchanged the new ranks continue at the same samples, the same
    optimizer step, the same schedule. 2 processes x micro 8 resume on 1 process with
    ``--trainer.micro_batch_size 16`` (or on 4 with 4); any other micro-batch is refused with the
    flag to pass. Changing accumulation instead (2 x 8 x accum 1 -> 1 x 8 x accum 2: the same
    global batch) is refused too: it would split each step's samples differently (and, with
    length bucketing, plan other batches), and accumulation stays one of the checked keys. On the
    same process count the micro-batch must be the checkpoint's (the position counts micro-batches).
    """
    meta = read_marker(folder)
    flag = "--checkpoint.resume"
    how = {
        "recipe": "resume it with its own recipe",
        "backend": "pass --strategy.backend {saved}",
        "zero_stage": "pass --strategy.zero_stage {saved}",
        "precision": "pass --precision.dtype {saved}",
        "weights_dtype": "resume with the --strategy.fast_path and --precision.dtype of the run that wrote it",
        "micro_batch_size": "pass --trainer.micro_batch_size {saved} (the data position counts micro-batches)",
        "grad_accum": "pass --strategy.gradient_accumulation_steps {saved}",
    }
    resharding = "world_size" in meta and meta["world_size"] != shape.get("world_size")
    for key in SHAPE_KEYS:
        if key not in meta or key == "world_size" or (resharding and key == "micro_batch_size"):
            continue  # a marker of format 1 records the world size only; another world size: below
        saved, now = meta[key], shape.get(key)
        if saved != now:
            raise UserError(f"{flag}: {folder} was written with {key} {saved}, this run has {now}; "
                            f"{how[key].format(saved=saved)}, or start a new run (another --trainer.run_name)")
    if resharding:
        check_global_batch(folder, meta, shape)


def check_global_batch(folder: Path, meta: dict[str, Any], shape: dict[str, Any]) -> None:
    """The rule of :func:`check_compatible` for a resume on another process count, in one line when broken."""
    flag, world, now_world = "--checkpoint.resume", meta["world_size"], shape.get("world_size")
    if "micro_batch_size" not in meta:
        raise UserError(f"{flag}: {folder} was written by {world} processes and does not record its micro-batch "
                        f"size, so it cannot be resumed on {now_world}. Start it with {world} processes")
    micro, now_micro = meta["micro_batch_size"], shape.get("micro_batch_size")
    accum = meta.get("grad_accum", shape.get("grad_accum"))
    per_step = micro * world  # examples of one micro-step over all ranks
    if now_micro * now_world == per_step:
        return
    if per_step % now_world == 0:
        fix = f"pass --trainer.micro_batch_size {per_step // now_world}"
    else:
        fix = f"use a process count that divides {per_step}"
    raise UserError(f"{flag}: {folder} was written by {world} processes x micro-batch {micro} (global batch "
                    f"{per_step * accum}), this run has {now_world} x {now_micro} (global batch "
                    f"{now_micro * now_world * accum}). A resume on another process count keeps micro-batch x "
                    f"processes = {per_step}: {fix}, or start it with {world} processes")


# ---- integrity -------------------------------------------------------------------------------
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
    from zerotrain.distributed import all_gather_object

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


def estimate_bytes(n_params: int, n_trainable: int, precision: str, backend: str) -> int:
    """One checkpoint's size, estimated from the model before training: the weights in their training
    precision, plus per trainable parameter Adam's two fp32 moments and, under DeepSpeed, the fp32
    master copy (which a 16-bit run keeps besides its 16-bit weights)."""
    weight = 2 if precision in ("bf16", "fp16") else 4
    per_trainable = 8 + (4 if backend == "deepspeed" else 0)
    return n_params * weight + n_trainable * per_trainable


def preflight_space(run_dir: Path, needed: int) -> None:
    """Refuse to start when one checkpoint clearly does not fit on the output disk (rank 0)."""
    free = rundir.free_bytes(run_dir)
    if free is not None and needed > free:
        raise UserError(f"--trainer.output_dir: {run_dir.parent} has {rundir.fmt_bytes(free)} free, one checkpoint "
                        f"needs about {rundir.fmt_bytes(needed)}. Free disk space, point --trainer.output_dir at a "
                        "bigger disk, or train without checkpoints (--checkpoint.save_final false)")


class Checkpointer:
    """Saves ``engine`` + ``state`` every ``cfg.every_steps`` steps and at the end; resumes them.

    Every method is collective: all ranks call it at the same step. ``shape`` (see :func:`shape_of`)
    is recorded in each marker.
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: Path, engine: Engine, state: TrainState,
                 shape: Optional[dict[str, Any]] = None):
        self.cfg, self.engine, self.state = cfg, engine, state
        self.dir = run_dir / "checkpoints"
        self.shape = dict(shape or {"world_size": engine.world_size})
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
            # A leftover from a killed save of the same step; what cannot be removed fails the writes below.
            shutil.rmtree(folder, ignore_errors=True)
        self.engine.barrier()
        error = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.engine.save(folder)
            torch.save(self.state.state_dict(), state_file(folder, rank))
        except (OSError, RuntimeError) as exc:
            error = self._write_error(folder, exc)
        # Every rank learns whether one failed, so none waits in the next barrier for a rank that stopped.
        error = next((e for e in _gather(error, self.engine.world_size) if e is not None), None)
        if error is not None:
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)  # frees the space; the older checkpoints stay
            raise UserError(error)
        self.engine.barrier()
        try:
            files = seal(folder, rank, self.engine.world_size, self.cfg.verify)
        except OSError as exc:  # a full disk met while syncing: seal made every rank raise it
            raise UserError(self._write_error(folder, exc)) from None

        def mark() -> None:
            try:
                meta = {"format": FORMAT, **self.shape, **self.state.plain(), "files": files}
                atomic_write_text(folder / MARKER, json.dumps(meta, indent=1))
                _prune(self.dir, self.cfg.keep_last)
            except OSError as exc:
                raise UserError(self._write_error(folder, exc)) from None

        run_on_main(mark)  # rank 0 writes the marker; its error stops every rank, none waits
        self.last_saved = step
        return folder

    def save_if_preempted(self, preemption: Any) -> None:
        """At a step boundary: when every rank agrees a stop signal came (zerotrain.preemption), save
        and raise :class:`~zerotrain.preemption.Preempted`, which ends the run with its exit status."""
        if preemption is None or not preemption.should_stop(self.engine.device):
            return
        from zerotrain.preemption import Preempted

        folder = self.save()
        log.info("pre-empted by %s at step %d: checkpoint %s", preemption.name(), self.state.step, folder)
        raise Preempted(preemption.name(), folder, self.state.step)

    def _write_error(self, folder: Path, exc: BaseException) -> str:
        previous = complete_checkpoints(self.dir)
        keep = f"; the last complete checkpoint {previous[-1]} is untouched" if previous else ""
        if rundir.is_space_error(exc):
            needed = checkpoint_bytes(previous[-1]) if previous else None
            return str(rundir.space_error(f"checkpoint {folder.name}", folder.parent, needed, keep))
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else " ".join(str(exc).split())[:300]
        return f"could not write checkpoint {folder}: {detail}{keep}"

    def load(self, folder: Path, seed: int = 0) -> None:
        """Restore the engine and this rank's train state from ``folder``.

        A checkpoint written by another number of processes (admitted by :func:`check_compatible`)
        is resharded: the engine loads its state onto this world size
        (:meth:`~zerotrain.engine.Engine.load_resharded`: the plain engine as it is, ZeRO through
        a universal checkpoint converted once and cached, see :func:`zerotrain.universal.universal_checkpoint`), and
        the train state continues at the same step and samples with RNG re-seeded from (``seed``,
        step, rank) (:meth:`~zerotrain.train_state.TrainState.load_resharded`); one line says so.
        """
        meta = read_marker(folder)
        saved_world = meta.get("world_size")
        if saved_world != self.engine.world_size:
            self._load_resharded(folder, meta, seed)
            return
        mine = state_file(folder, self.engine.rank)
        if not mine.is_file():
            raise UserError(f"--checkpoint.resume: {mine} is missing, so the run cannot continue exactly. "
                            "Pass an older checkpoint folder, or start a new run")
        self.engine.load(folder)
        self.state.load_state_dict(load_safely(mine))
        self.last_saved = self.state.step

    def _load_resharded(self, folder: Path, meta: dict[str, Any], seed: int) -> None:
        saved_world = meta.get("world_size")
        if not isinstance(saved_world, int) or saved_world < 1:
            raise UserError(f"--checkpoint.resume: {folder / MARKER} does not record the process count that wrote "
                            "it. Pass another checkpoint folder")
        check_global_batch(folder, meta, {**self.shape, "world_size": self.engine.world_size})
        files = [state_file(folder, r) for r in range(saved_world)]
        missing = next((f for f in files if not f.is_file()), None)
        if missing is not None:
            raise UserError(f"--checkpoint.resume: {missing} is missing, so the run cannot continue exactly. "
                            "Pass an older checkpoint folder, or start a new run")
        states = [load_safely(f) for f in files]
        self.engine.load_resharded(folder, saved_world, self.cfg.verify)
        self.state.load_resharded(states, seed, self.engine.rank)
        self.last_saved = self.state.step
        if self.engine.rank == 0:
            log.warning("resumed on %d process(es) from a checkpoint of %d: exact in weights, optimizer state, "
                        "schedule, step and data order, but not in dropout randomness (re-seeded from "
                        "seed, step and rank)", self.engine.world_size, saved_world)


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
