"""What a worker forkserver imports and sets up once per host, so that no worker does it at its first task.

`prefect.preload.worker_preload()` names this module where Prefect is installed. Forked workers inherit
everything here: Prefect's task engine and the modules that unpickling a flow script's task brings in
(prefect.flows, hpc_garage.prefect.task_runner, prefect-dask), Prefect's logging configuration, and the context models
`hydrated_context` rebuilds before every task (a no-op once done), Prefect's collections (entry points) and
the flow engine with Prefect's user API. The last two were, by a profile of a fresh worker's first `run_task`,
its two largest costs: every worker paid them at its first task, once per worker instead of once per host.
"""

from __future__ import annotations

import prefect.flow_engine  # noqa: F401 - outage.install's hook at a task's first runner
import prefect.flows  # noqa: F401 - preloaded for the workers forked after this
import prefect.main  # noqa: F401 - Prefect's user API, which flow_engine's first attribute loads
import prefect.task_engine  # noqa: F401
from prefect.logging.configuration import ensure_logging_setup
from prefect.plugins import load_prefect_collections

import hpc_garage.prefect.task_runner  # noqa: F401
from hpc_garage.compat import rebuild_context_models
import hpc_garage.prefect.fast  # noqa: F401
from hpc_garage.cluster.stopping import hold_term


def warm() -> None:
    """Prefect's one-time set-up of a process that runs tasks: logging, and the context models' rebuild."""
    ensure_logging_setup()
    rebuild_context_models()
    load_prefect_collections()  # entry points, read by the first block lookup (hydrated_context)
    hold_term()  # the batch system's first SIGTERM stops the trials, not the worker (cluster/stopping.py)


warm()
