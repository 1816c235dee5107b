"""What a worker forkserver imports and sets up once per host, so that no worker does it at its first task.

`launchers.common.worker_preload()` names this module where Prefect is installed. Forked workers inherit
everything here: Prefect's task engine and the modules that unpickling a flow script's task brings in
(prefect.flows, hpc_garage.prefect, prefect-dask), Prefect's logging configuration, and the context models
`hydrated_context` rebuilds before every task (a no-op once done). Measured: the first task on a fresh
worker started 0.8 s after its submission with only the imports preloaded.
"""

from __future__ import annotations

import prefect.flows  # noqa: F401 - preloaded for the workers forked after this
import prefect.task_engine  # noqa: F401
from prefect._internal.result_records import ResultRecordMetadata
from prefect.context import FlowRunContext, TaskRunContext
from prefect.flows import Flow
from prefect.logging.configuration import ensure_logging_setup
from prefect.tasks import Task

import hpc_garage.prefect  # noqa: F401
import hpc_garage.prefect_fast  # noqa: F401


def warm() -> None:
    """Prefect's one-time set-up of a process that runs tasks: logging, and the context models' rebuild."""
    ensure_logging_setup()
    types = {"Flow": Flow, "Task": Task, "ResultRecordMetadata": ResultRecordMetadata}
    FlowRunContext.model_rebuild(_types_namespace=types)
    TaskRunContext.model_rebuild(_types_namespace=types)


warm()
