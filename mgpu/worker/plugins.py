"""The worker plugin that hands the client's ``mgpu.*`` settings to each worker.

(The worker's device, streams, staging and panels are its runtime: :mod:`mgpu.worker.runtime`.)
"""

from __future__ import annotations

from typing import Any

import dask.config
from distributed import WorkerPlugin

from ..config import Settings

__all__ = ["SettingsSetup"]


class SettingsSetup(WorkerPlugin):
    """Give the worker the client's ``mgpu.*`` settings, checked on the client.

    A cluster mgpu starts would inherit them from the client's Dask configuration, but the
    workers of a cluster it joins were started with their own.

    Parameters
    ----------
    settings
        What :func:`mgpu.config.load` returned on the client.
    """

    name = "mgpu-settings"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def setup(self, worker: Any = None) -> None:
        dask.config.update(dask.config.config, self.settings.as_dask_config(), priority="new")
