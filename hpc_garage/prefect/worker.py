"""What a worker forkserver imports and sets up once per host, so that no worker does it at its first task.

`prefect.preload.worker_preload()` names this module where Prefect is installed. Forked workers inherit
everything here: Prefect's task engine and the modules that unpickling a flow script's task brings in
(prefect.flows, hpc_garage.prefect.task_runner, prefect-dask), Prefect's logging configuration, and the context models
`hydrated_context` rebuilds before every task (a no-op once done), Prefect's collections (entry points) and
the flow engine with Prefect's user API. Measured: the first task on a fresh worker started 0.8 s after its
submission with only the imports preloaded, and 0.55-0.8 s with all but the last two (2026-11-29, a profile of
its first `run_task`: the flow engine's import 0.22 s, the collections 0.17 s).
"""

from __future__ import annotations

import prefect.flow_engine  # noqa: F401 - outage.install's hook at a task's first runner (0.2 s)
import prefect.flows  # noqa: F401 - preloaded for the workers forked after this
import prefect.main  # noqa: F401 - Prefect's user API, which flow_engine's first attribute loads (0.2 s)
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
    load_prefect_collections()  # entry points, read by the first block lookup (hydrated_context: 0.17 s)
    hold_term()  # the batch system's first SIGTERM stops the trials, not the worker (cluster/stopping.py)


warm()
