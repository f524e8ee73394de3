"""Where metrics go: metrics.jsonl always, TensorBoard by default, W&B when asked. Rank 0 only."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from zerotrain.checkpoint.layout import complete_checkpoints, problem
from zerotrain.config import LoggingConfig
from zerotrain.data.io import atomic_write_bytes, atomic_write_text
from zerotrain.errors import TrainingDiverged, UserError
from zerotrain.metrics.meters import memory_snapshot
from zerotrain.runtime.rundir import open_own, writing

log = logging.getLogger("zerotrain")


def setup_logging(is_main: bool) -> Callable[[], None]:
    """Rank 0 logs at INFO; the other ranks only warn, so N processes don't print N copies.

    Returns a function that puts the ``zerotrain`` logger back as it was.
    """
    saved = (list(log.handlers), log.level, log.propagate)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[zerotrain] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.INFO if is_main else logging.WARNING)

    def restore() -> None:
        log.handlers[:] = saved[0]
        log.setLevel(saved[1])
        log.propagate = saved[2]

    return restore


class Tracker:
    """metrics.jsonl, TensorBoard and W&B, written by rank 0.

    A value that is not finite is written to metrics.jsonl as the string ``"nan"``, ``"inf"`` or
    ``"-inf"`` (JSON has no such numbers, and dropping it would hide a diverged run); TensorBoard gets
    the float itself. A write that fails for space is one UserError line naming the file.
    """

    def __init__(self, run_dir: Path, cfg: LoggingConfig, hparams: dict[str, Any], is_main: bool,
                 resumed_at: Optional[int] = None):
        """``resumed_at``: the checkpoint step a resumed run starts from. What a killed run logged after
        it is removed from TensorBoard's event files and from metrics.jsonl.
        None: the run starts at step 0, so whatever an earlier attempt of it logged (a run killed before
        its first checkpoint) is cleared, metrics.jsonl and tb_dir both."""
        self.is_main = is_main
        self.run_dir = run_dir
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not is_main:
            return
        metrics = run_dir / "metrics.jsonl"
        with rundir_writing("metrics.jsonl", run_dir):
            if metrics.is_symlink():  # neither read nor replaced: a link here was put by someone else
                raise UserError(f"{metrics} (the run's metrics log) is a symbolic link: zerotrain writes nothing "
                                "through it. Remove the link")
            if resumed_at is not None:
                _drop_rows_after(metrics, resumed_at)
            else:
                _clear_earlier_attempt(run_dir)
            # Appended in place: opened without following a link (a link or hard link there is refused)
            self._jsonl = AppendOnly(metrics, what="the run's metrics log")
        if cfg.tensorboard:
            with rundir_writing("TensorBoard events", run_dir / "tb_dir"):
                if resumed_at is not None:
                    _drop_events_after(run_dir / "tb_dir", resumed_at)
                self._tb = EventFile(run_dir / "tb_dir")
        if cfg.wandb:
            try:
                import wandb
            except ImportError:
                raise UserError("--logging.wandb needs the wandb package: pip install 'zerotrain[wandb]'") from None
            self._wandb = wandb.init(
                project=cfg.wandb_project, name=cfg.wandb_run_name or run_dir.name, tags=cfg.wandb_tags or None,
                config=hparams, mode=cfg.wandb_mode, dir=str(run_dir),
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.is_main:
            return
        clean = {k: v for k, v in metrics.items() if v is not None}
        with rundir_writing("metrics.jsonl", self.run_dir):
            self._jsonl.write(json.dumps({"step": step, **{k: _json_number(v) for k, v in clean.items()}}) + "\n")
        with rundir_writing("TensorBoard events", self.run_dir / "tb_dir"):
            scalars = {k: float(v) for k, v in clean.items() if isinstance(v, (int, float))}
            if self._tb is not None and scalars:
                self._tb.scalars(scalars, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        """Close the files; nothing is left to flush (each row was written whole, or not at all)."""
        if self._jsonl:
            jsonl, self._jsonl = self._jsonl, None
            jsonl.close()
        if self._tb is not None:
            tb, self._tb = self._tb, None
            tb.close()
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            run.finish()


class AppendOnly:
    """A file that grows by whole records: each :meth:`write` appends its bytes in one unbuffered write, and a
    write that fails (a full disk) is cut off again, so the file never ends in half a record and nothing is
    left in a buffer for a later flush or close to fail on."""

    def __init__(self, path: Path, mode: str = "a", what: str = "a run file"):
        # Opened without following a link (open_own refuses a link or a hard link there, naming ``what``)
        self._fd: Optional[int] = open_own(path, os.O_WRONLY | (os.O_APPEND if mode == "a" else os.O_TRUNC), what)

    def write(self, data: str | bytes) -> None:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)  # shrinking needs no space
            raise

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class EventFile:
    """TensorBoard's event file, written in the calling thread by whole records (:class:`AppendOnly`).

    ``torch.utils.tensorboard.SummaryWriter`` writes from a thread of its own: a full disk there prints that
    thread's traceback and surfaces later, at another call. Here a failed write raises where it happens and
    leaves the file as it was."""

    def __init__(self, folder: Path):
        from tensorboard.compat.proto.event_pb2 import Event

        self._event = Event
        folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_event_files)}"
        self._file = AppendOnly(folder / name, mode="w", what="a TensorBoard event file")
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, values: dict[str, float], step: int) -> None:
        from torch.utils.tensorboard.summary import scalar

        records = [self._record(self._event(wall_time=time.time(), step=step, summary=scalar(k, v)))
                   for k, v in values.items()]
        self._file.write(b"".join(records))  # one write: the step's points are there all, or none

    def _write(self, event: Any) -> None:
        self._file.write(self._record(event))

    @staticmethod
    def _record(event: Any) -> bytes:
        return _framed(event.SerializeToString())

    def close(self) -> None:
        self._file.close()


_event_files = itertools.count()


def _framed(data: bytes) -> bytes:
    """One TFRecord (the length, its masked crc32c, the data, its masked crc32c), framed by TensorBoard's own
    record writer into memory, so that several records can go to the file in one write."""
    import io

    from tensorboard.summary.writer.record_writer import RecordWriter

    buffer = io.BytesIO()
    RecordWriter(buffer).write(data)
    return buffer.getvalue()


def _records(raw: bytes) -> Iterator[bytes]:
    """The whole records of an event file's bytes (a record cut short at the end is left out)."""
    import struct

    at = 0
    while at + 12 <= len(raw):
        (length,) = struct.unpack("<Q", raw[at:at + 8])
        end = at + 12 + length + 4
        if end > len(raw):
            return
        yield raw[at + 12:at + 12 + length]
        at = end


def _drop_events_after(tb_dir: Path, step: int) -> None:
    """Forget the points a killed run logged to TensorBoard after its last checkpoint, as :func:`_drop_rows_after`
    does in metrics.jsonl: the resumed run logs those steps again, and a curve must not show them twice."""
    from tensorboard.compat.proto.event_pb2 import Event

    for path in sorted(tb_dir.glob("events.out.tfevents.*")) if tb_dir.is_dir() else []:
        raw = path.read_bytes()
        kept = [data for data in _records(raw)
                if not ((event := Event.FromString(data)).HasField("summary") and event.step > step)]
        text = b"".join(_framed(data) for data in kept)
        if text != raw:
            atomic_write_bytes(path, text)


def _json_number(value: Any) -> Any:
    """``value``, or its name as a string when JSON cannot hold it (nan, inf, -inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _drop_rows_after(metrics_file: Path, step: int) -> None:
    """Forget what a killed run logged after its last checkpoint: the resumed run logs those steps again.

    A line that is not JSON (the half-written last line of a run killed mid-write, or a disk that
    filled up) is dropped too, with a warning, instead of failing every later resume.
    """
    if not metrics_file.is_file():
        return
    lines = metrics_file.read_text(encoding="utf-8", errors="replace").split("\n")
    kept, broken = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            broken += 1
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
    if broken:
        log.warning("%s: dropped %d line(s) that were not JSON (half-written when the run stopped)", metrics_file, broken)
    if len(kept) != sum(1 for line in lines if line.strip()) or not metrics_file.read_bytes().endswith(b"\n"):
        atomic_write_text(metrics_file, "".join(line + "\n" for line in kept))


def _clear_earlier_attempt(run_dir: Path) -> None:
    """A run that starts at step 0 in a folder an earlier attempt logged into: drop that log."""
    import shutil

    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        log.warning("%s: clearing what an earlier attempt of this run logged (it left no checkpoint)", metrics)
        metrics.unlink()
    tb = run_dir / "tb_dir"
    if tb.is_symlink():
        tb.unlink()  # the link itself, never what it points to (zerotrain.runtime.rundir.check_closed)
    elif tb.is_dir() and any(tb.iterdir()):
        shutil.rmtree(tb)


def rundir_writing(what: str, folder: Path):

    return writing(what, folder)


DIVERGED_WINDOWS = 2
"""Consecutive log windows with a non-finite loss (or fp16's loss scale stuck at its minimum) that stop a run.
One such window can be a transient (a single overflowing batch); two in a row are a run that diverged."""


class StepLogger:
    """The loop's logging component: every ``every`` steps (and at the last), one window of metrics.

    The loss is averaged over the window's steps and over ranks; rates come from the meter, memory
    from a snapshot. Reading the loss waits for the device, so it happens only here, on log steps.

    It also stops a run that diverged (:class:`~zerotrain.errors.TrainingDiverged`): a loss that is
    NaN/inf in :data:`DIVERGED_WINDOWS` consecutive windows, or an fp16 loss scale at its minimum
    with steps still being skipped in as many windows. The values it decides on are the same on every
    rank (the loss is all-reduced; DeepSpeed agrees on overflows), so every rank raises at the same step
    and no collective is left waiting; the check adds no device sync of its own.
    """

    def __init__(self, every: int, total_steps: int, engine: Any, meter: Any, tracker: Tracker, bar: Any):
        self.every, self.total_steps = every, total_steps
        self.engine, self.meter, self.tracker, self.bar = engine, meter, tracker, bar
        self._bad_windows = 0
        self._last_good_step: Optional[int] = None  # last log step whose window was healthy; None: none yet
        self._skipped = None  # skipped_steps at the last log step

    def should_log(self, step: int) -> bool:
        return step % self.every == 0 or step == self.total_steps

    def log(self, state: Any) -> dict[str, Any]:
        """Log the open window of ``state`` (a TrainState), close it and return what was logged."""

        e = self.engine
        loss = e.all_reduce_sum({"loss": state.window_loss / state.window_steps})["loss"] / e.world_size
        window = {"train_loss": loss, "lr": e.lr(), "grad_norm": e.grad_norm(), "loss_scale": e.loss_scale(),
                  "skipped_steps": e.skipped_steps(), "epoch": state.epoch, **self.meter.read(),
                  **memory_snapshot(e.device)}
        self.tracker.log(state.step, window)
        self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        first_step = state.step - state.window_steps + 1
        state.close_window()
        self._check_diverged(state.step, first_step, window)
        return window

    def _check_diverged(self, step: int, first_step: int, window: dict[str, Any]) -> None:
        loss, scale, skipped = window["train_loss"], window["loss_scale"], window["skipped_steps"]
        min_scale = ((getattr(self.engine, "ds_config", None) or {}).get("fp16") or {}).get("min_loss_scale")
        skipped_now = self._skipped is not None and skipped > self._skipped
        self._skipped = skipped
        scale_stuck = (scale is not None and min_scale is not None and scale <= min_scale and skipped_now)
        if math.isfinite(loss) and not scale_stuck:
            self._bad_windows, self._last_good_step = 0, step
            return
        self._bad_windows += 1
        if self._bad_windows < DIVERGED_WINDOWS:
            return

        since = "the start" if self._last_good_step is None else f"step {self._last_good_step}"
        if math.isfinite(loss):
            what = (f"the fp16 loss scale is stuck at its minimum ({scale:g}, --precision.min_loss_scale) and "
                    f"steps are still skipped for overflow ({skipped} so far): nothing has trained since {since}")
            advice = ("bf16 instead of fp16 (--precision.dtype bf16, on GPUs that support it), a lower "
                      "--optimizer.lr, --strategy.gradient_clipping 1.0, or a lower --precision.min_loss_scale")
        else:
            what = f"the training loss is {_json_number(loss)} at step {step} and has not been finite since {since}"
            advice = "a lower --optimizer.lr"
            if not _clip_of(self.engine):
                advice += ", gradient clipping (--strategy.gradient_clipping 1.0)"
            if self.engine.precision == "fp16":
                advice += ", or bf16 instead of fp16 (--precision.dtype bf16)"
            else:
                advice += ", or a longer warm-up (--scheduler.warmup_steps)"
        good = self._good_checkpoint()
        where = (f"last good checkpoint: {good} (resume from it with --checkpoint.resume {good})" if good else
                 "no checkpoint was saved while it was finite (--checkpoint.every_steps N saves one every N steps)")
        self.tracker.close()  # the run ends here: what it logged is flushed, as at the end of a run
        raise TrainingDiverged(f"training diverged at step {step}: {what}; {where}. Try {advice}", step,
                               None if good is None else str(good))

    def _good_checkpoint(self) -> Optional[Path]:
        """The newest complete checkpoint saved at or before the last healthy log step (None: none)."""
        if self._last_good_step is None:
            return None

        for folder in reversed(complete_checkpoints(self.tracker.run_dir / "checkpoints")):
            step = folder.name[len("step"):]  # step{N:08d}, as checkpoint.step_folder names it
            # Sizes and the marker's listing only: every rank gets here at once, and hashing would cost a read
            if step.isdigit() and int(step) <= self._last_good_step and problem(folder, checksums=False) is None:
                return folder
        return None


def _clip_of(engine: Any) -> Optional[float]:
    """The gradient-clipping norm ``engine`` applies (0 or None: none); the engine clips itself, or DeepSpeed does."""
    for value in (getattr(engine, "clip", None), getattr(engine, "_clip", None),
                  (getattr(engine, "ds_config", None) or {}).get("gradient_clipping")):
        if value:
            return float(value)
    return None


def progress_bar(enabled: bool, total: int, initial: int):
    """tqdm on rank 0 when asked, else an object with the same methods that does nothing."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, **kwargs: Any) -> None: ...
    def close(self) -> None: ...
