"""Paths mgpu writes: checked before anything starts, and claimed by one job at a time.

:func:`check_writable` refuses a path that could not be written (a directory, a folder
that is missing or not writable, a read-only filesystem) with the key that names it.
:class:`OutputClaims` takes a lock file beside each output, created atomically when the
job starts and removed when it ends: a second job for the same output is refused,
naming the job (its pid and host) that holds it; the claim of a process that died
without removing it is taken over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import psutil

from .errors import JobFailed, JobInputError

__all__ = [
    "REPLACED_THREAD",
    "OutputClaims",
    "check_folder",
    "check_writable",
    "claim_path",
    "holder_of",
    "publish",
    "remove",
    "write_text",
]


def check_writable(path: str | Path, *, key: str, force: bool = True, folder: bool = False) -> str:
    """``path`` checked as a file mgpu will create or replace; returns it absolute.

    Parameters
    ----------
    key
        The job key or flag that names the path (in every error).
    force
        Whether an existing file may be replaced.
    folder
        The output is a folder (a Zarr store): an existing folder is it, not an error.

    Raises
    ------
    JobInputError
        If the path is a directory or other non-file, its folder is missing, is not a
        folder, or cannot be written (permissions, a read-only filesystem), or the file
        exists and ``force`` is false.
    """
    p = Path(path).expanduser()
    shown = str(path)
    if p.is_dir() and not folder:
        raise JobInputError(f"{key}: {shown!r} is a directory; give the path of a file")
    if folder and p.exists() and not p.is_dir():
        raise JobInputError(f"{key}: {shown!r} is a file, not a store (a folder)")
    if p.exists() and not (p.is_file() or folder):
        raise JobInputError(f"{key}: {shown!r} is not a regular file (a FIFO or device?)")
    if p.exists() and not force:
        raise JobInputError(f"{key}: {shown!r} already exists; remove it or pass --force")
    parent = p.parent
    if not parent.exists():
        raise JobInputError(f"{key}: the folder {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise JobInputError(f"{key}: {str(parent)!r} is not a folder")
    why = _cannot_create_in(parent)
    if why:
        raise JobInputError(f"{key}: cannot write in the folder {str(parent)!r} ({why}); write {p.name!r} elsewhere")
    return str(p.resolve())


def check_folder(path: str | Path, *, key: str) -> None:
    """``path`` checked as a folder mgpu will fill (made if missing, with its parents).

    Raises
    ------
    JobInputError
        If it is a file, or it (or, if missing, its nearest existing parent) cannot be written.
    """
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise JobInputError(f"{key}: {str(path)!r} is a file, not a folder")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise JobInputError(f"{key}: {str(existing)!r} is a file, so {str(path)!r} cannot be made")
    why = _cannot_create_in(existing)
    if why:
        raise JobInputError(f"{key}: cannot write in {str(existing)!r} ({why})")


def _cannot_create_in(folder: Path) -> str | None:
    """Why a file cannot be created in ``folder`` (permissions, a read-only or pseudo
    filesystem), found by creating one and removing it; None if it can."""
    if _read_only(folder):
        return "a read-only filesystem"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".mgpu-check-"):
            return None
    except OSError as e:
        return e.strerror or str(e)


def _read_only(folder: Path) -> bool:
    try:
        return bool(getattr(os.statvfs(folder), "f_flag", 0) & os.ST_RDONLY)
    except OSError:
        return False


def write_text(path: str | Path, text: str, *, key: str) -> None:
    """Write ``text`` to ``path`` (through a temporary beside it, renamed over it).

    Raises
    ------
    JobFailed
        One line naming the key, the path and the OS error (a full disk, a folder removed).
    """
    p = Path(path).expanduser()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(text)
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise JobFailed(f"{key}: could not write {p}: {e.strerror or e}") from None


# The name of the threads that let go of replaced outputs.
REPLACED_THREAD = "mgpu-replaced-output"


def publish(partial: str, path: str) -> None:
    """Put the finished output ``partial`` under its name ``path``, replacing what is there.

    What it replaces is let go of by a thread of its own: freeing a large file's pages is
    no part of the job (in /dev/shm, replacing a 4 GiB ``.npy`` took 0.25-0.5 s and a 9 GiB
    one 0.6-1.1 s). The thread is not a daemon: a process that ends waits for it, and
    nothing is left behind. A file is replaced in one rename, while this process holds it
    open (its pages go when that is closed); a folder (a Zarr store) moves what is there
    aside first.
    """
    old: int | str | None = None
    if os.path.isdir(partial) and os.path.lexists(path):  # a folder cannot be renamed over it
        old = f"{partial}.old"
        os.replace(path, old)
    else:
        with contextlib.suppress(OSError):  # none there, or unreadable: replaced in place
            old = os.open(path, os.O_RDONLY)
    try:
        os.replace(partial, path)
    except BaseException:
        if isinstance(old, str):
            os.replace(old, path)  # what was there goes back
        elif old is not None:
            os.close(old)
        raise
    if old is not None:
        let_go = os.close if isinstance(old, int) else remove
        threading.Thread(target=let_go, args=(old,), name=REPLACED_THREAD).start()


def remove(path: str) -> None:
    """Remove the file or folder ``path``, if it is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def claim_path(path: str) -> str:
    """The lock file that claims ``path``: hidden, beside it."""
    p = Path(path)
    return str(p.with_name(f".{p.name}.mgpu-claim"))


def holder_of(claim: str) -> dict[str, object] | None:
    """Who holds ``claim`` (``{"pid", "host", "job"}``), or None if nobody alive does.

    A claim left by a process of this host that no longer runs is no one's.
    """
    try:
        with open(claim) as f:
            holder = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"pid": "?", "host": "?", "job": "?"}  # being written, or not ours to read
    if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid"), holder.get("started")):
        return None
    return dict(holder)


def _alive(pid: object, started: object) -> bool:
    """Whether process ``pid`` runs and is the one that started at ``started`` (a pid freed
    by a process that died may be another's by now)."""
    if not isinstance(pid, int):
        return False
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return not isinstance(started, (int, float)) or abs(proc.create_time() - started) < 1.0
    except psutil.Error:
        return False


class OutputClaims:
    """The claims of one run's outputs, taken together (all or none) and released together."""

    def __init__(self) -> None:
        self.taken: list[str] = []

    def take(self, outputs: Iterable[tuple[str, str, str]]) -> None:
        """Claim each ``(path, key, job name)``; on a refusal, release what was taken.

        Raises
        ------
        JobInputError
            Naming the key, the path and the job (pid, host) that holds it.
        """
        try:
            for path, key, job in outputs:
                self._take_one(path, key, job)
        except BaseException:
            self.release()
            raise

    def _take_one(self, path: str, key: str, job: str) -> None:
        claim = claim_path(path)
        me = psutil.Process()
        record = json.dumps({"pid": me.pid, "started": me.create_time(), "host": socket.gethostname(), "job": job})
        for _ in range(3):
            try:
                fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = holder_of(claim)
                if holder is None:  # its process died: take it over
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(claim)
                    continue
                raise JobInputError(
                    f"{key}: {path} is being written by job {holder.get('job')!r} (pid {holder.get('pid')} on "
                    f"{holder.get('host')}); wait for it to end or give this job another output"
                ) from None
            except OSError as e:
                if e.errno in (errno.EACCES, errno.EROFS, errno.ENOENT, errno.ENOSPC):
                    raise JobInputError(f"{key}: cannot write beside {path}: {e.strerror}") from None
                raise
            with os.fdopen(fd, "w") as f:
                f.write(record)
            self.taken.append(claim)
            return
        raise JobInputError(f"{key}: {path} is claimed and released by other jobs over and over; try again")

    def release(self) -> None:
        for claim in self.taken:
            with contextlib.suppress(OSError):
                os.unlink(claim)
        self.taken = []

    @contextlib.contextmanager
    def held(self, outputs: Iterable[tuple[str, str, str]]) -> Iterator[OutputClaims]:
        """Hold the claims for the block."""
        self.take(outputs)
        try:
            yield self
        finally:
            self.release()
