"""Batch systems: one small module each, saying only what differs (directives, commands, environment) and what
it can do; the registry here is the one list of them, and the rest of hpc-garage asks them, never their names."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hpc_garage.core.allocation import Allocation
from hpc_garage.core.errors import AllocationError, UserError
from hpc_garage.core.request import Request
from hpc_garage.schedulers import job_env

if TYPE_CHECKING:  # base imports subprocess: `show` outside a job never needs it
    from hpc_garage.core.site import Site
    from hpc_garage.schedulers.base import BatchSystem
    from hpc_garage.sites.view import SiteView


# Each batch system is one class in its own module (a subclass of base.BatchSystem saying what differs and what
# it can do) and one job-script template; this registry is the only place that lists them. Built-in ones are
# named as "module:Class" and imported on first use (`show` outside a job never imports subprocess).
_SYSTEMS: dict[str, str | type[BatchSystem]] = {
    "slurm": "hpc_garage.schedulers.slurm:Slurm",
    "pbs": "hpc_garage.schedulers.pbs:Pbs",
    "local": "hpc_garage.schedulers.local:Local",
}


def register(cls: type[BatchSystem]) -> type[BatchSystem]:
    """Add a batch system (a class decorator): from then on `get(cls.name)` is it, and so is a job whose
    environment sets its `job_id_variable` (`detect`)."""
    from hpc_garage.core import site_values

    _SYSTEMS[cls.name] = cls
    for names, has in ((site_values.BATCH_SYSTEMS, True), (site_values.SIGNALS_BEFORE_END, cls.signals_before_end),
                       (site_values.LAUNCHES_RANKS, cls.launches_ranks), (site_values.TAKES_JOBS, cls.takes_jobs),
                       (site_values.WORKER_JOBS, bool(cls.jobqueue_job and cls.jobqueue_cluster))):
        if has and cls.name not in names:  # what a site file's `scheduler:` may name, and what the site allows
            names.append(cls.name)
    if cls.job_id_variable and (cls.name, cls.job_id_variable) not in job_env.JOB_ID_VARIABLES:
        job_env.JOB_ID_VARIABLES.append((cls.name, cls.job_id_variable))  # its jobs, known from their environment
    return cls


def get(name: str) -> BatchSystem:
    """The batch system a site names (`scheduler:`); an unknown name is refused in one line."""
    entry = _SYSTEMS.get(name)
    if entry is None:
        raise UserError(f"scheduler {name!r} is not a batch system hpc-garage knows; use one of "
                        f"{', '.join(_SYSTEMS)} in the site file")
    if isinstance(entry, str):
        import importlib

        module, _, attr = entry.partition(":")
        entry = _SYSTEMS[name] = getattr(importlib.import_module(module), attr)
    return entry()


def for_allocation(allocation: Allocation) -> BatchSystem | None:
    """The batch system that granted this allocation; None where it was requested (no job: `show`, `local`)."""
    return get(allocation.source) if allocation.source in _SYSTEMS else None


def detect(env: Mapping[str, str], prefer: str | None = None) -> BatchSystem | None:
    """The batch system whose job this environment belongs to, or None on a login node.

    Slurm's Torque plugin sets PBS_JOBID inside Slurm jobs too, so a site's own scheduler wins a tie.
    """
    present = [name for name, var in job_env.JOB_ID_VARIABLES if env.get(var)]
    if not present:
        return None
    return get(prefer if prefer in present else present[0])


def in_batch_job(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a batch job (of any batch system hpc-garage knows)."""
    env = os.environ if env is None else env
    return any(var in env for _, var in job_env.JOB_ID_VARIABLES)


def in_job_of(site: Site | SiteView, env: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs in a batch job, under a site whose batch system takes jobs (a `local` site
    lays out this machine even inside someone's job)."""
    return in_batch_job(env) and get(site.scheduler).takes_jobs


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id of the batch job this process runs in, or None on a login node."""
    return job_env.job_id(os.environ if env is None else env)


def allocation_from_env(site: Site, env: Mapping[str, str] | None = None) -> Allocation:
    """The allocation of the job this process runs in (SLURM or PBS), read from its environment."""
    env = os.environ if env is None else env
    batch = detect(env, prefer=site.scheduler)
    if batch is None:
        raise AllocationError(
            "not inside a batch job: neither SLURM_JOB_ID nor PBS_JOBID is set; "
            "run under sbatch/salloc/qsub, or pass request flags such as --nodes"
        )
    return batch.allocation_from_env(env, site)


def allocation_for(site: Site | SiteView, request: Request = Request(),
                   env: Mapping[str, str] | None = None) -> Allocation:
    """The job's own allocation when inside one and nothing was requested; otherwise the request."""
    env = os.environ if env is None else env
    if not request.shapes_allocation() and in_job_of(site, env):
        from hpc_garage.sites.view import full

        return allocation_from_env(full(site), env)
    return Allocation.from_request(site, request)


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This process's node as the batch system names it (several slurmd on one host differ only here)."""
    import socket

    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def node_rank(env: Mapping[str, str] | None = None) -> int | None:
    """The index of this process's node in the job's node list, where the batch system's launcher says."""
    env = os.environ if env is None else env
    value = env.get("SLURM_NODEID", "")
    return int(value) if value.isdigit() else None


def local_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This task's rank among the batch launcher's tasks on its node (srun's), where it says.

    Under an mpirun that SLURM started, the value is its daemon's (0 on every node): MPI's own variables
    are read first (launchers/dask_mpi.py)."""
    env = os.environ if env is None else env
    value = env.get("SLURM_LOCALID", "")
    return int(value) if value.isdigit() else None
