"""One Prefect API for the whole job: the user's, or one hpc-garage-owned `prefect server start` per host.

api.py        which API: the user's (PREFECT_API_URL, or the active profile), else ours
managed.py    ours: reused if it answers, else started (its keeper), stopped, shown; the one a run used, found again
keeper.py     the process that runs the server (`python -m hpc_garage.prefect.server keep`) and stops it when idle
postgres.py   its database: SQLite, a PostgreSQL of the user's own, or the user's URL
processes.py  /proc: the processes that use it (leases), that are its own, and stopping them
state.py      its directory (ServerDir: every name in it, per machine and bind address) and its record
ui.py         Prefect's UI on it, behind its auth string
Every name the rest of hpc-garage uses is imported from here.
"""

from __future__ import annotations

from hpc_garage.prefect.server.state import IDLE_DEFAULT, LOOPBACK, QUIET, ServerDir, ServerState, machine_name
from hpc_garage.prefect.server.postgres import Database, ManagedPostgres, database_choice, postgres_bin
from hpc_garage.prefect.server.ui import ui_base, ui_settings, ui_status
from hpc_garage.prefect.server.managed import (BATCHING, START_TIMEOUT, auth_string, ensure_server, managed_api,
                                               server_status, stop_server)
from hpc_garage.prefect.server.api import configured_api_url, ensure_api

__all__ = ["BATCHING", "IDLE_DEFAULT", "LOOPBACK", "QUIET", "START_TIMEOUT", "Database", "ManagedPostgres",
           "ServerDir", "ServerState", "auth_string", "configured_api_url", "database_choice", "ensure_api",
           "ensure_server", "machine_name", "managed_api", "postgres_bin", "server_status", "stop_server",
           "ui_base", "ui_settings", "ui_status"]
