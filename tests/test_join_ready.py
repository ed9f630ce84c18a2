"""A joined cluster whose workers have mgpu's setup with the client's settings (as one that
``mgpu cluster up`` holds does) is used as it is: no plugin is registered again, and the
one round trip that finds the workers tells so. Other settings set the workers up again."""

from __future__ import annotations

from typing import Any

import dask.config
from distributed import Client

from mgpu import config
from mgpu.cluster import SLOT, open_cluster, resolve_cluster
from mgpu.spec import ClusterSpec


def test_a_cluster_set_up_with_these_settings_is_not_set_up_again(monkeypatch):
    from conftest import start_local_cluster

    cluster = start_local_cluster(resources={SLOT: 1})
    try:
        rc = resolve_cluster(ClusterSpec(scheduler=cluster.scheduler_address))
        with open_cluster(rc) as first:
            assert len(first.devices) == 2 and first.slots  # the workers' SLOT, from the one survey
        registered: list[str] = []
        real = Client.register_plugin

        def counted(self: Client, plugin: Any, *args: Any, **kwargs: Any) -> Any:
            registered.append(plugin.name)
            return real(self, plugin, *args, **kwargs)

        ran: list[str] = []
        real_run = Client.run

        def run(self: Client, fn: Any, *args: Any, **kwargs: Any) -> Any:
            ran.append(fn.__name__)
            return real_run(self, fn, *args, **kwargs)

        monkeypatch.setattr(Client, "register_plugin", counted)
        monkeypatch.setattr(Client, "run", run)
        with open_cluster(rc) as again:
            assert again.devices == first.devices
        assert registered == []
        assert ran == ["_describe"]  # one round trip found the workers set up, and what they are
        with dask.config.set({"mgpu.io.threads": 3}), open_cluster(rc, settings=config.load()):
            pass
        assert registered[0] == "mgpu-settings"
    finally:
        cluster.close()
