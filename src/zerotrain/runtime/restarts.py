"""What a worker of a job with ``--launch.max_restarts`` does differently: the endings that are not restarted.

torchrun's elastic agent restarts every worker of the node, up to ``max_restarts`` times, whenever one of them
fails, whatever its exit status. A lost worker (killed, crashed, hung past ``--launch.timeout_minutes``) is what
a restart is for; a user error, a diverged loss, out of GPU memory or a pre-emption are not: the same command
fails the same way again, or, for a pre-emption, the scheduler asked the job to stop. torchrun has no setting
that restarts some statuses and not others, so the workers carry that decision:

* a worker that ends with one of :data:`FINAL_EXITS` leaves its error record in ``final-rank<R>`` of the
  launcher's progress folder (:func:`keep_final`), before it exits;
* a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0) first looks there (:func:`replay_final`): if an earlier
  attempt ended for good, it writes that record as its own error record and exits with the same status at once,
  before importing torch. The agent's remaining restarts pass in a fraction of a second each, and the launcher
  reads the same records (rank, line, status) as it would have without restarts.

torch-free on purpose: :func:`replay_final` runs before the subcommand is imported.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from zerotrain.data.io import atomic_write_text
from zerotrain.errors import DIVERGED_EXIT, OOM_EXIT, USER_ERROR_EXIT
from zerotrain.runtime.preemption import PREEMPTED_EXIT

FINAL_EXITS = frozenset({USER_ERROR_EXIT, DIVERGED_EXIT, OOM_EXIT, PREEMPTED_EXIT})
"""Exit statuses a restart cannot fix (or, for a pre-emption, must not try to): the job ends with them."""

PROGRESS_ENV = "ZEROTRAIN_PROGRESS_DIR"
"""Folder of the per-rank progress files; set by :func:`zerotrain.runtime.launcher.spawn_local_workers` for its
workers, which also tells a worker that this launcher, not the worker, says how the job ended."""


def attempt() -> int:
    """Which start of this worker this is: 0 the first, k the k-th restart (torchelastic's count)."""
    text = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(text) if text.isdigit() else 0


def restarts_allowed() -> int:
    """The restarts the launcher allows this job (0 without zerotrain's launcher or without the flag)."""
    text = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    return int(text) if text.isdigit() else 0


def _rank() -> int:
    text = os.environ.get("RANK", "0")
    return int(text) if text.isdigit() else 0


def _finals(folder: str) -> dict[int, dict]:
    out = {}
    for path in Path(folder).glob("final-rank*"):
        try:
            out[int(path.name[len("final-rank"):])] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return out


def keep_final(status: int, record: dict) -> bool:
    """In a worker of a job that may restart: keep ``record`` (its error record) when ``status`` ends the job for
    good, for the restarted workers to replay. True when kept."""
    folder = os.environ.get(PROGRESS_ENV)
    if status not in FINAL_EXITS or not folder or restarts_allowed() <= attempt():
        return False  # not under the launcher, or no restart left: the agent ends the job anyway
    try:
        atomic_write_text(os.path.join(folder, f"final-rank{_rank()}"), json.dumps({"status": status, **record}) + "\n")
    except OSError:
        return False
    return True


def ended_for_good(folder: str) -> bool:
    """For the launcher: whether a worker of an attempt so far ended with one of :data:`FINAL_EXITS`."""
    return bool(_finals(folder))


def final_status() -> Optional[tuple[int, dict]]:
    """The (status, error record) an earlier attempt of this job ended with for good: this rank's own, else the
    lowest rank's; None when no attempt did (or this is not a restarted worker of zerotrain's launcher)."""
    folder = os.environ.get(PROGRESS_ENV)
    if not folder or attempt() == 0:
        return None
    finals = _finals(folder)
    if not finals:
        return None
    kept = dict(finals.get(_rank()) or finals[min(finals)])
    status = kept.pop("status", None)
    if not isinstance(status, int):
        return None
    return status, kept


def replay_final() -> Optional[int]:
    """In a restarted worker: end as an earlier attempt ended for good (its record in this worker's error file,
    its status returned), or None to run."""
    found = final_status()
    if found is None:
        return None
    status, record = found
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            atomic_write_text(path, json.dumps(record) + "\n")
        except OSError:
            pass
    return status


def forget_step() -> None:
    """In a restarted worker: blank the step of this rank's progress file, which is the last attempt's until this
    one trains (its run folder stays: the launcher names that run's last checkpoint)."""
    folder = os.environ.get(PROGRESS_ENV)
    if not folder or attempt() == 0:
        return
    path = os.path.join(folder, f"rank{_rank()}")
    try:
        lines = Path(path).read_text().split("\n")
    except OSError:
        return
    if len(lines) >= 2:
        try:
            atomic_write_text(path, f"{'':>12}\n{lines[1]}\n")
        except OSError:
            pass
