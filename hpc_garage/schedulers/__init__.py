"""Batch systems: one small module each, saying only what differs (directives, commands, environment)."""

from __future__ import annotations

from collections.abc import Mapping

from hpc_garage.schedulers.base import BatchSystem


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
    present = [name for name, var in (("slurm", "SLURM_JOB_ID"), ("pbs", "PBS_JOBID")) if env.get(var)]
    if not present:
        return None
    return get(prefer if prefer in present else present[0])
