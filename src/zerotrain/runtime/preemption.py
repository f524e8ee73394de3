"""Pre-emption: a scheduler's stop signal becomes a checkpoint and an exit status that asks for a requeue.

SLURM and Kubernetes send SIGTERM before they kill a job (SLURM's ``--signal=USR1@120`` sends
SIGUSR1 earlier); Ctrl-C sends SIGINT. :class:`Preemption` turns the first of these into a flag and
nothing else: a signal handler cannot safely save a checkpoint (it runs between two bytecodes,
maybe inside a collective). The loop asks :meth:`Preemption.should_stop` at every step boundary;
all ranks agree through one all-reduce (a signal may reach one rank only, or the ranks one step
apart), save a checkpoint, and the process exits with :data:`PREEMPTED_EXIT`. Alone, the process
says at once that it will save; in a job of several processes rank 0 says so once every rank has
agreed, since the signal may be a launcher stopping the survivors of a failed rank (no save then).

A second signal exits at once (status 128 + signal), for a user who does not want to wait for the
save. Signals within :data:`SAME_EVENT_S` of the first count as the same request: a launcher
forwards the signal it got to its workers, and SLURM or a terminal's Ctrl-C signals every process
of the job, so a worker typically gets the same request twice within milliseconds.

Cost of the agreement per step: on Gloo (CPU) one all-reduce of one int. On NCCL the flag travels
in a device tensor that is all-reduced without a host sync, and its result is read one step later
(after waiting for that earlier all-reduce only), so the loop never waits for the step in flight:
the job stops one step after the signal. Alone (one process) there is no collective at all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from zerotrain.errors import RunStopped

PREEMPTED_EXIT = 75
"""Exit status of a run stopped by SIGTERM/SIGINT/SIGUSR1 after saving its checkpoint: BSD's
EX_TEMPFAIL ("try again later"), distinct from success (0), a user error (2), a crash (1) and a death
by signal (128 + n). A job script requeues on it, e.g. ``[ $? -eq 75 ] && scontrol requeue $SLURM_JOB_ID``."""

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

SAME_EVENT_S = 1.0
"""Signals this soon after the first are the same request (forwarded by a launcher), not a second one."""


class Preempted(RunStopped):
    """Raised by ``fit`` after the pre-emption checkpoint is written; the CLI exits with PREEMPTED_EXIT."""

    exit_status = PREEMPTED_EXIT

    def __init__(self, signame: str, folder: Any, step: int):
        self.signame, self.folder, self.step = signame, folder, step
        super().__init__(f"stopped by {signame} at step {step}; checkpoint {folder}. Run the same command with "
                         f"--checkpoint.resume auto --trainer.run_name {Path(folder).parent.parent.name} to continue")


@contextlib.contextmanager
def armed(preemption: Optional["Preemption"]) -> Iterator[None]:
    """:meth:`Preemption.armed` when there is one (setup() installs it in the main thread)."""
    if preemption is None:
        yield
    else:
        with preemption.armed():
            yield


class Preemption:
    """Signal handlers for the length of a run, and the per-step agreement on stopping."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        """The first stop signal received (None: none)."""
        self._first_at = 0.0
        self._saved: dict[int, Any] = {}
        self._installed = False
        self._pending: Optional[tuple[Any, Any]] = None  # NCCL: (pinned host copy, event) of the last step's flag
        self._host: Any = None
        self._armed = False
        self._announced = False

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """The training loop: a signal waits for the next step boundary's checkpoint. Outside it (data
        loading, model building, the final test and export) there is no step to save at, and a signal
        acts at once as it would without zerotrain: SIGINT raises KeyboardInterrupt, SIGTERM and SIGUSR1
        raise SystemExit(128 + signal), so every ``finally`` and ``with`` block still cleans up."""
        self._armed = True
        try:
            yield
        finally:
            self._armed = False

    # ---- handlers -----------------------------------------------------------------------------
    def install(self) -> "Preemption":
        """Install the handlers (main thread only: Python delivers signals there); see :meth:`restore`."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            self._saved[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self._installed = True
        return self

    def restore(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for sig, handler in self._saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._saved.clear()
        self._installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if not self._armed and self.signum is None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        now = time.monotonic()
        if self.signum is None:
            self.signum, self._first_at = signum, now
            if _world_size() == 1:  # alone the save is sure; in a job it is said once every rank agreed (should_stop)
                self._announce()
            return
        if now - self._first_at < SAME_EVENT_S:
            return  # the same request, forwarded by the launcher or sent to every process
        os.write(2, f"[zerotrain] {signal.Signals(signum).name} again: exiting without a checkpoint\n".encode())
        sys.stderr.flush()
        os._exit(128 + signum)

    def _announce(self) -> None:
        """The one line that promises the checkpoint (rank 0's: one line per job, not one per rank).

        In a job of several processes it waits for the agreement at the step boundary: a stop signal may come
        from the launcher tearing the job down after another rank failed (torchelastic stops the survivors with
        SIGTERM; a rank that was stopped, SIGSTOP, gets it when continued), and then no rank saves."""
        if self._announced or os.environ.get("RANK", "0") != "0":
            return
        self._announced = True
        os.write(2, f"[zerotrain] {self.name()}: saving a checkpoint at the next step, then exiting with status "
                 f"{PREEMPTED_EXIT} (signal again to exit at once)\n".encode())

    @property
    def requested(self) -> bool:
        return self.signum is not None

    # ---- the agreement --------------------------------------------------------------------------
    def should_stop(self, device: Any) -> bool:
        """Whether every rank stops now (collective: call it on every rank at every step boundary). When they
        do, rank 0 says so (the save follows)."""
        stop = self._agreed(device)
        if stop:
            self._announce()
        return stop

    def _agreed(self, device: Any) -> bool:
        import torch

        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 or not self._installed:
            return self.requested
        local = 1 if self.requested else 0
        if dist.get_backend() != "nccl":
            t = torch.tensor([local], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return bool(t.item())
        # NCCL: a device-side flag; the all-reduce is queued behind this step's work and read a step later.
        stop = False
        if self._pending is not None:
            host, event = self._pending
            event.synchronize()  # the previous step's all-reduce only, not the work queued since
            stop = bool(host.item())
        flag = torch.full((1,), local, dtype=torch.int32, device=device)  # a fill kernel: no host-to-device copy
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if self._host is None:
            self._host = torch.empty(1, dtype=torch.int32, pin_memory=True)
        host = self._host  # read above before this copy is queued: one buffer is enough
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending = (host, event)
        return stop

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a signal on another rank"


def _world_size() -> int:
    """The job's process count from the launcher's ``WORLD_SIZE`` (1 when started alone or unreadable)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE") or 1))
    except ValueError:
        return 1
