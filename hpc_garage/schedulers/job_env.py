"""The batch job this process runs in, read from its environment alone.

Small on purpose: the flow's side (cluster/handoff.py, which prefect/ uses) refuses a scheduler file of another
job, and needs only this, not the batch systems' machinery (`schedulers.get`, job scripts, commands).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from hpc_garage.core.errors import AllocationError

# (batch system, its job id variable), in the order a tie is decided; `schedulers.register` adds a new system's
JOB_ID_VARIABLES = [("slurm", "SLURM_JOB_ID"), ("pbs", "PBS_JOBID")]
JOB_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\[\]-]*")


def checked_job_id(variable: str, value: str | None) -> str | None:
    """`value` of `variable` as a job id, or None when unset; one that could not be a job id (`../x`) is refused,
    since it names the job's run directory."""
    if value and (not JOB_ID.fullmatch(value) or ".." in value):
        raise AllocationError(f"{variable}={value!r} is not a job id (like 12, 12.server or 12_3); "
                              "check the job's environment")
    return value or None


def job_id(env: Mapping[str, str]) -> str | None:
    """The id of the batch job this environment belongs to, or None on a login node."""
    for _, variable in JOB_ID_VARIABLES:
        if env.get(variable):
            return checked_job_id(variable, env[variable])
    return None
