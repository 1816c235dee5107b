"""Batch systems: one small module each, saying only what differs (directives, commands, environment)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hpc_garage.core.allocation import Allocation
from hpc_garage.core.errors import AllocationError
from hpc_garage.core.request import Request
from hpc_garage.schedulers.job_env import JOB_ID_VARIABLES, job_id as _env_job_id

if TYPE_CHECKING:  # base imports subprocess: `show` outside a job never needs it
    from hpc_garage.core.site import Site
    from hpc_garage.schedulers.base import BatchSystem
    from hpc_garage.sites.view import SiteView


def get(name: str) -> BatchSystem:
    """The batch system a site names (`slurm`, `pbs`, `local`)."""
    if name == "slurm":
        from hpc_garage.schedulers.slurm import Slurm

        return Slurm()
    if name == "pbs":
        from hpc_garage.schedulers.pbs import Pbs

        return Pbs()
    if name == "local":
        from hpc_garage.schedulers.local import Local

        return Local()
    raise ValueError(f"unknown batch system {name!r}")


def detect(env: Mapping[str, str], prefer: str | None = None) -> BatchSystem | None:
    """The batch system whose job this environment belongs to, or None on a login node.

    Slurm's Torque plugin sets PBS_JOBID inside Slurm jobs too, so a site's own scheduler wins a tie.
    """
    present = [name for name, var in JOB_ID_VARIABLES if env.get(var)]
    if not present:
        return None
    return get(prefer if prefer in present else present[0])


def in_batch_job(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a SLURM or PBS job."""
    env = os.environ if env is None else env
    return any(var in env for _, var in JOB_ID_VARIABLES)


def job_id(env: Mapping[str, str] | None = None) -> str | None:
    """The id of the batch job this process runs in, or None on a login node."""
    return _env_job_id(os.environ if env is None else env)


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
    if not request.shapes_allocation() and site.scheduler != "local" and in_batch_job(env):
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
