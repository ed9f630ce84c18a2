"""The two ways a job ends badly, and the exit code each maps to."""

from __future__ import annotations


class JobInputError(ValueError):
    """The job file, a flag or an input file is wrong; nothing was started (exit 2).

    The message names the key or flag and says what is allowed.
    """

    exit_code = 2


class JobFailed(RuntimeError):
    """The job ran and failed, a failed verification included (exit 1)."""

    exit_code = 1
