"""The `HPC_GARAGE_*` variables, each named once: those a user may set, read and checked here, and those
hpc-garage sets for its own processes (COMMAND, workers, worker jobs). Nothing else spells one
(tests/test_architecture.py); the one core writes is named in core/variable_names.py and re-exported here.

A bad value is one line naming the variable, its value and what would be accepted (exit 2), never a
traceback or a silent default: `HPC_GARAGE_START_TIMEOUT=abc` is refused, `=nan` too (it would wait forever).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from hpc_garage.core.errors import UserError
from hpc_garage.core.variable_names import CPUS_ENV  # noqa: F401 (core writes it)

START_TIMEOUT = "HPC_GARAGE_START_TIMEOUT"  # seconds `run` gives its workers; COMMAND waits as long
WORKER_PRELOAD = "HPC_GARAGE_WORKER_PRELOAD"  # modules every worker imports before its first task
PLACEMENT = "HPC_GARAGE_PLACEMENT"  # 0: Dask's own placement of resource tasks
PREFECT_FAST = "HPC_GARAGE_PREFECT_FAST"  # 0: prefect-dask's own task submission
SWEEP_ENV = "HPC_GARAGE_SWEEP"  # set by `run` for COMMAND and workers: the sweep and epoch (name@epoch) trials cache under
RESULTS_ENV = "HPC_GARAGE_RESULTS"  # set by `run`: where that epoch's results are persisted
RUN_DIR_ENV = "HPC_GARAGE_RUN_DIR"  # set by `run` for COMMAND: its job's run directory (rundir.py)
PREFECT_SERVER_IDLE = "HPC_GARAGE_PREFECT_SERVER_IDLE"  # seconds with no use before the managed server stops
PREFECT_DATABASE = "HPC_GARAGE_PREFECT_DATABASE"  # sqlite, postgresql (managed) or a postgresql+asyncpg:// URL
PREFECT_SERVER_ENV = "HPC_GARAGE_PREFECT_SERVER"  # set with the managed server's API: its machine, bind, database
PREFECT_UI = "HPC_GARAGE_PREFECT_UI"  # 0: the managed server without Prefect's UI
SITE_ENV = "HPC_GARAGE_SITE"  # the site `run`, `submit` and a flow's local cluster use when none is given
SITES_PATH_ENV = "HPC_GARAGE_SITES_PATH"  # directories (colon-separated) searched for site files first
SYSFS_ROOT_ENV = "HPC_GARAGE_SYSFS_ROOT"  # read <root>/sys, /proc, /dev instead of this node's (tests, `show`)
SCHEDULER_FILE_ENV = "HPC_GARAGE_SCHEDULER_FILE"  # set by `run` for COMMAND once the workers are up: the handoff
JOB_ID_ENV = "HPC_GARAGE_JOB_ID"  # set by `run` for COMMAND: its job (another job's scheduler file is refused)
BENCH_BYPASS_ENV = "HPC_GARAGE_BENCH_BYPASS_OUTAGE_HOOKS"  # bench/fault_cost.py only: "1" prices the outage hooks
POOL_RESOURCES_ENV = "HPC_GARAGE_POOL_RESOURCES"  # set by `run` (jobqueue): what each kind of pool worker offers
CONTAINER_ENV = "HPC_GARAGE_CONTAINER"  # set by `run` as it enters the site's image: the runtime (also: it runs inside)
SECRETS_ENV = "HPC_GARAGE_SECRETS"  # set in a deployment's job script: the private file `run` reads the API's secrets from

_YES = ("1", "true", "yes", "on")
_NO = ("0", "false", "no", "off")


def seconds(env: Mapping[str, str], name: str, default: float) -> float:
    """A positive, finite number of seconds."""
    text = env.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0 or value > 7 * 86400:
        raise UserError(f"{name}={text!r}: give seconds, more than 0 and at most a week, e.g. {name}=180")
    return value


def switch(env: Mapping[str, str], name: str, default: bool, *, also_no: tuple[str, ...] = ()) -> bool:
    """On or off: 1/true/yes/on or 0/false/no/off (any case); unset or empty: `default`."""
    text = env.get(name)
    if text is None or not text.strip():
        return default
    word = text.strip().lower()
    if word in _YES:
        return True
    if word in _NO + also_no:
        return False
    raise UserError(f"{name}={text!r}: give 1 or 0 (true/false, yes/no, on/off)")


def modules(env: Mapping[str, str], name: str) -> list[str] | None:
    """A comma-separated list of importable modules; None when unset. A module that is not installed here is
    refused now: the workers would fail at start-up on every node instead."""
    import importlib.util

    if name not in env:
        return None
    names = [m.strip() for m in env[name].split(",") if m.strip()]
    for module in names:
        try:
            found = importlib.util.find_spec(module) is not None  # (imported here: the CLI's start-up skips it)
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UserError(f"{name}={env[name]!r}: module {module!r} is not installed here; fix the list "
                            f"(comma-separated module names) or unset {name}")
    return names
