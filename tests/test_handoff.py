"""cluster/handoff.py: what a flow connected through the handoff asks of the scheduler."""

from __future__ import annotations

import dask
from distributed import Client, LocalCluster

from hpc_garage.cluster.handoff import workers_now


def test_the_workers_are_all_counted_while_the_clients_own_refresh_runs() -> None:
    # The client refreshes its cached scheduler identity (which lists no worker) every 5 ms here, as it does
    # every 2 s by default; a count read from that cache saw 0 of 6 workers in an adaptive-pool test.
    with dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}), \
            LocalCluster(n_workers=3, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        counts = {len(workers_now(client)) for _ in range(300)}
        names = {w["name"] for w in workers_now(client).values()}
    assert counts == {3}
    assert names == {0, 1, 2}
