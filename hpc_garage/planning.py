"""Glue between the CLI and the pure core: pick the allocation source (the job's environment, or a request)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hpc_garage.allocation import Allocation, in_batch_job

if TYPE_CHECKING:
    from hpc_garage.site import Site
    from hpc_garage.siteview import SiteView


def allocation_for(site: Site | SiteView, env: Mapping[str, str] | None = None, **request: int | None) -> Allocation:
    """The job's own allocation when inside one and nothing was requested; otherwise the request."""
    env = os.environ if env is None else env
    asked = {k: v for k, v in request.items() if v is not None}
    if not asked and site.scheduler != "local" and in_batch_job(env):
        from hpc_garage.siteview import full

        return Allocation.from_env(full(site), env)
    return Allocation.from_request(
        site,
        nodes=asked.get("nodes"),
        gpus_per_node=asked.get("gpus_per_node"),
        cores_per_node=asked.get("cores_per_node"),
        memory=asked.get("mem"),
        walltime=asked.get("walltime"),
    )
