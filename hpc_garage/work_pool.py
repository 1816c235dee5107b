"""The `hpc-garage` work-pool type as Prefect finds it (`prefect.collections` entry point): the worker of
prefect/pool_worker.py given the batch side of schedulers/flow_run_jobs.py; `hpc-garage worker --site` creates
its pool with that site as the run form's default."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hpc_garage.prefect.pool_worker import PoolWorker
from hpc_garage.schedulers import flow_run_jobs

TYPE = "hpc-garage"


class HpcGarageWorker(PoolWorker):
    type = TYPE
    jobs = flow_run_jobs


def base_job_template(site: str | None) -> dict[str, Any]:
    """The pool's template with `site` as the run form's default (and that site's node in its help)."""
    template = HpcGarageWorker.get_default_base_job_template()
    if site:
        from hpc_garage.core.units import format_bytes, format_walltime
        from hpc_garage.sites import load_site

        loaded = load_site(site)  # refused in one line if it does not load
        properties = template["variables"]["properties"]
        properties["site"]["default"] = site
        node = loaded.node
        properties["gpus_per_node"]["description"] += f" {loaded.name}: {node.gpus}."
        properties["cores_per_node"]["description"] += f" {loaded.name}: {node.cores}."
        properties["mem"]["description"] += f" {loaded.name}: {format_bytes(node.memory)}."
        properties["time"]["description"] += f" {loaded.name}: {format_walltime(loaded.walltime)}."
    return template


RESTART_SECONDS = 30.0  # after Prefect's worker gave up on an API that stopped answering


def serve(pool: str, *, site: str | None = None, name: str | None = None, limit: int | None = None,
          run_once: bool = False, host: str = "127.0.0.1", printer: Callable[[str], None] = print) -> int:
    """`hpc-garage worker`: Prefect's worker loop on the API `ensure_api` gives (the user's, else hpc-garage's
    server, started if need be); its exit code. Prefect's worker exits when its API has not answered for
    minutes (its loops' error threshold); this one starts again on the API as it is then (a managed server
    that was restarted listens elsewhere), and the new worker follows the jobs the old one submitted.
    SIGINT and SIGTERM stop it within seconds, its jobs left running (prefect/pool_signals.py)."""
    import asyncio

    from hpc_garage.prefect import pool_signals
    from hpc_garage.prefect.flow_api import use_api
    from hpc_garage.prefect.server import ensure_api

    pool_signals.stop_on_signals()
    try:
        template = base_job_template(site) if site else None
        while True:
            use_api(ensure_api(host=host))  # the environment, and Prefect's settings (read at import)
            worker = HpcGarageWorker(work_pool_name=pool, name=name, limit=limit, base_job_template=template)
            try:
                signum = asyncio.run(pool_signals.until_signalled(worker.start(run_once=run_once, printer=printer)))
                return 0 if signum is None else pool_signals.exit_code(signum)
            except Exception as exc:  # noqa: BLE001 - only the API's absence is waited out; the rest is raised
                if run_once or "exceeded error threshold" not in _messages(exc):
                    raise
            printer(f"hpc-garage worker: the Prefect API stopped answering; starting again in {RESTART_SECONDS:g} s "
                    "(its jobs go on, and are followed again then)")
            time.sleep(RESTART_SECONDS)
    except pool_signals.Stopped as stopped:
        return stopped.exit_code


def _messages(exc: BaseException) -> str:
    """An exception's text with that of every exception it groups (anyio's task groups wrap them)."""
    inner = getattr(exc, "exceptions", None) or ()
    return " ".join([str(exc), *(_messages(e) for e in inner)])
