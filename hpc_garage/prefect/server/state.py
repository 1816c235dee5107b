"""Where a managed server is recorded: one per (user, machine, bind address), so that every caller finds it.

In `~/.hpc-garage/prefect/<short hostname>/` (0700; per machine because ~ is usually shared by every node):
  server.json (0600) url, pid, auth, host, port    server.log   the server's output    home/  PREFECT_HOME
  lock               held while checking or starting, so concurrent callers share one server
  leases/<pid>        one per process that was handed the server (processes.py)
  activity.json       the keeper's last look: when the server was last in use, its idle limit
A bind address other than 127.0.0.1 gets its own subdirectory `bind-<host>/` (and its own server).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from hpc_garage.prefect_api import PrefectApi, auth_headers
from hpc_garage.variables import PREFECT_SERVER_ENV

LOOPBACK = "127.0.0.1"
QUIET = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
IDLE_DEFAULT = 1800.0  # s unused before the server stops (HPC_GARAGE_PREFECT_SERVER_IDLE)


@dataclass(frozen=True)
class ServerState:
    url: str  # ends in /api, as PREFECT_API_URL wants it
    pid: int
    auth: str
    host: str
    port: int
    started: float
    database: str = "sqlite"  # what `server status` says: sqlite, postgresql (managed) or the URL's host
    idle_timeout: float = IDLE_DEFAULT
    ui: str = ""  # the UI's base URL (flow runs under its /runs/flow-run/<id>); "": started without it

    def client_env(self) -> dict[str, str]:
        """The API's address and auth, and which managed server it is: a flow that outlives it keeps that
        (prefect/outage.py), and `hpc-garage replay` then finds the one running now (`managed_api`)."""
        return {"PREFECT_API_URL": self.url, "PREFECT_API_AUTH_STRING": self.auth, **QUIET,
                **({"PREFECT_UI_URL": self.ui} if self.ui else {}),  # Prefect's "View at" links
                PREFECT_SERVER_ENV: json.dumps({"machine": machine_name(), "host": self.host,
                                                "database": self.database})}

    def api(self, timeout: float) -> PrefectApi:
        """hpc-garage's client for this server's API (its address is ours: never through a proxy)."""
        return PrefectApi(self.url, headers=auth_headers({"PREFECT_API_AUTH_STRING": self.auth}), timeout=timeout,
                          own=True)


def read_state(directory: Path) -> ServerState | None:
    """The server recorded in `directory`'s server.json; None where there is none (or it is unreadable)."""
    try:
        return ServerState(**json.loads((directory / "server.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def machine_name() -> str:
    """This machine's short host name: what names its servers' state directory."""
    return socket.gethostname().split(".")[0]


def state_dir(host: str = LOOPBACK) -> Path:
    """Per machine because ~ is usually shared by every node of a cluster; per bind address under it."""
    directory = state_path(host, machine_name())
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in (directory, *directory.parents):
        if d == Path.home() / ".hpc-garage":
            break
        os.chmod(d, 0o700)
    return directory


def state_path(host: str, machine: str) -> Path:
    base = Path.home() / ".hpc-garage" / "prefect" / machine
    return base if host in (LOOPBACK, "localhost") else base / f"bind-{host}"


def url_host(host: str) -> str:
    """An address clients can use: the machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host
