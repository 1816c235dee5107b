"""What `run` needs from a jobqueue site before the launcher starts: the workers it waits for before COMMAND,
and when the run ends (which every worker job must end before). Read from the site and the environment
only; nothing is submitted here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import replace

from hpc_garage.core.errors import UserError
from hpc_garage.core.layout import Layout, WorkerSpec
from hpc_garage.core.pools import job_shapes, worker_names
from hpc_garage.core.site import Site

logger = logging.getLogger(__name__)


def initial_layout(site: Site) -> tuple[Layout, list[str]]:
    """What `run` waits for before COMMAND: the workers of each pool's first jobs (its fixed count, or its
    minimum), named as their jobs will name them; and what to say about the pools."""
    from hpc_garage.core.allocation import Allocation

    shapes = job_shapes(site)
    workers: list[WorkerSpec] = []
    nodes = []
    for pool, shape in shapes.items():
        for i in range(shape.site.jobqueue.bounds[0]):
            for spec, name in zip(shape.layout.workers, worker_names(f"{pool}-{i}", shape.workers_per_job)):
                workers.append(replace(spec, name=name, node=len(nodes)))
            nodes.append(shape.node)
    first = next(iter(shapes.values()))
    allocation = Allocation(nodes=tuple(nodes) or (first.node,), source="request", walltime=first.walltime)
    notes = [f"unused in each worker job of pool {pool}: {x}" for pool, shape in shapes.items()
             for x in shape.layout.leftovers]
    return Layout(site=site, allocation=allocation, workers=workers, leftovers=[]), notes


def initial_workers(site: Site) -> list[str]:
    """The workers `run` waits for before COMMAND: those of each pool's first jobs (fixed count, or minimum)."""
    names = []
    for pool, shape in job_shapes(site).items():
        for i in range(shape.site.jobqueue.bounds[0]):
            names += worker_names(f"{pool}-{i}", shape.workers_per_job)
    return names


def run_end_time(site: Site, env: Mapping[str, str], walltime: int | None = None) -> float | None:
    """When the run ends (epoch seconds), which its worker jobs must not outlive: `walltime` from now (`--time`
    for a driver on the login node), else the end of the batch job `run` is in (its driver job), else None."""
    from hpc_garage.schedulers import allocation_from_env, detect, job_id

    if walltime is not None:
        return time.time() + walltime
    batch, job = detect(env, prefer=site.scheduler), job_id(env)
    if batch is None or job is None:
        return None
    with contextlib.suppress(Exception):  # the environment's end time, where the batch system exports it
        if (end := allocation_from_env(site, env).end_time) is not None:
            return end
    try:
        left = batch.time_left(job)
    except UserError as exc:
        logger.warning(f"the driver job's end is unknown ({exc}); worker jobs get the site's walltime")
        return None
    return time.time() + left[0] if left is not None else None
