"""Where training stands, in one object: the part of an exact resume that is not the engine's.

The engine owns what is sharded (parameters, optimizer states, the learning-rate schedule). Everything
else the loop needs to continue a run as if it had never stopped lives in :class:`TrainState`: the
optimizer step, the position in the data, the open logging window and this process's random number
generators. The checkpointer (:mod:`zerotrain.checkpoint.manager`) saves it per rank next to the engine's
files and restores it; nothing else writes or reads it.

The saved form holds only tensors, numbers, strings and lists, so it loads with
``torch.load(weights_only=True)``: a checkpoint file cannot run code.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from zerotrain.errors import UserError

SCHEMA_VERSION = 1
"""Bumped whenever the fields below change meaning; a checkpoint of another version is refused."""


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Current pass over the training data (0-based)."""
    batches_in_epoch: int = 0
    """Micro-batches this rank has consumed in the current epoch."""
    window_loss: float = 0.0
    """Sum of this rank's step losses since the last log line (a device tensor while training)."""
    window_steps: int = 0
    """Steps in the open logging window."""
    stream_offset: tuple[int, ...] = ()
    """A streamed training split (--data.streaming): (first raw record of the chunk, rows of it consumed) in this
    rank's share, where the next micro-batch starts; empty otherwise (see :mod:`zerotrain.data.streaming`)."""

    def advance(self, loss: Any, epoch: int, batches_in_epoch: int,
                stream_offset: Optional[Sequence[int]] = None) -> None:
        """Count one optimizer step whose last micro-batch left the data at (epoch, batches_in_epoch), and for a
        streamed split at ``stream_offset``."""
        self.step += 1
        self.epoch, self.batches_in_epoch = epoch, batches_in_epoch
        self.stream_offset = tuple(int(x) for x in stream_offset) if stream_offset else ()
        self.window_loss = self.window_loss + loss
        self.window_steps += 1

    def close_window(self) -> None:
        self.window_loss, self.window_steps = 0.0, 0

    def state_dict(self) -> dict[str, Any]:
        """The state and this process's RNG states, now."""
        return {
            "version": SCHEMA_VERSION,
            "step": self.step,
            "epoch": self.epoch,
            "batches_in_epoch": self.batches_in_epoch,
            "window_loss": float(self.window_loss),  # reading a device tensor: only at save time
            "window_steps": self.window_steps,
            "stream_offset": list(self.stream_offset),
            "rng": rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the fields and this process's RNG states from :meth:`state_dict`'s output."""
        if state.get("version") != SCHEMA_VERSION:
            raise UserError(f"--checkpoint.resume: the checkpoint's train state has schema version "
                            f"{state.get('version')}, this zerotrain reads {SCHEMA_VERSION}. Resume it with the "
                            "zerotrain version that wrote it, or start a new run")
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.batches_in_epoch = int(state["batches_in_epoch"])
        self.window_loss, self.window_steps = float(state["window_loss"]), int(state["window_steps"])
        self.stream_offset = tuple(int(x) for x in state.get("stream_offset", ()))
        set_rng_state(state["rng"])

    def load_resharded(self, states: list[dict[str, Any]], seed: int, rank: int,
                       examples_per_micro_step: tuple[int, int] = (1, 1)) -> None:
        """Restore from the train states of a checkpoint written by ``len(states)`` processes, on another count.

        Decisions (see also :func:`zerotrain.checkpoint.manager.check_compatible`, which admits such a resume):

        * **Step and data position are exact.** A resume on another process count keeps the global
          batch, so the sampler plans the same optimizer steps in the same order
          (:class:`~zerotrain.data.sampling.EpochBatches` plans steps, then cuts each into micro-steps
          of micro x world examples, one micro-batch per rank). The position counts micro-steps:
          ``examples_per_micro_step`` (the checkpoint's, this run's) converts it, exactly, since a
          checkpoint is taken between optimizer steps. Every saved rank holds the same step, epoch and
          position; a disagreement is refused.
        * **The open log window** continues with the mean of the saved ranks' sums, so the next
          logged loss (a mean over ranks) is the one an uninterrupted run logs.
        * **RNG is re-seeded**, not restored: per-rank generator states cannot be mapped onto
          another rank count. Every generator is seeded from (``seed``, step, ``rank``)
          (:func:`reseed`), so the resumed run is deterministic but its dropout draws differ from an
          uninterrupted run's (MLM masks come from the data pipeline, seeded by epoch and block).
        """
        for state in states:
            if state.get("version") != SCHEMA_VERSION:
                self.load_state_dict(state)  # raises the version's one line
        if any(s.get("stream_offset") for s in states):
            raise UserError(f"--checkpoint.resume: the checkpoint was written by {len(states)} process(es) reading a "
                            "streamed split (--data.streaming), whose position is per process. Resume it with "
                            f"{len(states)} process(es)")
        first = states[0]
        where = [(int(s["step"]), int(s["epoch"]), int(s["batches_in_epoch"])) for s in states]
        if len(set(where)) != 1:
            raise UserError(f"--checkpoint.resume: the checkpoint's ranks disagree on where training stands "
                            f"(step, epoch, micro-batches: {sorted(set(where))}). Pass an older checkpoint folder")
        self.step, self.epoch, position = where[0]
        before, now = examples_per_micro_step
        if position * before % now:
            raise UserError(f"--checkpoint.resume: the checkpoint stands {position} micro-steps of {before} examples "
                            f"into its epoch, not a whole number of this run's micro-steps of {now}. Resume it with "
                            "its own process count and micro-batch")
        self.batches_in_epoch = position * before // now
        self.window_loss = sum(float(s["window_loss"]) for s in states) / len(states)
        self.window_steps = int(first["window_steps"])
        reseed(seed, self.step, rank)

    def plain(self) -> dict[str, Any]:
        """The fields alone (no RNG), for the checkpoint's JSON marker and log lines."""
        out = {"step": self.step, "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}
        if self.stream_offset:
            out["stream_offset"] = list(self.stream_offset)
        return out


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA) generator states, in weights_only-loadable types."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) from (seed, step, rank): deterministic, distinct per rank and step."""
    digest = hashlib.sha256(f"zerotrain-reseed:{seed}:{step}:{rank}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") >> 1  # torch.manual_seed takes up to 2**63 - 1
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)  # seeds every CUDA device too


RESUME = ("--checkpoint.resume: ", "Pass an older checkpoint folder")
"""Where a file that cannot be loaded safely was met (the line's start) and what to do instead: resuming."""


def load_safely(path: Path, map_location: Any = "cpu", allow: Iterable[type] = (),
                where: tuple[str, str] = RESUME, mmap: bool = False) -> Any:
    """``torch.load(weights_only=True)``: tensors, plain containers and the classes in ``allow`` only.

    A file that needs more (a crafted pickle whose ``__reduce__`` would run code) or is damaged
    ends in one :class:`UserError` line naming it (:func:`unreadable`, ``where``); nothing in it runs.
    """
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as exc:  # UnpicklingError, RuntimeError (a damaged zip), EOFError, ...
        raise unreadable(path, exc, where) from None


def unreadable(path: Path, exc: BaseException, where: tuple[str, str] = RESUME) -> UserError:
    """The one line for a file that cannot be loaded safely: ``where`` is (the line's start, what to do)."""
    text = " ".join(str(exc).split())
    if is_refused_pickle(exc):
        why = ("it holds Python objects other than tensors and plain containers, which are refused because loading "
               "them could run code (was the file replaced?)")
    else:
        why = f"it is damaged ({type(exc).__name__}: {text[:200]})"
    return UserError(f"{where[0]}{path} cannot be loaded: {why}. {where[1]}")


def refuse_unsafe_files(paths: Iterable[Path], allow: Iterable[type] = (), where: tuple[str, str] = RESUME) -> None:
    """Before a third-party loader reads ``paths`` (DeepSpeed's ``zero_to_fp32``): each must be a file ``torch.save``
    wrote whose pickle names nothing beyond torch's weights-only set and ``allow``. Nothing is unpickled: the
    pickle's opcodes are only scanned. The first file that fails is refused in one line naming it (``where``), so
    the line names the file rather than the folder the loader was given."""
    allowed = {f"{c.__module__}.{c.__qualname__}" for c in allow}
    for path in paths:
        try:
            unsafe = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(str(path)) if g not in allowed]
        except ValueError:  # not torch.save's zip layout: a bare pickle, or garbage
            raise UserError(f"{where[0]}{path} cannot be loaded: it is not a file torch.save wrote (a bare pickle is "
                            f"refused because loading it could run code; was the file replaced?). {where[1]}") from None
        except Exception as exc:  # a damaged zip
            raise unreadable(path, exc, where) from None
        if unsafe:
            raise UserError(f"{where[0]}{path} cannot be loaded: it holds Python objects other than tensors and plain "
                            f"containers ({', '.join(unsafe[:3])}), which are refused because loading them could run "
                            f"code (was the file replaced?). {where[1]}")


def is_refused_pickle(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's weights-only unpickler refusing an object (rather than a damaged file)."""
    text = str(exc)
    return "Weights only load failed" in text or "Unsupported global" in text


@contextlib.contextmanager
def weights_only_torch_load(source: Path, allow: Iterable[type] = (), where: tuple[str, str] = RESUME
                            ) -> Iterator[None]:
    """Within the block, every ``torch.load`` call (in third-party code too) loads weights only.

    DeepSpeed's universal-checkpoint converter and loader call ``torch.load(weights_only=False)`` directly, not
    through its checkpoint engine. torch's own switch, ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, overrides that
    argument; ``allow`` (classes the files may hold besides tensors) is added to torch's allow-list for the
    block (``add_safe_globals``; the list is as it was after). A file refused or cut short ends the block with :func:`unreadable`
    naming ``source`` (``where``: the line's start and what to do). The environment is as it was after the block.
    """
    saved = {key: os.environ.pop(key, None) for key in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    allowed_before = torch.serialization.get_safe_globals()
    # Process-wide, not safe_globals' context: DeepSpeed's converter loads from worker threads.
    torch.serialization.add_safe_globals(list(allow))
    try:
        yield
    except (pickle.UnpicklingError, EOFError) as exc:
        raise unreadable(source, exc, where) from None
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(allowed_before)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
