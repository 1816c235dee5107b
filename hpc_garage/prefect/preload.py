"""What a cluster's processes import before their first Prefect task, named on Prefect's side.

Each worker's forkserver imports `hpc_garage.prefect.worker` once per host (else every worker imports Prefect,
~2 s of CPU, when its first task arrives), and the scheduler imports what unpickling a flow's task needs.
The layers that know Prefect hand these names down: the CLI to `hpc-garage run` (`launchers.common.Preload`),
which gives the workers theirs in $HPC_GARAGE_WORKER_PRELOAD; launchers/ only carry names. Light on purpose:
the CLI imports this before deciding anything, and Prefect itself is only looked for, not imported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from hpc_garage.variables import WORKER_PRELOAD, modules

WORKER_MODULE = "hpc_garage.prefect.worker"  # Prefect's task path and its one-time set-up
# What the scheduler needs to unpickle a flow script's Prefect tasks (it does, for every task it is sent).
SCHEDULER_MODULES = ("prefect.flows", "hpc_garage.prefect.task_runner")


def worker_preload(env: Mapping[str, str]) -> list[str]:
    """Modules every worker process starts with: $HPC_GARAGE_WORKER_PRELOAD (comma-separated), else
    distributed and, where Prefect is installed, its task path."""
    if (given := modules(env, WORKER_PRELOAD)) is not None:
        return given
    with_prefect = importlib.util.find_spec("prefect") is not None
    return ["distributed", *((WORKER_MODULE,) if with_prefect else ())]


def scheduler_preload(env: Mapping[str, str]) -> list[str]:
    """What the scheduler's process imports while the workers start: Prefect's task modules where the workers
    preload Prefect (Prefect installed, and $HPC_GARAGE_WORKER_PRELOAD unset or naming it)."""
    return list(SCHEDULER_MODULES) if WORKER_MODULE in worker_preload(env) else []
