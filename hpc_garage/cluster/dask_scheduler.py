"""The Dask scheduler of a run, in `run`'s own process (so it never takes a GPU worker's place).

`new` makes it with placement, `start` brings it up with progress installed before any worker or task arrives;
`import_beside` imports what the workers preload (Prefect) in a thread beside it; `retire` closes the workers
before it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from hpc_garage.launchers.common import security_from

if TYPE_CHECKING:
    from distributed import Scheduler

    from hpc_garage.cluster.progress import RunProgress
    from hpc_garage.core.site import Site
    from hpc_garage.launchers.common import Launcher
    from hpc_garage.rundir import RunDir

__all__ = ["import_beside", "new", "retire", "start"]


def new(launcher: Launcher, rundir: RunDir, tls: dict[str, str] | None,
        settings: Mapping[str, Any] | None = None) -> Scheduler:
    """The scheduler, not started yet (the caller holds it from now on, so that teardown closes it whatever
    step start-up stops at): TLS unless `tls` is None (its credentials written first), resource tasks placed
    only on workers with them free (cluster/placement.py, every launcher). `settings`: Dask configuration for
    this cluster's size (launchers.common.cluster_settings), set before the scheduler reads it."""
    import dask
    from distributed import Scheduler

    from hpc_garage.cluster.placement import install

    if tls is not None:
        rundir.write_credentials()
    dask.config.set(dict(settings or {}))  # as the workers have them (run's worker environment)
    scheduler = Scheduler(port=0, dashboard_address=":0", security=security_from(tls),
                          protocol="tls" if tls else "tcp",
                          scheduler_file=str(rundir.dask_scheduler_file), **launcher.scheduler_host)
    install(scheduler)
    return scheduler


async def start(scheduler: Scheduler, site: Site, rundir: RunDir, api_env: Mapping[str, str],
                write: Callable[[dict[str, Any]], None]) -> RunProgress:
    """Start it, with the run's progress installed before any worker or task arrives (cluster/progress.py:
    trials, GPUs, links, the report; `write` keeps its figures). Started after COMMAND, so that Dask's imports
    (about a second) overlap COMMAND's."""
    from hpc_garage.cluster.progress import install as install_progress

    await scheduler
    progress = await install_progress(scheduler, write, vendor=site.node.gpu_vendor, api=api_env,
                                      noted=rundir.flow_runs,  # the flow runs COMMAND's task runners noted
                                      metrics=rundir.metrics_summary,  # what the trials reported
                                      spool_dir=rundir.path)  # finished trials' records till the report
    os.chmod(rundir.dask_scheduler_file, 0o600)  # Dask writes it 0644; it names the cluster's address
    return progress


def import_beside(modules: list[str]) -> threading.Thread:
    """Import what the workers preload (Prefect) here too, while the workers start: the scheduler unpickles
    each task it is sent, and the first Prefect task would otherwise import Prefect inside the scheduler's
    event loop, stalling every worker and client for ~2 s (measured) just as the sweep starts."""
    import importlib

    def load() -> None:
        for name in modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)

    thread = threading.Thread(target=load, name="hpc-garage-preload", daemon=True)
    thread.start()
    return thread


async def retire(scheduler: Any) -> None:
    """Close workers (and their nannies) first, so none is left heartbeating into a closed scheduler."""
    if scheduler.workers:
        quiet = logging.getLogger("distributed.scheduler")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # a nanny told to terminate hangs up without a reply
        with contextlib.suppress(Exception):
            await asyncio.wait_for(scheduler.broadcast(msg={"op": "terminate", "reason": "hpc-garage run ended"},
                                                       nanny=True, on_error="ignore"), 20)
        quiet.setLevel(level)
        deadline = time.monotonic() + 10
        while scheduler.workers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
