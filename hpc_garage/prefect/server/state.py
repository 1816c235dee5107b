"""Where a managed server is recorded: one per (user, machine, bind address), so that every caller finds it.

In `~/.hpc-garage/prefect/<short hostname>/` (0700; per machine because ~ is usually shared by every node), its
server directory; `ServerDir` owns every name in it, nobody else spells one:
  server.json (0600)  url, pid, auth, host, port: the server handed out (the keeper removes it as it leaves)
  server.log          the keeper's and the server's output                 home/   its PREFECT_HOME
  lock                held while checking, starting or stopping, so concurrent callers share one server
  leases/<pid>        one per process that was handed the server (processes.py)
  activity.json       the keeper's last look: when the server was last in use, its idle limit
  postgres.json (0600), postgres/   a managed PostgreSQL's password and its files (postgres.py)
A bind address other than 127.0.0.1 gets its own subdirectory `bind-<host>/` (and its own server).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc_garage.files import locked, read_json, write_json
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


@dataclass(frozen=True)
class ServerDir:
    """One managed server's directory: every path in it (the table above), what is read and written there."""

    path: Path

    @classmethod
    def of(cls, host: str = LOOPBACK, machine: str | None = None) -> ServerDir:
        """Where the server of `machine` (default: this one) and bind address `host` is kept; creates nothing
        (another machine's is read through the home directory it shares with this one)."""
        base = Path.home() / ".hpc-garage" / "prefect" / (machine or machine_name())
        return cls(base if host in (LOOPBACK, "localhost") else base / f"bind-{host}")

    @classmethod
    def here(cls, host: str = LOOPBACK) -> ServerDir:
        """This machine's, made private (0700, and each parent up to ~/.hpc-garage) if it was not."""
        directory = cls.of(host)
        directory.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        for d in (directory.path, *directory.path.parents):
            if d == Path.home() / ".hpc-garage":
                break
            os.chmod(d, 0o700)
        return directory

    # ---- the server that runs

    @property
    def state_file(self) -> Path:
        return self.path / "server.json"

    def state(self) -> ServerState | None:
        """The server recorded here; None where there is none (or its record is unreadable)."""
        try:
            return ServerState(**json.loads(self.state_file.read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def record(self, state: ServerState) -> None:
        """The server answers: from now on it is handed out."""
        write_json(self.state_file, asdict(state), indent=2)

    def forget(self) -> None:
        """No server is handed out from here (it is leaving, or gone)."""
        self.state_file.unlink(missing_ok=True)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held while a caller checks, starts or stops the server, and while the keeper leaves."""
        with locked(self.path / "lock"):
            yield

    # ---- the keeper's

    @property
    def log_file(self) -> Path:
        return self.path / "server.log"

    @property
    def home(self) -> Path:
        """The server's PREFECT_HOME: its SQLite database and its copy of the UI."""
        return self.path / "home"

    @property
    def activity_file(self) -> Path:
        return self.path / "activity.json"

    def activity(self) -> dict[str, Any]:
        """The keeper's last look (pid, server_pid, last_activity, checked, idle_timeout); {} before its first."""
        return read_json(self.activity_file) or {}

    def write_activity(self, activity: dict[str, Any]) -> None:
        write_json(self.activity_file, activity)

    # ---- its users (processes.py) and its PostgreSQL (postgres.py)

    @property
    def leases(self) -> Path:
        return self.path / "leases"

    def lease(self, pid: int) -> Path:
        return self.leases / str(pid)

    @property
    def postgres_secrets(self) -> Path:
        """0600: the managed PostgreSQL's password; the server's URL is built from it."""
        return self.path / "postgres.json"

    @property
    def postgres_files(self) -> Path:
        """The managed PostgreSQL's data and socket (elsewhere when run as root: postgres.py)."""
        return self.path / "postgres"


def machine_name() -> str:
    """This machine's short host name: what names its servers' directories."""
    return socket.gethostname().split(".")[0]


def url_host(host: str) -> str:
    """An address clients can use: the machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host
