"""The `local` batch system: no queue, the machine you are on (a laptop, a login node, a test runner)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from hpc_garage.schedulers.base import BatchSystem

if TYPE_CHECKING:
    from hpc_garage.core.allocation import Allocation
    from hpc_garage.core.site import Site


class Local(BatchSystem):
    name = "local"
    takes_jobs = False

    def allocation_from_env(self, env: Mapping[str, str], site: Site) -> Allocation:
        from hpc_garage.core.allocation import Allocation

        return Allocation.from_request(site)
