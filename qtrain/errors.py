"""Errors that end a run with a one-line message and a non-zero exit code (the CLI prints them)."""


class QtrainError(Exception):
    """Base class: the message is the whole one-line report."""

    exit_code = 2


class ConfigError(QtrainError):
    """A config value or override that is not allowed."""


class DataError(QtrainError):
    """A dataset that is missing, unreadable or malformed."""


class DivergedError(QtrainError):
    """The loss became NaN or infinite."""

    exit_code = 3


class RunDirError(QtrainError):
    """A run directory that holds another run, is in use by another process, or cannot be written or read."""
