"""A login-node cluster without `hpc-garage run`: what `task_runner()` starts when no job handed it one.

A SpecCluster whose workers are one node of the site, fitted to this machine (`launchers.local.local_layout`),
and whose scheduler places resource tasks as every cluster hpc-garage starts does (`cluster.placement`).
prefect-dask builds it from its dotted name (`cluster_class`), so importing this module stays cheap until
`LocalSiteCluster` is first asked for.
"""

from __future__ import annotations

import os
from typing import Any

from hpc_garage.core.site import Site
from hpc_garage.launchers.common import local_directory
from hpc_garage.launchers.local import local_layout, worker_specs
from hpc_garage.variables import SITE_ENV


def cluster_specs(workers: list[Any], *, security: Any = None, env: dict[str, str] | None = None,
                  local_directory: str | None = None, processes: bool = True,
                  dashboard_address: str | None = ":0") -> tuple[dict[str, Any], dict[str, Any]]:
    """SpecCluster's `scheduler` and `workers` specs: loopback only, TLS when a Security is given.

    `processes` and `dashboard_address` mean what they mean to distributed.LocalCluster (prefect-dask
    documents them): processes=False makes each worker a thread pool of this process, with its threads,
    memory limit and resources, sharing this process's environment and cores; dashboard_address=None: no
    dashboard.
    """
    from distributed import Scheduler, Worker

    from hpc_garage.cluster.placement import FreeResourcePlacement

    protocol = "tls" if security is not None else "tcp"
    dashboard = ({"dashboard_address": dashboard_address} if dashboard_address is not None
                 else {"dashboard_address": ":0", "dashboard": False})  # its HTTP routes still bind: a free port
    scheduler = {"cls": Scheduler, "options": {"host": "127.0.0.1", "port": 0, **dashboard,
                                                "security": security, "protocol": protocol,
                                                "plugins": [FreeResourcePlacement()]}}  # see placement.py
    specs = worker_specs(workers, security=security, env=env, local_directory=local_directory)
    if not processes:  # a thread pool of this process has no environment or cores of its own: Nanny options
        specs = {name: {"cls": Worker, "options": {k: v for k, v in spec["options"].items()
                                                   if k not in ("env", "worker_class")}}
                 for name, spec in specs.items()}
    return scheduler, specs


def _spec_cluster_class() -> type:
    from distributed import SpecCluster

    from hpc_garage.compat import quiet_expected_closes
    from hpc_garage.sites import load_site

    class LocalSiteCluster(SpecCluster):
        """A SpecCluster whose workers are one node of a site (see the module docstring)."""

        def __init__(self, site: str | Site | None = None, security: Any = None,
                     env: dict[str, str] | None = None, processes: bool = True,
                     dashboard_address: str | None = ":0", **kwargs: Any) -> None:
            if not isinstance(site, Site):
                site = load_site(site or os.environ.get(SITE_ENV) or "local")
            self.site_layout, self.notes = local_layout(site)  # SpecCluster already has a `plan`
            scheduler, workers = cluster_specs(self.site_layout.workers, security=security, env=env,
                                               local_directory=local_directory(site.local_directory),
                                               processes=processes, dashboard_address=dashboard_address)
            quiet_expected_closes()  # its scheduler runs in this process
            super().__init__(workers=workers, scheduler=scheduler, security=security,
                             name=f"hpc-garage-{site.name}", **kwargs)

    return LocalSiteCluster


def __getattr__(name: str) -> Any:
    # built on first use so importing this module does not import distributed
    if name == "LocalSiteCluster":
        cls = _spec_cluster_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
