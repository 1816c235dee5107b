"""The one Prefect API of a flow and its workers: the one Prefect's settings name, else hpc-garage's own server.

Without one, each Dask worker process would start its own temporary server on one SQLite file. The task
runner settles it when the flow is decorated (`task_runner()`), before the flow's first API call; the
work-pool worker (`hpc-garage worker`) exports it before each start of Prefect's worker loop.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlsplit

__all__ = ["local_address_towards", "settle_api", "use_api"]


def settle_api(host: str = "127.0.0.1") -> dict[str, str]:
    """The Prefect API of this flow and its workers, as the environment a worker needs to reach it.

    The one Prefect's current settings name, when they name one: the environment and profile as Prefect
    read them, or settings made in code (`prefect_test_harness()`, `temporary_settings`); this process
    uses it already and nothing is exported. Otherwise `ensure_api` (the environment and profile as they
    are now, else hpc-garage's server, started if need be), exported to this process.
    """
    from prefect.settings import get_current_settings

    from hpc_garage.prefect.server import ensure_api

    api = get_current_settings().api
    if api.url:
        env = {"PREFECT_API_URL": str(api.url)}
        for name, secret in (("PREFECT_API_AUTH_STRING", api.auth_string), ("PREFECT_API_KEY", api.key)):
            if secret is not None and secret.get_secret_value():
                env[name] = secret.get_secret_value()
        return env
    env = ensure_api(host=host)
    use_api(env)
    return env

_api_in_use: list[str] = []  # the API URL use_api last exported here


def use_api(env: dict[str, str]) -> None:
    """Export the API to this process and its future children; Prefect read its settings at import.

    A process that already sent Prefect events and logs to another API (hpc-garage's own server, idled out
    and started again on another port; a notebook that runs flows for hours) keeps Prefect's events and log
    workers bound to the old one: the new API would never hear of the task runs, and every flow would wait
    for them. Those workers are stopped, so that Prefect starts them again on the new API."""
    url = env.get("PREFECT_API_URL", "")
    if all(os.environ.get(k) == v for k, v in env.items()) and _api_in_use[-1:] in ([], [url]):
        return
    import prefect.context

    os.environ.update(env)
    prefect.context.refresh_global_settings_context()
    if _api_in_use and _api_in_use[-1] != url:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for service in (EventsWorker, APILogWorker):  # what they still queue was for the old API
            service.drain_all(timeout=2, at_exit=False)
    _api_in_use[:] = [url]


def local_address_towards(address: str) -> str:
    """This machine's address on the scheduler's network: where workers can reach a server we start."""
    host = urlsplit(address).hostname or "127.0.0.1"
    if host in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, urlsplit(address).port or 8786))  # UDP: picks a route, sends nothing
            return str(s.getsockname()[0])
    except OSError:
        return "0.0.0.0"
