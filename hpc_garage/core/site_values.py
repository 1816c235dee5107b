"""How a site file's values are read: units, and `auto` for the machine a local site runs on.

Shared by the pydantic models (`core.site`, as BeforeValidators) and the pydantic-free view of `show`
(`sites.view`), so both read a value the same way. Pure apart from `auto`, which asks the OS for this
machine's cores and memory.
"""

from __future__ import annotations

import os
from typing import Any

from hpc_garage.core.units import parse_memory, parse_walltime

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
DEFAULT_RUN_DIRECTORY = "~/.hpc-garage/runs"  # a site's `run_directory` where it names none
# What a site's `scheduler:` may name: the batch systems of schedulers/ (its registry), below which the site
# model sits, so it keeps their names alone; `schedulers.register` adds a new system's name here.
BATCH_SYSTEMS = ["slurm", "pbs", "local"]
# ... and what the model checks a site against, by capability (`register` adds a new system's by its own):
SIGNALS_BEFORE_END = ["slurm"]  # it sends a job a signal before its walltime on request (`warning_signal`)
LAUNCHES_RANKS = ["slurm"]  # its own launcher starts a job's ranks on its nodes (`mpi.launch`/`via: srun`)
TAKES_JOBS = ["slurm", "pbs"]  # a queue of jobs (`local`: the run is on this machine, no job)
WORKER_JOBS = ["slurm", "pbs"]  # dask-jobqueue submits worker jobs to it (`launcher: jobqueue`)


def memory(value: Any) -> int:
    return parse_memory(value, bare=None)


def walltime(value: Any) -> int:
    return parse_walltime(value)


def cores(value: Any) -> Any:
    return os.cpu_count() or 1 if value == "auto" else value


def node_memory(value: Any) -> int:
    if value == "auto":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return memory(value)


def walltime_or_zero(value: Any) -> int:
    return 0 if value in (0, "0") else parse_walltime(value)
