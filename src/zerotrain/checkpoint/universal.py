"""Resuming on another process count or under another engine: a checkpoint as DeepSpeed's universal checkpoint,
converted once and cached.

ZeRO-1/2/3 shard the optimizer states (and, at stage 3, the parameters) by rank, so a checkpoint of
N processes cannot be loaded by M of them as it is. DeepSpeed's universal checkpoint stores every
parameter's states whole; zerotrain converts a step folder into one the first time a run resumes
from it on another process count, and keeps it beside the checkpoint for the next time.

The same folder is how checkpoints cross engines: every parameter's fp32 weights and optimizer states whole
(``zero/<parameter>/fp32.pt``, ``exp_avg.pt``, ...), the optimizer's settings and the schedule beside them. A
ZeRO-1/2/3 checkpoint becomes one through DeepSpeed's converter (:func:`universal_checkpoint`), an FSDP2 (DCP)
checkpoint through :func:`universal_from_dcp`; FSDP2 loads one, DeepSpeed ZeRO-1/2/3 through its own universal
loader, ZeRO-0 and the plain engine, whose state is whole, through :func:`load_whole`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zerotrain.checkpoint import dcp
from zerotrain.checkpoint.layout import (
    MARKER,
    checkpoint_bytes,
    listing_problem,
    read_marker,
    seal,
)
from zerotrain.data.io import atomic_write_text, fsync_dir
from zerotrain.engines.ds_private.safe_load import ds_safe_globals
from zerotrain.engines.ds_private.universal import (
    MODEL_STATES,
    convert_to_universal,
    saved_step,
    write_parameter_state,
    write_run_states,
)
from zerotrain.errors import UserError
from zerotrain.runtime import rundir
from zerotrain.train.state import load_safely, weights_only_torch_load

log = logging.getLogger("zerotrain")

UNIVERSAL = "universal"
"""Subfolder of a step folder holding its universal checkpoint (DeepSpeed's ``<dir>/<tag>/`` layout, tag ``universal``)."""
UNIVERSAL_MARKER = "UNIVERSAL.json"


def universal_checkpoint(folder: Path, verify: bool = True) -> Path:
    """``folder``'s ZeRO state as a DeepSpeed universal checkpoint, ``folder/universal``: converted once, then cached.

    Runs on one rank (the caller uses :func:`~zerotrain.runtime.collectives.run_on_main`, so a failure
    reaches every rank as one line); the conversion is CPU-only. It is DeepSpeed's own
    converter (:func:`zerotrain.engines.ds_private.universal.convert_to_universal`), written into ``folder/.universal.tmp/`` and
    renamed into place only when complete, with its own marker (:data:`UNIVERSAL_MARKER`: every
    file's size and, with ``verify``, sha256; fsynced before the rename), so the cache is complete
    or absent like the checkpoint itself. A cached copy is checked against its marker and
    reused; a damaged one is converted again. Every ``torch.load`` of the conversion is
    weights-only with the engine's allow-list (a crafted file runs no code).
    """
    import contextlib
    import io

    def convert(work: Path) -> None:
        chatter = io.StringIO()  # the converter prints progress bars and banners
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter), \
                weights_only_torch_load(folder, ds_safe_globals()):
            convert_to_universal(folder, work)

    return _converted_once(folder, verify, convert, "to resume on another process count or engine")


def universal_from_dcp(folder: Path, verify: bool = True) -> Path:
    """``folder``'s FSDP2 state (DCP's ``dcp/`` and the schedule's ``fsdp2_state.pt``) as a universal checkpoint,
    ``folder/universal``: converted once, then cached, as :func:`universal_checkpoint` does (one rank, CPU only).

    Read with :mod:`zerotrain.checkpoint.dcp`'s safe reader (nothing in the files runs code) one tensor at a
    time, whatever process count wrote the shards: each parameter's fp32 weights, then each of its optimizer
    states (the step as saved), each written to its own file before the next is read. The optimizer's settings
    are the saved ones (the resume checks made this run's the same), its step the first parameter's."""
    def convert(work: Path) -> None:
        found = dcp.entries(folder)
        names = [place[1] for place, meta in found.items()
                 if len(place) == 2 and place[0] == dcp.MODEL and isinstance(meta, TensorStorageMetadata)]
        if not names:
            raise UserError(f"--checkpoint.resume: {folder / dcp.FOLDER} lists no model weights. Pass another "
                            "checkpoint folder")
        states: dict[str, list[tuple[Any, ...]]] = {}
        for place in found:
            if len(place) == 4 and place[:2] == (dcp.OPTIMIZER, "state"):
                states.setdefault(place[2], []).append(place)
        step: Optional[torch.Tensor] = None
        for name in names:
            weights = dcp.read_values(folder, {(dcp.MODEL, name): found[(dcp.MODEL, name)]})[(dcp.MODEL, name)]
            write_parameter_state(work, name, "fp32", weights.float())
            del weights
            for place in states.get(name, []):
                value = dcp.read_values(folder, {place: found[place]})[place]
                write_parameter_state(work, name, place[3], value)
                step = value if place[3] == "step" and step is None else step
        groups: dict[int, dict[str, Any]] = {}
        settings = {p: m for p, m in found.items() if len(p) == 4 and p[:2] == (dcp.OPTIMIZER, "param_groups")}
        for (_, _, i, key), value in dcp.read_values(folder, settings).items():
            if key != "params":
                groups.setdefault(i, {})[key] = value
        schedule = load_safely(folder / dcp.STATE_FILE)
        if not isinstance(schedule, dict) or "scheduler" not in schedule:
            raise UserError(f"--checkpoint.resume: {folder / dcp.STATE_FILE} holds no schedule. Pass another "
                            "checkpoint folder")
        meta = read_marker(folder)
        write_run_states(work, [groups[i] for i in sorted(groups)],
                         step if step is not None else torch.tensor(0.0), schedule["scheduler"],
                         int(meta.get("step", 0)), int(meta.get("world_size", 1)))

    return _converted_once(folder, verify, convert, "to resume under another engine")


def _converted_once(folder: Path, verify: bool, convert: Callable[[Path], None], why: str) -> Path:
    """``folder/universal``, the cached copy if its marker checks, else written by ``convert`` into a temporary
    folder and renamed into place once complete and sealed (see :func:`universal_checkpoint`).

    The cache records the digest of ``folder``'s marker (every file's size and checksum), and a cache of other
    contents (a checkpoint copied over this one, or one without that record) is converted again."""
    out = folder / UNIVERSAL
    source = _marker_digest(folder)
    if (out / UNIVERSAL_MARKER).is_file():
        damage = _listing_problem(out, UNIVERSAL_MARKER, verify) or _other_source(out, source)
        if damage is None:
            log.info("using the universal checkpoint cached in %s", out)
            return out
        log.warning("the cached universal checkpoint %s cannot be used (%s): converting again", out, damage)
    work = folder / ".universal.tmp"
    for stale in (out, work):
        shutil.rmtree(stale, ignore_errors=True)  # no marker (a killed conversion) or damaged
    meta = read_marker(folder)
    log.info("converting %s (written by %s process(es)) to a universal checkpoint in %s", folder,
             meta.get("world_size"), out)

    try:
        convert(work / UNIVERSAL)
        files = seal(work / UNIVERSAL, 0, 1, verify)
        atomic_write_text(work / UNIVERSAL / UNIVERSAL_MARKER,
                          json.dumps({"format": 1, "source": folder.name, "source_world_size": meta.get("world_size"),
                                      "source_marker_sha256": source, "files": files}, indent=1))
        fsync_dir(work / UNIVERSAL)
        os.rename(work / UNIVERSAL, out)
        fsync_dir(folder)
    except UserError:
        raise
    except Exception as exc:
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        if rundir.is_space_error(exc):
            raise rundir.space_error("the universal checkpoint", folder, checkpoint_bytes(folder)) from None
        raise UserError(f"--checkpoint.resume: converting {folder} to a universal checkpoint ({why}) failed "
                        f"({detail}). Resume it with the --strategy.backend and process count ({meta.get('world_size')}) "
                        "that wrote it") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _marker_digest(folder: Path) -> str:
    """sha256 of ``folder``'s checkpoint marker, which lists every file it holds with its size (and checksum)."""
    read_marker(folder)  # its one line when it cannot be read
    return hashlib.sha256((folder / MARKER).read_bytes()).hexdigest()


def _other_source(out: Path, source: str) -> Optional[str]:
    """Why the cache ``out`` is not the conversion of the checkpoint whose marker digest is ``source`` (None: it is)."""
    try:
        recorded = json.loads((out / UNIVERSAL_MARKER).read_text()).get("source_marker_sha256")
    except (OSError, ValueError, AttributeError) as exc:
        return f"{out / UNIVERSAL_MARKER} cannot be read ({exc})"
    return None if recorded == source else "it was converted from other contents of the checkpoint"


def _listing_problem(folder: Path, marker: str, checksums: bool) -> Optional[str]:
    """What is wrong with ``folder`` against the file listing in its ``marker`` (None: nothing). One rank."""
    try:
        files = json.loads((folder / marker).read_text()).get("files")
    except (OSError, ValueError, AttributeError) as exc:
        return f"{folder / marker} cannot be read ({exc})"
    return listing_problem(folder, files, checksums, marker=folder / marker)


def run_states(folder: Path) -> dict[str, Any]:
    """The model-states file of universal checkpoint ``folder`` (the schedule's state under ``lr_scheduler``),
    weights-only: DeepSpeed's converter copies the one its stage wrote, zerotrain's writer writes both."""
    path = next((folder / name for name in MODEL_STATES if (folder / name).is_file()), folder / MODEL_STATES[0])
    states = load_safely(path, "cpu", ds_safe_globals())
    if not isinstance(states, dict) or "lr_scheduler" not in states:
        raise UserError(f"--checkpoint.resume: {path} holds no schedule. Pass another checkpoint folder")
    return states


def optimizer_step(folder: Path) -> Any:
    """The optimizer's step of universal checkpoint ``folder`` from ``zero/optimizer_state.pt`` (weights-only), for
    parameters without a ``step.pt``; one line when it is not there either."""
    path = folder / "zero" / "optimizer_state.pt"
    # Memory-mapped: at ZeRO-3 the file also holds the flat fp32 partitions, which are not read
    step = saved_step(load_safely(path, "cpu", ds_safe_globals(), mmap=True)) if path.is_file() else None
    if step is None:
        raise UserError(f"--checkpoint.resume: {folder} records no optimizer step (neither zero/<parameter>/step.pt "
                        f"nor {path.name}). Resume it with the --strategy.backend that wrote it")
    return step


def parameter_states(folder: Path, name: str, shape: torch.Size, group_step: Callable[[], Any]) -> dict[str, Any]:
    """``zero/<name>/``'s files of universal checkpoint ``folder``: ``fp32`` (the weights) and each optimizer state,
    tensors whole in the parameter's ``shape`` (DeepSpeed's converter writes ZeRO-3's flat), the step as saved (where the parameter has none,
    ``group_step()``: :func:`optimizer_step`, read once by the caller); weights-only. One line when the parameter is not there or
    has another size."""
    where = folder / "zero" / name
    if not (where / "fp32.pt").is_file():
        raise _no_weights(folder, name)
    allow = ds_safe_globals()
    out = {}
    for f in sorted(where.glob("*.pt")):
        saved = load_safely(f, "cpu", allow)
        value = saved["param"] if isinstance(saved, dict) else saved
        if f.stem != "step":
            _check_size(f, value, name, shape.numel())
            value = value.view(shape)
        out[f.stem] = value
    if len(out) > 1 and "step" not in out:  # optimizer states without their step: the group's
        out["step"] = group_step()
    return out


def check_weights(folder: Path, sizes: dict[str, int]) -> None:
    """One line when a parameter of this model (``sizes``: name -> its whole number of elements) has no weights in
    universal checkpoint ``folder`` or another size there, before a loader that would stop on an assertion
    (DeepSpeed's) reads it. Weights-only, and memory-mapped (no tensor read) where the file is torch.save's zip."""
    allow = ds_safe_globals()
    for name, numel in sizes.items():
        path = folder / "zero" / name / "fp32.pt"
        if not path.is_file():
            raise _no_weights(folder, name)
        saved = load_safely(path, "cpu", allow, mmap=zipfile.is_zipfile(path))  # torch.save's format maps
        _check_size(path, saved["param"] if isinstance(saved, dict) else saved, name, numel)


def _no_weights(folder: Path, name: str) -> UserError:
    return UserError(f"--checkpoint.resume: {folder} holds no weights of {name} (was it written by another "
                     "model?). Resume it with the --strategy.backend that wrote it")


def _check_size(path: Path, value: Any, name: str, numel: int) -> None:
    if not torch.is_tensor(value) or value.numel() != numel:
        size = value.numel() if torch.is_tensor(value) else type(value).__name__
        raise UserError(f"--checkpoint.resume: {path} holds {size} values, this model's {name} has {numel} (was it "
                        "written by another model?). Resume it with its own model")


def load_whole(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    """Universal checkpoint ``folder`` into an engine whose state is whole on every rank (the plain engine,
    DeepSpeed ZeRO-0): each trainable parameter of ``module`` and its state in ``optimizer`` (a torch optimizer
    over those parameters), one parameter at a time; the schedule; the rate of the next step.

    A state goes where the optimizer's own ``load_state_dict`` would put it: moments on the parameter's device
    in its dtype, the step on the host unless the group is ``fused`` or ``capturable``. The optimizer's settings
    are this run's (the resume checks made them the checkpoint's)."""
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
    group_step = functools.cache(lambda: optimizer_step(folder))
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        saved = parameter_states(folder, name, p.shape, group_step)
        with torch.no_grad():
            p.copy_(saved.pop("fp32"))
        group = group_of.get(p, {})
        on_device = bool(group.get("fused") or group.get("capturable"))
        state: dict[str, Any] = {}
        for key, value in saved.items():
            if key == "step":
                step = value if torch.is_tensor(value) else torch.tensor(float(value))
                state[key] = step.to(torch.float32).to(p.device if on_device else "cpu")
            else:
                state[key] = value.to(p.device, p.dtype)
        optimizer.state[p] = state
    scheduler.load_state_dict(run_states(folder)["lr_scheduler"])
    # The rate the next step uses: a schedule's state does not reach the optimizer it drives
    for g, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        g["lr"] = lr
