"""What a worker forkserver imports and sets up once per host, so that no worker does it at its first task.

`prefect.preload.worker_preload()` names this module where Prefect is installed. Forked workers inherit
everything here: Prefect's task engine and the modules that unpickling a flow script's task brings in
(prefect.flows, hpc_garage.prefect.task_runner, prefect-dask), Prefect's logging configuration, and the context models
`hydrated_context` rebuilds before every task (a no-op once done). Measured: the first task on a fresh
worker started 0.8 s after its submission with only the imports preloaded.
"""

from __future__ import annotations

import prefect.flows  # noqa: F401 - preloaded for the workers forked after this
import prefect.task_engine  # noqa: F401
from prefect.logging.configuration import ensure_logging_setup

import hpc_garage.prefect.task_runner  # noqa: F401
from hpc_garage.compat import rebuild_context_models
import hpc_garage.prefect.fast  # noqa: F401
from hpc_garage.cluster.stopping import hold_term


def warm() -> None:
    """Prefect's one-time set-up of a process that runs tasks: logging, and the context models' rebuild."""
    ensure_logging_setup()
    rebuild_context_models()
    hold_term()  # the batch system's first SIGTERM stops the trials, not the worker (cluster/stopping.py)


warm()
