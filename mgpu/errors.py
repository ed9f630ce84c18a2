"""The ways a job ends badly, and the exit code each maps to (a store found unreadable only as a
task reads it ends as a bad input)."""

from __future__ import annotations


class JobInputError(ValueError):
    """The job file, a flag or an input file is wrong; nothing was started (exit 2).

    The message names the key or flag and says what is allowed.
    """

    exit_code = 2


class JobFailed(RuntimeError):
    """The job ran and failed, a failed verification included (exit 1)."""

    exit_code = 1


class StoreUnreadable(RuntimeError):
    """A chunk of an input store could not be read or decoded, found only as a task read
    it; the message names the key (the client reports it as a bad input, exit 2)."""
