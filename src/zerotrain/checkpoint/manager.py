"""Checkpoints that are complete and intact or not used, an exact resume, and the component that decides when to save.

Layout: ``<run>/checkpoints/step00000120/`` holds the engine's files (DeepSpeed's sharded
``mp_rank_*``/``*_optim_states.pt``, or ``torch_state.pt``), one ``train_state_rank<R>.pt`` per rank
(:class:`~zerotrain.train.state.TrainState`: step, data position, log window, RNG), and last of all
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
* **Of the same run.** Every setting is compared with the run's ``hparams.json`` (:func:`check_same_config`):
  one that changes the model, the data stream or the numerics is refused, naming it.
* **Of any process count.** A resume on another world size keeps the global batch, accumulation following
  (:func:`keep_global_batch`, :func:`check_compatible`), and is resharded by :meth:`Checkpointer.load`:
  ZeRO-1/2/3 through DeepSpeed's universal checkpoint, converted once and cached in
  ``<step>/universal/`` with its own marker (:func:`zerotrain.checkpoint.universal.universal_checkpoint`).
* **Of another engine**, where one can load it (:func:`crosses_engines`): ZeRO-1/2/3 under FSDP2, FSDP2 under
  DeepSpeed or the plain engine, through the same universal checkpoint (from FSDP2's DCP files by
  :func:`zerotrain.checkpoint.universal.universal_from_dcp`); any other crossing is refused in one line.
* **Loaded without running code.** zerotrain's own files load with ``weights_only=True``; the engine
  loads DeepSpeed's through an allow-list (see ``engine.py``). A file that is not what it should be
  ends in one :class:`UserError` line naming it.

The split of an exact resume: model, optimizer and scheduler are the engine's (they are sharded
differently by every ZeRO stage); everything else is the train state's. :class:`Checkpointer` is
the only code that writes or reads either.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from zerotrain.checkpoint.layout import (
    FORMAT,
    MARKER,
    STEP_NAME,
    _gather,
    checkpoint_bytes,
    complete_checkpoints,
    is_complete,
    read_marker,
    seal,
    state_file,
    step_folder,
)
from zerotrain.checkpoint.universal import universal_checkpoint, universal_from_dcp
from zerotrain.config import CheckpointConfig, resume_changes, upgrade_layout
from zerotrain.config.ds_config import batch_shape, load_user_config
from zerotrain.data.io import atomic_write_text
from zerotrain.engines.base import Engine
from zerotrain.errors import UserError
from zerotrain.runtime import rundir
from zerotrain.runtime.collectives import run_on_main
from zerotrain.runtime.preemption import Preempted
from zerotrain.train.state import TrainState, load_safely

log = logging.getLogger("zerotrain")

SHAPE_KEYS = ("recipe", "backend", "zero_stage", "precision", "weights_dtype", "micro_batch_size", "grad_accum",
              "world_size")
"""What a resume must match (see :func:`check_compatible`)."""

def shape_of(engine: Engine, recipe: str) -> dict[str, Any]:
    """How this run trains, in the terms a checkpoint records (see :data:`SHAPE_KEYS`)."""
    ds = engine.ds_config
    return {
        "recipe": recipe,
        "backend": engine.backend,
        "zero_stage": int(ds.get("zero_optimization", {}).get("stage", 0)) if ds is not None else None,
        "precision": engine.precision,
        # bf16 at ZeRO-0 keeps fp32 weights under the fast path's autocast and bf16 ones under DeepSpeed's
        # bf16 block: the same precision, different files.
        "weights_dtype": str(next(engine.module.parameters()).dtype).removeprefix("torch."),
        "micro_batch_size": int(engine.micro_batch_size),
        "grad_accum": int(engine.grad_accum),
        "world_size": int(engine.world_size),
    }


def check_same_config(checkpoint: Path, recipe: str, cfg: Any, skip: frozenset[str] = frozenset(),
                      ds_config: Optional[dict[str, Any]] = None) -> list[str]:
    """Refuse in one :class:`UserError` line a resume from ``checkpoint`` by a run of another recipe, or with a
    setting changed that shapes the model, the data stream or the numerics; return the changes that do not
    (``--trainer.max_steps 8 -> 12``), for the caller to say in one line.

    The run that wrote a checkpoint left its config in ``hparams.json`` beside ``checkpoints/``; which change
    is safe each config section declares (:func:`zerotrain.config.resume_changes`), so the check covers every
    setting of every recipe. ``skip``: settings not resolved yet (what a DeepSpeed file sets, before the
    engine reads it). ``ds_config``: this run's DeepSpeed JSON, whose ``optimizer`` and ``scheduler`` blocks
    must be the recorded ``ds_config.json``'s where a file of the user's set them. Called before anything is
    built and again once the engine exists, both before anything in the run folder is rewritten."""
    run = checkpoint.parent.parent
    try:
        saved = json.loads((run / "hparams.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # nothing to compare with (a checkpoint copied alone): the engine's loader decides
    if not isinstance(saved, dict):
        return []
    theirs = saved.get("recipe")
    if theirs is not None and theirs != recipe:
        raise UserError(f"--checkpoint.resume: {checkpoint} was written by a {theirs} run, and this is a {recipe} "
                        f"run. Resume with zerotrain fit {saved.get('task') or theirs}, or start a new run (another "
                        "--trainer.run_name)")
    safe, unsafe = resume_changes(upgrade_layout(saved), cfg, skip)
    if ds_config is not None and getattr(cfg.strategy, "deepspeed_config", None):
        try:
            recorded = json.loads((run / "ds_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            recorded = None
        for block in ("optimizer", "scheduler") if isinstance(recorded, dict) else ():
            before, now = _without_length(recorded.get(block)), _without_length(ds_config.get(block))
            if before != now:
                unsafe.append((f"the {block} block of --strategy.deepspeed_config", json.dumps(before), json.dumps(now)))
    if unsafe:
        said = "; ".join(f"{flag} {_shown(old)}, this run has {_shown(new)}" for flag, old, new in unsafe)
        raise UserError(f"--checkpoint.resume: {checkpoint} was trained with {said}. A resume keeps what shapes the "
                        "model, the data and the numerics: pass the recorded values (the run's hparams.json has "
                        "them all), or start a new run (another --trainer.run_name)")
    return [f"{flag} {_shown(old)} -> {_shown(new)}" for flag, old, new in safe if flag != "--checkpoint.resume"]


def _without_length(block: Any) -> Any:
    """A DeepSpeed optimizer or scheduler block without its ``total_num_steps``: the run's length, which a resume
    may change (as --trainer.max_steps)."""
    if isinstance(block, dict) and isinstance(block.get("params"), dict):
        return {**block, "params": {k: v for k, v in block["params"].items() if k != "total_num_steps"}}
    return block


def _shown(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_compatible(folder: Path, shape: dict[str, Any]) -> None:
    """Refuse, in one line, a resume from ``folder`` by a run of another ``shape`` (see :func:`shape_of`).

    Called before anything in the run folder is rewritten. Each difference would continue the run
    silently wrong or crash in the engine: the engine's files are sharded by stage and backend, and
    precision decides which of them hold the master weights; on the same process count the micro-batch
    and accumulation must be the checkpoint's (the data position counts micro-batches).

    **Another process count** is converted (see :meth:`Checkpointer.load`), under one rule: the global
    batch (micro-batch x accumulation x processes) stays what it was, and so do the samples of every
    optimizer step. The sampler plans each epoch's optimizer steps from the global batch alone and cuts
    each into micro-steps of micro x processes examples (:class:`~zerotrain.data.sampling.EpochBatches`),
    and the resumed position is converted to the new micro-steps: 2 processes x micro 8 continue on 1
    process as micro 8 x accumulation 2 (set by :func:`keep_global_batch` before the engine is built). What
    changes is where the sums happen (one reduction more or less), a few float32 ulps.
    """
    meta = read_marker(folder)
    flag = "--checkpoint.resume"
    how = {
        "recipe": "resume it with its own recipe",
        "zero_stage": "pass --strategy.zero_stage {saved}",
        "precision": "pass --precision.dtype {saved}",
        "weights_dtype": "resume with the --strategy.fast_path and --precision.dtype of the run that wrote it",
        "micro_batch_size": "pass --trainer.micro_batch_size {saved} (the data position counts micro-batches)",
        "grad_accum": "pass --strategy.gradient_accumulation_steps {saved}",
    }
    resharding = "world_size" in meta and meta["world_size"] != shape.get("world_size")
    across = crosses_engines(meta, shape)
    for key in SHAPE_KEYS:
        if key not in meta or key == "world_size" or (resharding and key in ("micro_batch_size", "grad_accum")):
            continue  # a marker of format 1 records the world size only; another world size: below
        if across and key in ("backend", "zero_stage", "weights_dtype"):
            continue  # loaded through the consolidated fp32 state, whatever each engine keeps
        saved, now = meta[key], shape.get(key)
        if key == "backend" and saved != now:
            was, this = _engine_named(saved, meta.get("zero_stage")), _engine_named(now, shape.get("zero_stage"))
            raise UserError(f"{flag}: {folder} was written by {was}, which this run ({this}) cannot load (across "
                            f"engines zerotrain resumes {ACROSS_ENGINES}); pass --strategy.backend {saved}"
                            + (f" --strategy.zero_stage {meta['zero_stage']}" if saved == "deepspeed" else "")
                            + ", or start a new run (another --trainer.run_name)")
        if saved != now:
            raise UserError(f"{flag}: {folder} was written with {key} {saved}, this run has {now}; "
                            f"{how[key].format(saved=saved)}, or start a new run (another --trainer.run_name)")
    if resharding:
        check_global_batch(folder, meta, shape)


ACROSS_ENGINES = "ZeRO-1/2/3 -> fsdp2, fsdp2 -> deepspeed (ZeRO-0/1/2/3) or ddp"
"""The crossings :func:`crosses_engines` admits, as the refusal of any other names them."""


def crosses_engines(meta: dict[str, Any], shape: dict[str, Any]) -> bool:
    """Whether a checkpoint of ``meta`` is resumed by a run of ``shape`` under another engine, one that can load it
    through DeepSpeed's universal checkpoint (every parameter's fp32 weights and optimizer states whole;
    :meth:`~zerotrain.engines.base.Engine.load_universal`): a DeepSpeed ZeRO-1/2/3 checkpoint under FSDP2, an
    FSDP2 checkpoint under DeepSpeed (any stage) or the plain engine (see :data:`ACROSS_ENGINES`). ZeRO-0 and the
    plain engine keep other files (their optimizer state in one file), which no converter reads yet."""
    saved, now = meta.get("backend"), shape.get("backend")
    if saved == "deepspeed":
        return meta.get("zero_stage") in (1, 2, 3) and now == "fsdp2"
    return saved == "fsdp2" and now in ("deepspeed", "ddp")


def _engine_named(backend: Any, stage: Any) -> str:
    return f"deepspeed ZeRO-{stage}" if backend == "deepspeed" and stage is not None else str(backend)


def _global_batch(meta: dict[str, Any]) -> tuple[int, int, int, int]:
    """(global batch, micro-batch, accumulation, processes) a checkpoint's marker records."""
    micro, accum, world = int(meta["micro_batch_size"]), int(meta.get("grad_accum", 1)), int(meta["world_size"])
    return micro * accum * world, micro, accum, world


def keep_global_batch(folder: Path, cfg: Any, world_size: int) -> Optional[str]:
    """On another process count than ``folder``'s, set ``cfg``'s gradient accumulation so that the global batch
    stays the checkpoint's, and return the line that says so (None: nothing to change). Every rank calls it,
    before the sampler and the engine are built.

    Possible where this run's micro-batch x processes divides the recorded global batch; otherwise one
    :class:`UserError` line names the flags that would keep it. A user's DeepSpeed file that sets
    ``gradient_accumulation_steps`` explicitly decides it: a value that does not keep the batch is refused."""
    meta = read_marker(folder)
    if not isinstance(meta.get("world_size"), int) or meta["world_size"] == world_size \
            or not isinstance(meta.get("micro_batch_size"), int):
        return None  # same count, or a marker without the batch (refused by check_global_batch if resharded)
    total, micro_s, accum_s, world_s = _global_batch(meta)
    micro, accum = batch_shape(cfg)
    was = f"a global batch of {total} (micro-batch {micro_s} x accumulation {accum_s} x {world_s} processes)"
    if total % (micro * world_size):
        per_rank = total // world_size
        if total % world_size:
            fix = f"use a process count that divides {total}"
        else:
            options = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
            fix = f"pass --trainer.micro_batch_size {max(d for d in options if d <= micro)} (one of {options})"
        raise UserError(f"--checkpoint.resume: {folder} was trained with {was}; {world_size} process(es) x "
                        f"--trainer.micro_batch_size {micro} does not divide it: {fix}, or resume it on {world_s} "
                        "processes")
    need = total // (micro * world_size)
    if need == accum:
        return None
    path = cfg.strategy.deepspeed_config
    if path and load_user_config(path).get("gradient_accumulation_steps", "auto") != "auto":
        raise UserError(f"--checkpoint.resume: {folder} was trained with {was}; on {world_size} process(es) at "
                        f"micro-batch {micro} it takes gradient_accumulation_steps {need}, and {path} "
                        f"(--strategy.deepspeed_config) sets {accum}: write {need} or \"auto\" there")
    cfg.strategy.gradient_accumulation_steps = need
    return (f"resuming on {world_size} process(es) from a checkpoint of {world_s}: gradient accumulation "
            f"{need} (was {accum}) keeps its global batch of {total} ({micro} x {need} x {world_size})")


def check_global_batch(folder: Path, meta: dict[str, Any], shape: dict[str, Any]) -> None:
    """The rule of :func:`check_compatible` for a resume on another process count, in one line when broken."""
    flag, world, now_world = "--checkpoint.resume", meta["world_size"], shape.get("world_size")
    if "micro_batch_size" not in meta:
        raise UserError(f"{flag}: {folder} was written by {world} processes and does not record its micro-batch "
                        f"size, so it cannot be resumed on {now_world}. Start it with {world} processes")
    total, micro, accum, _ = _global_batch(meta)
    now_micro, now_accum = shape.get("micro_batch_size"), shape.get("grad_accum", accum)
    now_total = now_micro * now_accum * now_world
    if now_total == total:
        return
    per_micro_step = now_micro * now_world
    fix = (f"pass --strategy.gradient_accumulation_steps {total // per_micro_step}" if total % per_micro_step == 0
           else f"pass a --trainer.micro_batch_size that, times {now_world} process(es), divides {total}")
    raise UserError(f"{flag}: {folder} was written by {world} processes x micro-batch {micro} x accumulation "
                    f"{accum} (global batch {total}), this run has {now_world} x {now_micro} x {now_accum} (global "
                    f"batch {now_total}). A resume keeps the global batch: {fix}, or start it with {world} processes")


# ---- integrity -------------------------------------------------------------------------------
def estimate_bytes(n_params: int, n_trainable: int, precision: str, backend: str, optimizer_states: int = 2) -> int:
    """One checkpoint's size, estimated from the model before training: the weights in their training
    precision, plus per trainable parameter the optimizer's ``optimizer_states`` fp32 states (Adam's two
    moments; :func:`zerotrain.engines.states.optimizer_states`) and, under DeepSpeed, the fp32 master copy
    (which a 16-bit run keeps besides its 16-bit weights). FSDP2 keeps and saves fp32 parameters whatever it
    computes in."""
    weight = 2 if precision in ("bf16", "fp16") and backend != "fsdp2" else 4
    per_trainable = 4 * optimizer_states + (4 if backend == "deepspeed" else 0)
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
        if rank == 0 and (folder.exists() or folder.is_symlink()):
            # A leftover from a killed save of the same step (a link: the link, never what it names); what cannot
            # be removed fails the writes below.
            rundir.remove_entry(folder)
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
        """At a step boundary: when every rank agrees a stop signal came (zerotrain.runtime.preemption), save
        and raise :class:`~zerotrain.runtime.preemption.Preempted`, which ends the run with its exit status."""
        if preemption is None or not preemption.should_stop(self.engine.device):
            return

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
        (:meth:`~zerotrain.engines.base.Engine.load_resharded`: the plain engine as it is, ZeRO through
        a universal checkpoint converted once and cached, see :func:`zerotrain.checkpoint.universal.universal_checkpoint`), and
        the train state continues at the same step and samples with RNG re-seeded from (``seed``,
        step, rank) (:meth:`~zerotrain.train.state.TrainState.load_resharded`); one line says so.
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
        if crosses_engines(meta, self.shape):
            self._load_across(folder, meta)
        else:
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
        if crosses_engines(meta, self.shape):
            self._load_across(folder, meta)
        else:
            self.engine.load_resharded(folder, saved_world, self.cfg.verify)
        # Positions count micro-steps of micro x processes examples: the checkpoint's, converted to this run's.
        self.state.load_resharded(states, seed, self.engine.rank, examples_per_micro_step=(
            int(meta["micro_batch_size"]) * saved_world, int(self.shape["micro_batch_size"]) * self.engine.world_size))
        self.last_saved = self.state.step
        if self.engine.rank == 0:
            log.warning("resumed on %d process(es) from a checkpoint of %d: exact in weights, optimizer state, "
                        "schedule, step and data order, but not in dropout randomness (re-seeded from "
                        "seed, step and rank)", self.engine.world_size, saved_world)


    def _load_across(self, folder: Path, meta: dict[str, Any]) -> None:
        """The engine's state from another engine's checkpoint (see :func:`crosses_engines`): rank 0 converts it
        once to a universal checkpoint (cached beside it, as for a resume on another process count; from FSDP2's
        DCP files by :func:`~zerotrain.checkpoint.universal.universal_from_dcp`), every rank loads that."""
        convert = universal_from_dcp if meta.get("backend") == "fsdp2" else universal_checkpoint
        universal = run_on_main(lambda: convert(folder, self.cfg.verify))
        self.engine.load_universal(universal)
        if self.engine.rank == 0:
            log.warning("resumed under %s from a checkpoint of %s: the fp32 weights, optimizer states and schedule "
                        "carry over", _engine_named(self.shape.get("backend"), self.shape.get("zero_stage")),
                        _engine_named(meta.get("backend"), meta.get("zero_stage")))


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; remove older ones and the debris of killed saves.

    Only checkpoint folders (:data:`~zerotrain.checkpoint.layout.STEP_NAME`) are touched: a damaged checkpoint
    moved aside (``step*.damaged-*``) stays, as :func:`~zerotrain.checkpoint.layout.set_aside` decides."""
    complete = complete_checkpoints(ckpt_dir)
    doomed = complete[:-keep_last]
    newest = complete[-1] if complete else None
    for p in ckpt_dir.iterdir():
        # Incomplete folders older than the newest complete one are debris of killed saves.
        if STEP_NAME.fullmatch(p.name) and not is_complete(p) and newest is not None and p.name < newest.name:
            doomed.append(p)
    for p in doomed:
        rundir.remove_entry(p)
