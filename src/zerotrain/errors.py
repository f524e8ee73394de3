"""The errors that end a run in one line, and the exit status each one ends it with.

Each class carries its ``exit_status``; the CLI (:mod:`zerotrain.cli`) maps an exception to its line and
status in one place, and a job script can tell the cases apart by the status alone.
"""

from __future__ import annotations

from typing import Optional


class RunStopped(Exception):
    """An error that ends a run with its message as one line (no traceback) and its own exit status."""

    exit_status = 1
    said_by_each_rank = False
    """False: every rank raises the same error at the same point, and rank 0 says it once. True: only the ranks
    that met it raise it, and each of them says it (a launcher that reads the workers' lines says one)."""


class UserError(RunStopped):
    """Something the user can fix: a flag, a file, the environment. The message says what to do."""

    exit_status = 2


class ConfigError(UserError):
    """A config value is invalid. ``flag`` is the CLI flag (or JSON key) that holds it."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag} {message}")


class DataError(UserError):
    """A data file is missing, empty or malformed. The message names the file (and line)."""


USER_ERROR_EXIT = UserError.exit_status
"""Exit status of a process stopped by a :class:`UserError` (the CLI's)."""

DIVERGED_EXIT = 3
"""Exit status of a run stopped because its loss diverged (:class:`TrainingDiverged`): distinct from a
user error (2), so a job script can tell "change a setting and resume" from "fix the command"."""


class TrainingDiverged(RunStopped):
    """The training loss stayed NaN/inf, or fp16's loss scale stuck at its minimum. The message names
    the step, the last good checkpoint and what to try; the CLI prints it and exits DIVERGED_EXIT."""

    exit_status = DIVERGED_EXIT

    def __init__(self, message: str, step: int, checkpoint: Optional[str] = None):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(message)


OOM_EXIT = 5
"""Exit status of a run stopped because a GPU ran out of memory (:class:`OutOfMemory`): distinct from a user
error (2), a diverged loss (3) and a lost rank (4), so a job script can retry with a smaller configuration."""


class OutOfMemory(RunStopped):
    """A GPU ran out of memory during training. The message is one line (see :func:`zerotrain.train.oom.describe_oom`):
    the step and rank, the sizes involved, and the ``zerotrain fit`` flags of the next smaller configuration to
    try; the CLI prints it and exits OOM_EXIT. Raised by the rank(s) that ran out, maybe not rank 0."""

    exit_status = OOM_EXIT
    said_by_each_rank = True


RANK_LOST_EXIT = 4
"""Exit status of a job ended because a rank stopped responding (the others' collectives timed out after
``--launch.timeout_minutes``), and of each worker that saw a collective fail. A worker killed by a signal
ends the job with 128 + signal instead (137: SIGKILL, often the out-of-memory killer)."""


class RankLost(RunStopped):
    """A collective failed because another rank is gone: it ended (``timed_out`` False: the connection dropped)
    or stopped responding (True: the collective timed out after ``--launch.timeout_minutes``). Not this rank's
    bug: no traceback. The message names this rank and its last finished step."""

    exit_status = RANK_LOST_EXIT
    said_by_each_rank = True

    def __init__(self, message: str, timed_out: bool):
        self.timed_out = timed_out
        super().__init__(message)
