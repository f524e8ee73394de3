"""Errors a user can fix. The CLI prints them as one line and exits non-zero, with no traceback."""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix: a flag, a file, the environment. The message says what to do."""


class ConfigError(UserError):
    """A config value is invalid. ``flag`` is the CLI flag (or JSON key) that holds it."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"{flag} {message}")


class DataError(UserError):
    """A data file is missing, empty or malformed. The message names the file (and line)."""
