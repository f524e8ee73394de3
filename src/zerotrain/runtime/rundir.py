"""The experiment directory: everything needed to see what ran and to run it again.

``<recipe>.<YYYY>.<MM>.<DD>.<HH>.<MM>.<SS>.<id>/`` holds ``hparams.json`` (the resolved config),
``ds_config.json`` (what DeepSpeed got), ``githash.log`` and ``gitdiff.log`` (the code),
``env.json`` (versions, hardware, the command line, the allocator's and NCCL's settings), ``tokenizer/`` (a copy of the
run's tokenizer), ``metrics.jsonl``, ``tb_dir/``, ``checkpoints/`` and, once trained, ``model/`` (the weights and their
``config.json``). The layout follows DeepSpeedExamples' HelloDeepSpeed.

A run folder travels: nothing in it is read through a path relative to where the run started, so it loads
from any working directory, after it was moved, and on another machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import json
import logging
import os
import platform
import secrets
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from zerotrain.checkpoint.layout import complete_checkpoints, resume_folder, set_aside
from zerotrain.config import from_dict, upgrade_layout
from zerotrain.data.io import atomic_write_text, looks_local
from zerotrain.data.io import write_json as atomic_write_json
from zerotrain.engines.ds_private.safe_load import ds_safe_globals
from zerotrain.errors import UserError
from zerotrain.models.hf import is_hf_folder
from zerotrain.runtime.collectives import barrier, broadcast_object, run_on_main
from zerotrain.tasks import registry as recipes
from zerotrain.train.state import refuse_unsafe_files

log = logging.getLogger("zerotrain")


def new_run_name(recipe: str) -> str:
    now = _dt.datetime.now()
    return f"{recipe}.{now:%Y.%m.%d.%H.%M.%S}.{secrets.token_hex(3)}"


def check_out_folder(folder: Path, flag: str) -> Path:
    """A command's output folder (``plan --out``, ``benchmark --out``): a file in its place, or a file where a parent
    folder should be, is one line naming ``flag`` before any work (the folder itself is made when written)."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        what = "is a file" if blocker == folder else f"is under a file ({blocker})"
        raise UserError(f"{flag}: {folder} {what}; pass a folder (created if missing)")
    return folder


def check_writable(output_dir: str) -> Path:
    """Fail early, before minutes of data loading, if runs cannot be written under ``output_dir``."""
    root = Path(output_dir).expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".zerotrain-write-test-"):
            pass
    except OSError as exc:
        raise UserError(
            f"--trainer.output_dir: cannot write to {root} ({exc.strerror or exc}). "
            "Pass a folder you can write to, e.g. --trainer.output_dir ./runs"
        ) from None
    return root


def create(output_dir: str, name: str) -> Path:
    run = check_writable(output_dir) / name
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    return run


def prepare(output_dir: str, run_name: Optional[str], recipe: str, resume: Optional[str],
            is_main: bool, lock: Optional[RunLock] = None, verify: bool = True) -> tuple[Path, Optional[Path]]:
    """The run folder every rank agrees on, and the checkpoint to resume from (None: start fresh).

    Rank 0 names the run and checks the parent folder is writable; nothing is created yet, so a
    bad flag or data file found later leaves no empty run folder behind (see :func:`write_metadata`).
    A run folder that exists already is locked first (rank 0's ``lock``), before its checkpoints are
    read: a run still training there is not raced. ``verify``: check the checkpoint's checksums too
    (sizes are always checked; see :func:`zerotrain.checkpoint.manager.find_resume_folder`).
    """

    name = broadcast_object(run_name or new_run_name(recipe) if is_main else None)
    run_on_main(lambda: check_writable(output_dir))  # its error stops every rank, not rank 0 alone
    run_dir = Path(output_dir).expanduser() / name
    run_on_main(lambda: check_closed(run_dir))  # before the lock file is opened in it
    if lock is not None:
        run_on_main(lambda: lock.take(run_dir) if run_dir.is_dir() else None)
    resume_from, damaged = resume_folder(resume, run_dir, verify=verify) if resume else (None, [])
    own = [f for f in damaged if f.parent.resolve() == (run_dir / "checkpoints").resolve()]
    if own:
        barrier()  # every rank has finished reading them
        run_on_main(lambda: _set_aside(own))
    if resume_from is None:
        run_on_main(lambda: _refuse_fresh_start_over(run_dir))
    else:
        # Before anything is built or rewritten: a file no weights-only load would accept is refused now, naming
        # it, not after the run folder's metadata was written (the loads themselves are weights-only too).
        run_on_main(lambda: refuse_unsafe_files(sorted(resume_from.glob("*.pt")), ds_safe_globals()))
    return run_dir, resume_from


def _set_aside(damaged: list[Path]) -> None:
    """This run's damaged checkpoints that resume skipped, renamed out of the way (see
    :func:`zerotrain.checkpoint.layout.set_aside`): they count in no ``--checkpoint.keep_last`` and their steps are
    saved again."""
    for folder in damaged:
        moved = set_aside(folder)
        log.warning(
            "moved the damaged checkpoint %s aside to %s: it is no longer resumed or counted in "
            "--checkpoint.keep_last, and step %s is saved again when training passes it (delete it once you have "
            "looked at it)", folder.name, moved, int(folder.name[len("step"):]))


# ---- a run folder is a closed room ----------------------------------------------------------------
def check_closed(run_dir: Path) -> None:
    """Refuse, in one line naming the entry, a run folder that is a symbolic link or holds one that points
    outside it (or holds a pipe or device file where zerotrain writes files).

    Everything a run writes goes under its folder: a link there (a run folder copied from someone else, a run
    name pre-created in a shared output folder) would make a fit, resume or export overwrite whatever the link
    names with the user's permissions. Links that stay inside the folder are left alone (W&B's ``latest-run``).
    Checked when a command starts using the folder; the files zerotrain then creates in place are opened
    without following links (:func:`open_own`), and the others are written beside and renamed over their
    name, which replaces a link instead of writing through it.
    """
    if run_dir.is_symlink():
        raise UserError(f"--trainer.run_name: {run_dir} is a symbolic link (to {os.readlink(run_dir)}): a run is "
                        "written only into a folder of its own. Remove the link or pass another --trainer.run_name")
    if not run_dir.is_dir():
        return
    root = run_dir.resolve()
    for here, dirs, files in os.walk(run_dir):
        for name in sorted(dirs + files):
            entry = Path(here) / name
            mode = entry.lstat().st_mode
            if stat.S_ISLNK(mode):
                target = Path(os.path.realpath(entry))
                if target != root and root not in target.parents:
                    raise UserError(f"{entry} is a symbolic link to {target}, outside the run folder {run_dir}: "
                                    "zerotrain writes nothing through it. Remove the link (or copy what it points "
                                    "to into the run folder)")
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise UserError(f"{entry} is not a regular file or folder (a pipe, socket or device): zerotrain "
                                "writes nothing into it. Remove it")


def open_own(path: Path, flags: int, what: str) -> int:
    """``os.open(path, flags | O_CREAT | O_NOFOLLOW)`` for a file zerotrain writes in place in a run folder
    (``what`` names it): a symbolic link, or a file with other hard links (whose writes would land in another
    file too), is refused in one line instead of written through."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"{path} ({what}) is a symbolic link: zerotrain writes nothing through it. Remove the "
                            "link") from None
        raise
    if os.fstat(fd).st_nlink > 1:
        os.close(fd)
        raise UserError(f"{path} ({what}) has other hard links: writing it would change another file too. Remove "
                        "it (zerotrain writes it again)")
    return fd


def remove_entry(path: Path) -> None:
    """Remove ``path``: a link itself (never what it points to), a file, or a folder tree; nothing when absent.
    Errors are ignored, as ``shutil.rmtree(..., ignore_errors=True)`` ignores them."""
    import shutil

    if path.is_symlink() or path.is_file():
        try:
            path.unlink()
        except OSError:
            pass
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _refuse_fresh_start_over(run_dir: Path) -> None:
    """A new run would rewrite hparams.json and the logs of a trained one, and pass its checkpoints off as its own."""

    found = complete_checkpoints(run_dir / "checkpoints")
    if found:
        raise UserError(f"--trainer.run_name {run_dir.name}: {run_dir} already holds a trained run (newest checkpoint "
                        f"{found[-1].name}). Continue it with --checkpoint.resume auto, or pass another --trainer.run_name")


def write_metadata(run_dir: Path, recipe: str, hparams: dict[str, Any], ds_config: Optional[dict[str, Any]],
                   lock: Optional["RunLock"] = None, task: Optional[str] = None, tokenizer: Any = None) -> None:
    """Create the run folder and write what reruns the run: config, DeepSpeed JSON, environment, code state,
    and a copy of ``tokenizer`` (the task's :meth:`~zerotrain.tasks.base.Task.run_tokenizer`; None: none).

    ``hparams.json`` names the recipe, and with ``task`` (``module:Class``, see :func:`zerotrain.tasks.registry.spec_of`)
    the class of a task its name alone would not find: what ``predict``, ``export`` and ``load_run`` import.

    ``lock`` (rank 0's :class:`RunLock`) takes the folder first, so that nothing is rewritten under a
    run that another process still trains."""
    with writing("the run folder's records (hparams.json, env.json, ...)", run_dir.parent):
        create(str(run_dir.parent), run_dir.name)
        if lock is not None:
            lock.take(run_dir)
        write_json(run_dir / "hparams.json", {"recipe": recipe, **({"task": task} if task else {}), **hparams})
        if ds_config is not None:
            write_json(run_dir / "ds_config.json", ds_config)
        write_json(run_dir / "env.json", environment())
        write_code_state(run_dir)
    if tokenizer is not None:
        save_tokenizer(tokenizer, run_dir / TOKENIZER_DIR)


TOKENIZER_DIR = "tokenizer"
"""The run folder's copy of its tokenizer, which :func:`read_run` uses instead of the path hparams.json records."""

MODEL_CONFIG = "config.json"
"""``<run>/model/config.json``: the recipe, its model settings and the vocabulary size the weights were trained with."""


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)``, written beside and renamed into place: a crash leaves no half copy."""
    with writing("the run's copy of its tokenizer", folder.parent), replaced(folder) as staging:
        tokenizer.save_pretrained(str(staging))


@contextlib.contextmanager
def replaced(folder: Path) -> Iterator[Path]:
    """``with replaced(folder) as staging:`` write into ``staging`` (beside ``folder``); when the block ends
    without error, ``staging`` takes ``folder``'s place (an older ``folder`` is removed first). When it fails,
    ``staging`` is removed and ``folder`` is as it was: never half a folder under its final name."""
    staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    remove_entry(staging)  # a link there is removed itself, never followed
    try:
        staging.mkdir(parents=True)
        yield staging
        remove_entry(folder)
        staging.rename(folder)
    finally:
        remove_entry(staging)  # gone already after the rename


def write_model_config(task: Any, model_dir: Path) -> None:
    """``model_dir/config.json`` beside the exported weights, as a ``save_pretrained`` folder has: the recipe, its
    ``model`` settings and ``vocab_size``, the size of the tokenizer the weights were trained with, which
    :func:`load_run` checks a tokenizer against before it blames the weights. A task whose export wrote a Hugging
    Face folder keeps its ``config.json`` (it names a ``model_type`` and holds ``vocab_size`` already)."""

    if is_hf_folder(model_dir):
        return
    model = getattr(task.cfg, "model", None)
    tokenizer = task.run_tokenizer()
    config = {"recipe": task.name,
              "model": dataclasses.asdict(model) if dataclasses.is_dataclass(model) else None,
              "vocab_size": len(tokenizer) if tokenizer is not None else None}
    model_dir.mkdir(parents=True, exist_ok=True)
    write_json(model_dir / MODEL_CONFIG, config)


# ---- who owns a run folder ----------------------------------------------------------------------
LOCK_FILE = ".lock"


class RunLock:
    """An exclusive ``fcntl.flock`` on ``<run>/.lock``, held by rank 0 for the length of a fit.

    A second fit on the same run folder (a restarted job while the old one still runs, two users
    with the same --trainer.run_name) stops with one line naming the holder's pid, before it rewrites
    anything. The kernel drops the lock when its holder dies, even by kill -9, so a stale lock file
    never blocks a restart; the file itself is left in place (deleting it would race with a new holder).
    """

    def __init__(self) -> None:
        self._fd: Optional[int] = None
        self.path: Optional[Path] = None

    def take(self, run_dir: Path) -> None:
        """Lock ``run_dir`` (which must exist); a no-op when this object holds it already."""
        if self._fd is not None:
            return
        import fcntl

        path = run_dir / LOCK_FILE
        fd = open_own(path, os.O_RDWR, "the run folder's lock")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").split()
            os.close(fd)
            who = f"process {holder[0]}" + (f" on {holder[1]}" if len(holder) > 1 else "") if holder else "another process"
            raise UserError(f"run folder {run_dir} is in use by {who} (it holds {path}). Wait for that run to end "
                            "or stop it, or pass another --trainer.run_name") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd, self.path = fd, path

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


# ---- writes that fail for space -------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def free_bytes(folder: Path) -> Optional[int]:
    """Free space of the disk holding ``folder`` (or its nearest existing parent); None if unknown."""
    import shutil

    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def is_space_error(exc: BaseException) -> bool:
    """A write that failed because the disk (or quota) is full: ENOSPC/EDQUOT, or torch.save's RuntimeError.

    ``torch.save`` reports a failed write as ``RuntimeError: [enforce fail at inline_container.cc:...]
    ... PytorchStreamWriter failed writing file ...``: no errno survives, so its text is matched.
    """
    import errno

    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    text = str(exc)
    # Writers in Rust or C++ report the OS error in their text: safetensors' SafetensorError says "... (os error 28)".
    said = any(f"(os error {code})" in text for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)) \
        or "No space left on device" in text
    return said or isinstance(exc, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text
                                                      or "file write failed" in text)


def space_error(what: str, folder: Path, needed: Optional[int] = None, keep: str = "") -> UserError:
    """The one line for a write of ``what`` into ``folder`` that did not fit."""
    free = free_bytes(folder)
    have = f"{fmt_bytes(free)} free" if free is not None else "free space unknown"
    need = f", about {fmt_bytes(needed)} needed" if needed else ""
    return UserError(f"no space left to write {what} in {folder} ({have}{need}). Free disk space or point "
                     f"--trainer.output_dir at a bigger disk{keep}")


class writing:
    """``with writing("the exported model", folder):`` turns a disk-full error inside into one UserError line.

    Other errors pass through unchanged. ``needed``: the bytes the write needs, when known.
    """

    def __init__(self, what: str, folder: Path, needed: Optional[int] = None, keep: str = ""):
        self.what, self.folder, self.needed, self.keep = what, Path(folder), needed, keep

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, UserError) and is_space_error(exc):
            raise space_error(self.what, self.folder, self.needed, self.keep) from None
        return False


def write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON (values json cannot encode written as strings), replaced atomically."""

    atomic_write_json(path, data, indent=2, default=str)


def _git(args: list[str], cwd: Path) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def write_code_state(run: Path) -> None:
    """githash.log and gitdiff.log of the working tree the command ran from (empty outside git)."""
    cwd = Path.cwd()
    # Written beside and renamed: a link under either name is replaced, never written through.
    atomic_write_text(run / "githash.log", _git(["rev-parse", "HEAD"], cwd) or "not a git checkout\n")
    atomic_write_text(run / "gitdiff.log", _git(["diff", "HEAD"], cwd))


def commit(here: Path = Path(__file__).resolve().parent) -> str | None:
    """The git commit of the zerotrain code that runs: ZEROTRAIN_COMMIT when set (a copied tree, such
    as the one a GPU machine receives, may carry a stale .git whose HEAD is not the code), else the HEAD of
    the checkout holding ``here`` (the package's folder), marked ``-dirty`` as ``git describe`` does when the
    files under ``here`` differ from it, untracked ones included: such a HEAD does not name the code that
    ran (a result would be credited to an older commit than the code that produced it); None when neither says."""
    named = os.environ.get("ZEROTRAIN_COMMIT")
    if named:
        return named
    head = _git(["rev-parse", "HEAD"], here).strip()
    if not head:
        return None
    return f"{head}-dirty" if _git(["status", "--porcelain", "--", "."], here).strip() else head


def _program() -> str:
    """How the command was started: ``zerotrain``, or ``python -m zerotrain`` (also torchrun's workers)."""
    name = Path(sys.argv[0]).name
    return "python -m zerotrain" if name == "__main__.py" else name


def environment() -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for pkg in ("zerotrain", "torch", "deepspeed", "transformers", "datasets", "tokenizers", "peft", "safetensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "command": " ".join([_program(), *sys.argv[1:]]),
        "commit": commit(),
        "cwd": str(Path.cwd()),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "versions": versions,
        "cuda": torch.version.cuda,
        "gpus": gpus,
        "cpu_count": os.cpu_count(),
        "cpu_threads": torch.get_num_threads(),  # this process's: CPU Adam and host-side ops run on these
        # the CPUs this process may run on (taskset, cpuset): OpenMP sizes its default thread count by them
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        # settings that change a run's memory or speed figures: the CUDA allocator's, NCCL's and PyTorch's for NCCL
        "tuning_env": {k: v for k, v in sorted(os.environ.items())
                       if k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS")
                       or k.startswith(("NCCL_", "TORCH_NCCL_"))},
        "launcher_env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                    "MASTER_PORT", "SLURM_JOB_ID", "SLURM_NNODES")
                         if k in os.environ},
    }


# ---- loading a finished run ------------------------------------------------------------------
TOKENIZER_SETTINGS = ("data.tokenizer", "model.tokenizer")
"""Where recipes keep their tokenizer, in the order :func:`load_run`'s ``"tokenizer"`` override looks."""


@dataclasses.dataclass
class LoadedRun:
    """A finished run rebuilt for inference: what :func:`load_run` returns."""

    run_dir: Path
    recipe: str
    cfg: Any
    """The recipe's typed config (a :class:`~zerotrain.config.RunConfig` subclass), as the run saved it."""
    task: Any
    """The recipe's :class:`~zerotrain.tasks.base.Task`, built on ``cfg``: ``task.predict(model, texts)``."""
    model: torch.nn.Module
    """The exported weights, in eval mode, on the requested device."""


def _tokenizer_setting(cfg: Any) -> Optional[str]:
    for dotted in TOKENIZER_SETTINGS:
        section, _, name = dotted.partition(".")
        value = getattr(cfg, section, None)
        if dataclasses.is_dataclass(value) and name in {f.name for f in dataclasses.fields(value)}:
            return dotted
    return None


def use_own_model_config(cfg: Any, run_dir: Path) -> bool:
    """Point a Hugging Face recipe's ``--model`` at the run folder's own ``model/`` (a ``save_pretrained`` folder: its
    config.json) for building the architecture, so that a run rebuilds without the folder, hub name or config file
    it was trained from. Only for building without pretrained weights: the weights then come from the run (its
    export or checkpoint). True when it did; a run without that folder, or a recipe without those settings, is
    left as it was."""
    model = getattr(cfg, "model", None)
    names = {f.name for f in dataclasses.fields(model)} if dataclasses.is_dataclass(model) else set()
    folder = Path(run_dir) / "model"
    if not {"name_or_path", "init", "config"} <= names or not _is_hf_config(folder / "config.json"):
        return False
    if model.init == "random":
        model.config = str(folder)
    else:
        model.name_or_path = str(folder)
    return True


def _is_hf_config(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face config.json (it names a ``model_type``), not zerotrain's own model config."""
    try:
        return "model_type" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def _apply_overrides(cfg: Any, overrides: dict[str, Any], recipe: str) -> None:
    for key, value in overrides.items():
        if key == "tokenizer":
            key = _tokenizer_setting(cfg) or key
        section_name, _, name = key.partition(".")
        section = getattr(cfg, section_name, None) if name else None
        if not (dataclasses.is_dataclass(section) and name in {f.name for f in dataclasses.fields(section)}):
            raise UserError(f"override {key!r}: the {recipe} recipe's config has no such setting "
                            "(write section.field, e.g. data.tokenizer)")
        setattr(section, name, value)


def _check_device(device: str) -> torch.device:
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU is visible here. Use --device cpu")
    return dev


def read_run(run_dir: Path) -> tuple[str, Any, dict[str, Any]]:
    """(recipe, typed config, raw hparams.json in the current layout) of a run folder; one-line errors naming the file.

    The task class is :func:`task_class` of the raw hparams (imported here already, so the errors come first).
    The config's tokenizer setting names the run's own copy (``<run>/tokenizer``) when the run has one; the raw
    hparams.json keeps the path the run was started with."""

    if not run_dir.is_dir():
        state = "is a file, not a folder" if run_dir.exists() else "does not exist"
        raise UserError(f"run folder {run_dir} {state}. Pass the folder a training run wrote "
                        "(runs/<recipe>.<date>...)")
    hparams = run_dir / "hparams.json"
    if not hparams.is_file():
        parent = f"; its parent {run_dir.parent} is one: pass that" if (run_dir.parent / "hparams.json").is_file() else ""
        raise UserError(f"{hparams} is missing: {run_dir} is not a zerotrain run folder{parent}. "
                        "Pass the folder a training run wrote")
    try:
        raw = json.loads(hparams.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{hparams} cannot be read as JSON ({exc}); was it edited by hand?") from None
    recipe = raw.get("recipe") if isinstance(raw, dict) else None
    if not isinstance(recipe, str):
        raise UserError(f"{hparams} names no recipe (no \"recipe\" key): it was not written by zerotrain fit")
    config_class = task_class(raw, hparams).config_class
    raw = upgrade_layout(raw)  # a run saved before precision, compile and activation checkpointing left strategy
    fields = {f.name for f in dataclasses.fields(config_class)}
    try:
        cfg = from_dict(config_class, {k: v for k, v in raw.items() if k in fields})
    except (UserError, TypeError, ValueError) as exc:
        raise UserError(f"{hparams} does not match the {recipe} recipe's config ({exc}); "
                        "was the run made by another zerotrain version?") from None
    setting = _tokenizer_setting(cfg)
    if setting is not None and (run_dir / TOKENIZER_DIR).is_dir():
        # The run's own copy, not the path it was started with (relative to a folder it may no longer be in).
        section, _, name = setting.partition(".")
        setattr(getattr(cfg, section), name, str(run_dir / TOKENIZER_DIR))
    return recipe, cfg, raw


def task_class(raw: dict[str, Any], hparams: Path) -> type:
    """The Task class of a run from its ``hparams.json`` (``raw``): its ``task`` (``module:Class``) when the run
    recorded one, else its recipe name, shipped, installed or registered by a module imported first."""

    spec = raw.get("task") or raw["recipe"]
    try:
        return recipes.get(spec, argument=f'{hparams}: "task"')
    except UserError as exc:
        if "task" in raw:
            raise UserError(f"{exc} (the run was trained with zerotrain fit {spec}: load it from the same folder "
                            "or environment)") from None
        known = ", ".join(recipes.all_recipes())
        raise UserError(f"{hparams}: the run is of recipe {spec!r}, which is not registered here (known: {known}). "
                        "For a task of your own, import the module that defines it first") from None


def _check_tokenizer_fits(task: Any, export_dir: Path, tokenizer: Any, setting: Optional[str]) -> None:
    """A tokenizer whose vocabulary is not the size the weights were trained with is named as the cause, before
    the weights are loaded (where it would read as damaged weights). Runs exported without ``config.json``
    are not checked."""
    try:
        trained = json.loads((export_dir / MODEL_CONFIG).read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return
    tok = task.run_tokenizer() if isinstance(trained, int) else None

    # A Hugging Face model's embedding may have more rows than its tokenizer has tokens (rounded up for speed).
    if tok is not None and (len(tok) > trained if is_hf_folder(export_dir) else len(tok) != trained):
        raise UserError(f"the tokenizer {tokenizer!r} ({setting}) has {len(tok)} tokens, but the model in {export_dir} "
                        f"was trained with a tokenizer of {trained}: pass the tokenizer the run was trained with, "
                        "--tokenizer DIR (load_run(..., overrides={'tokenizer': DIR}) from Python)")


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
"""Weight files in Python's pickle format (``pytorch_model.bin``, peft's ``adapter_model.bin``, ...)."""


def refuse_pickles(export_dir: Path) -> None:
    """Refuse, in one line naming it, a pickle file among the exported weights in ``export_dir``.

    zerotrain exports safetensors only (peft's adapter and Hugging Face folders included), which hold tensors and
    nothing that runs. A pickle file there was put by someone else; Hugging Face's and peft's loaders would
    prefer or fall back to it, and unpickling can run code (their weights-only mode ends in a traceback instead).
    """
    for path in sorted(export_dir.rglob("*")):
        if path.suffix.lower() in PICKLE_SUFFIXES and path.is_file():
            raise UserError(f"{path} is a pickle file, which zerotrain does not load (unpickling it could run code; "
                            "zerotrain exports safetensors only). Delete it, or export the run's checkpoint again "
                            "with zerotrain export")


def load_run(run_dir: str | Path, overrides: Optional[dict[str, Any]] = None, device: str = "cpu") -> LoadedRun:
    """Rebuild the model a finished ``zerotrain fit`` run exported, ready for inference.

    Reads ``<run_dir>/hparams.json`` (its config sections; other keys such as ``recipe`` only say
    which recipe it is), builds the recipe's task and its model without reading any pretrained
    weights (``build_model(pretrained=False)``), and loads ``<run_dir>/model`` into it with
    ``Task.load_exported``. The model is put in eval mode on ``device``; activation checkpointing,
    a training-time setting, is turned off.

    The tokenizer is the run's own copy (``<run_dir>/tokenizer``) when it has one, so the folder loads from
    anywhere; a tokenizer of another vocabulary size than the weights' (``model/config.json``) is refused
    naming the tokenizer. ``overrides`` replaces saved settings before anything is built, as
    ``{"section.field": value}``, e.g. ``{"data.tokenizer": "/new/place/tokenizer"}`` for a run without its
    own copy whose tokenizer folder moved; the key ``"tokenizer"`` names the recipe's own tokenizer setting
    (``data.tokenizer`` or ``model.tokenizer``). A run of a task given as ``module:Class`` imports that module
    again (from the environment or the current folder); a task class defined in a script must be imported (so
    that it registers) before its runs can be loaded. Every failure is a :class:`~zerotrain.errors.UserError`
    naming the folder or file
    and what to do.
    """

    run_dir = Path(run_dir).expanduser()
    recipe, cfg, raw = read_run(run_dir)
    dev = _check_device(device)
    task_cls = task_class(raw, run_dir / "hparams.json")
    _apply_overrides(cfg, dict(overrides or {}), recipe)
    if not any(key.startswith("model.") for key in overrides or {}):
        use_own_model_config(cfg, run_dir)  # the model is rebuilt without weights: the run's own config serves
    cfg.activation_checkpointing.enabled = False  # a training setting; inference has no backward pass

    setting = _tokenizer_setting(cfg)
    tokenizer = None
    if setting is not None:
        section, _, name = setting.partition(".")
        tokenizer = getattr(getattr(cfg, section), name)
        if isinstance(tokenizer, str) and looks_local(tokenizer) and not Path(tokenizer).expanduser().is_dir():
            raise UserError(f"the tokenizer folder {tokenizer!r} that {run_dir} was trained with ({setting} in "
                            "hparams.json) no longer exists. Pass its new place: --tokenizer DIR "
                            "(load_run(..., overrides={'tokenizer': DIR}) from Python)")

    export_dir = run_dir / "model"
    if not export_dir.is_dir():
        raise UserError(f"{export_dir} is missing: the run did not finish exporting its model. "
                        "Let it finish (or resume it) and try again")
    refuse_pickles(export_dir)
    task = task_cls(cfg)
    _check_tokenizer_fits(task, export_dir, tokenizer, setting)
    # Random initialisation before the weights are loaded must not move the caller's random streams.
    with torch.random.fork_rng(devices=[]):
        try:
            model = task.build_model(pretrained=False)
        except UserError as exc:
            raise UserError(f"cannot rebuild the model of {run_dir} from its hparams.json: {exc}") from None
        task.load_exported(model, export_dir)
    model.to(dev).eval()
    return LoadedRun(run_dir=run_dir, recipe=recipe, cfg=cfg, task=task, model=model)
