"""NVIDIA's Multi-Process Service (MPS) for the workers mgpu starts several to a GPU.

Without it, worker processes on one GPU each have a CUDA context of their own, and the GPU
runs one context at a time: switching between them costs. On an H100, 8 processes each
making and reducing 2 GB of a 16 GB dot took 1.20-1.25x the time of one process doing
it all, even taking turns (:mod:`mgpu.worker.turns`); under MPS their work runs in one
server's context, side by side: 0.98x, and 8 processes sharing 16 GEMMs of 8192³ took
0.97x. So a cluster mgpu starts with ``cluster.workers_per_device`` above 1 runs an MPS
control daemon of its own (``cluster.mps``, on by default where NVIDIA's control program
is installed), and stops it with the cluster (``mgpu cluster down`` stops it too where it
had to kill a cluster that did not close). Its pipe and log folders are in a
temporary folder of its own: only the cluster's workers, given that folder, connect, and
the GPU's settings (its compute mode) stay as they are. Workers under MPS take no turns.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CONTROL", "MpsDaemon", "control_program", "start_daemon", "under_mps"]

CONTROL = "nvidia-cuda-mps-control"
# Where the CUDA driver looks for a control daemon's pipe when the environment names none.
DEFAULT_PIPE = "/tmp/nvidia-mps"
# A control daemon starts (or quits) in well under a second; past this it is not coming.
CONTROL_TIMEOUT_S = 10.0


def control_program() -> str | None:
    """The path of NVIDIA's MPS control program, None where it is not installed."""
    return shutil.which(CONTROL)


def under_mps() -> bool:
    """Whether this process's CUDA work goes to an MPS server: a control daemon's pipe is
    where the CUDA driver looks for one (``CUDA_MPS_PIPE_DIRECTORY``, or its default)."""
    folder = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE
    return os.path.exists(os.path.join(folder, "control"))


@dataclass
class MpsDaemon:
    """A running MPS control daemon, private to one cluster (see :func:`start_daemon`)."""

    program: str
    folder: Path
    stopped: bool = field(default=False)

    @property
    def env(self) -> dict[str, str]:
        """What a worker's environment needs to reach this daemon (and no other)."""
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self.folder / "log"),
        }

    def stop(self) -> None:
        """Tell the daemon to quit (its server with it) and remove its folder; once."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                [self.program],
                input=b"quit\n",
                env={**os.environ, **self.env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=CONTROL_TIMEOUT_S,
                check=False,
            )
        shutil.rmtree(self.folder, ignore_errors=True)


def start_daemon(program: str) -> MpsDaemon:
    """Start an MPS control daemon of ``program`` with its pipe and log folders in a new
    temporary folder; its server starts when the first worker connects.

    Raises
    ------
    RuntimeError
        Where the daemon does not start (its own words in the message).
    """
    daemon = MpsDaemon(program, Path(tempfile.mkdtemp(prefix="mgpu-mps-")))
    for name in ("pipe", "log"):
        (daemon.folder / name).mkdir()
    said = daemon.folder / "log" / "start.txt"
    try:
        # Its output into a file, not a pipe: the daemon it forks might hold a pipe open.
        with open(said, "wb") as out:
            done = subprocess.run(
                [program, "-d"],
                env={**os.environ, **daemon.env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                timeout=CONTROL_TIMEOUT_S,
                check=False,
            )
    except (OSError, subprocess.SubprocessError) as e:
        shutil.rmtree(daemon.folder, ignore_errors=True)
        raise RuntimeError(f"{program} -d did not start: {e}") from None
    if done.returncode != 0:
        words = said.read_text(errors="replace").strip()
        shutil.rmtree(daemon.folder, ignore_errors=True)
        raise RuntimeError(f"{program} -d exited with {done.returncode}" + (f": {words}" if words else ""))
    return daemon
