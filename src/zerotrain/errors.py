"""Errors a user can fix. The CLI prints them as one line and exits non-zero, with no traceback."""

from __future__ import annotations

from typing import Optional


class UserError(Exception):
    """Something the user can fix: a flag, a file, the environment. The message says what to do."""


class ConfigError(UserError):
    """A config value is invalid. ``flag`` is the CLI flag (or JSON key) that holds it."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag} {message}")


class DataError(UserError):
    """A data file is missing, empty or malformed. The message names the file (and line)."""


USER_ERROR_EXIT = 2
"""Exit status of a process stopped by a :class:`UserError` (the CLI's)."""

ERROR_FILE_KEY = "zerotrain_user_error"
"""Key of the record the CLI leaves in torchelastic's error file of a worker stopped by a UserError."""

DIVERGED_EXIT = 3
"""Exit status of a run stopped because its loss diverged (:class:`TrainingDiverged`): distinct from a
user error (2), so a job script can tell "change a setting and resume" from "fix the command"."""


class TrainingDiverged(Exception):
    """The training loss stayed NaN/inf, or fp16's loss scale stuck at its minimum. The message names
    the step, the last good checkpoint and what to try; the CLI prints it and exits DIVERGED_EXIT."""

    def __init__(self, message: str, step: int, checkpoint: Optional[str] = None):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(message)


OOM_EXIT = 5
"""Exit status of a run stopped because a GPU ran out of memory (:class:`OutOfMemory`): distinct from a user
error (2), a diverged loss (3) and a lost rank (4), so a job script can retry with a smaller configuration."""


class OutOfMemory(Exception):
    """A GPU ran out of memory during training. The message is one line (see :func:`zerotrain.train.oom.describe_oom`):
    the step and rank, the sizes involved, and the ``zerotrain fit`` flags of the next smaller configuration to
    try; the CLI prints it and exits OOM_EXIT."""
