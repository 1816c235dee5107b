"""The keeper: `python -m hpc_garage.prefect.server keep`, the process `managed.py` starts in the server directory.

It starts `prefect server start` (through serve.py) and a PostgreSQL (postgres.py) as its children and stops
them and itself once the server has been unused for HPC_GARAGE_PREFECT_SERVER_IDLE seconds (default 1800). In use means: a process
it was handed to still runs (a lease), or the API's flow-run and task-run counts per state moved since the last
look, or the API did not answer (a busy server is a used one), or a work-pool worker is online or a deployment
has an active schedule. It stops under the same lock `ensure_server` takes, after forgetting its record (state.py),
so an exiting server is never handed out.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.log import setup as setup_messages
from hpc_garage.prefect.server.postgres import ManagedPostgres, database_choice
from hpc_garage.prefect.server.processes import die_with_parent, leases_last_use, stop_child
from hpc_garage.prefect.server.state import ServerDir, ServerState, url_host
from hpc_garage.variables import PREFECT_SERVER_IDLE

ACTIVE_STATES = ("PENDING", "RUNNING", "CANCELLING", "PAUSED", "SCHEDULED")

logger = logging.getLogger(__name__)


def keep(argv: list[str]) -> int:
    """`python -m hpc_garage.prefect.server keep`: run the server (and its PostgreSQL) until idle or told to stop."""
    import argparse

    parser = argparse.ArgumentParser(prog="hpc_garage.prefect.server keep")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--idle", type=float, required=True)
    parser.add_argument("--no-ui", dest="ui", action="store_false")
    args = parser.parse_args(argv)
    setup_messages(label="hpc-garage server keeper", clock=True, stream="stdout")  # its log: `...[12:00:00]: ...`
    directory = ServerDir(Path.cwd())  # managed._start runs the keeper in the server directory
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    postgres: ManagedPostgres | None = None
    server: subprocess.Popen[bytes] | None = None
    env = dict(os.environ)
    try:
        if not _port_free(args.host, args.port):  # said at once: Prefect's own check comes after its import (2-7 s)
            raise UserError(f"port {args.port} of {args.host} is already in use: another process took it after "
                            "hpc-garage chose it; run again (a new port is chosen)")
        database = database_choice(env)
        if database.kind == "postgresql":
            postgres = ManagedPostgres(directory)
            logger.info(f"starting PostgreSQL in {postgres.data} (socket in {postgres.socket_dir})")
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = postgres.start(sys.stdout.fileno())
        elif database.kind == "url" and database.url:
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database.url
        server = subprocess.Popen([sys.executable, "-m", "hpc_garage.prefect.server", "prefect", "server", "start",
                                   "--host", args.host, "--port", str(args.port), *([] if args.ui else ["--no-ui"]),
                                   "--analytics-off"],
                                  env=env, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent(signal.SIGTERM))
        url = f"http://{url_host(args.host)}:{args.port}/api"
        state = ServerState(url=url, pid=os.getpid(), auth=env["PREFECT_SERVER_API_AUTH_STRING"], host=args.host,
                            port=args.port, started=time.time(), idle_timeout=args.idle)
        def stop() -> None:
            stop_child(server, signal.SIGTERM, grace=6.0)
            if postgres is not None:
                postgres.stop()

        return _watch(directory, state, server, args.idle, stop)
    except UserError as exc:
        logger.error(str(exc))
        return 2
    except subprocess.CalledProcessError as exc:
        logger.error(f"{' '.join(map(str, exc.cmd))} exited with code {exc.returncode}")
        return 3
    finally:
        if server is not None:
            stop_child(server, signal.SIGTERM, grace=6.0)
        if postgres is not None:
            postgres.stop()


def _watch(directory: ServerDir, state: ServerState, server: subprocess.Popen[bytes], idle: float,
           stop: Callable[[], None]) -> int:
    """Look every few seconds whether the server is used; stop once it has not been for `idle` seconds.

    `stop` (the server, then its PostgreSQL) runs under the lock: a new server starts on the same database
    files only after this one has let go of them."""
    interval = max(0.5, min(30.0, idle / 6))
    last_use, seen = time.time(), None

    def record(now: float) -> None:
        directory.write_activity({"pid": state.pid, "server_pid": server.pid, "last_activity": last_use,
                                  "checked": now, "idle_timeout": idle})

    record(last_use)
    while True:
        try:
            server.wait(timeout=interval)  # its exit is seen at once, not at the next look
        except subprocess.TimeoutExpired:
            pass
        now = time.time()
        if (code := server.poll()) is not None:
            logger.error(f"prefect server start exited with code {code}")
            if _handed_out(directory, state):
                with directory.locked():
                    _forget(directory, state)
                    stop()
            else:  # it never answered: `_start` holds the lock, waiting for it to answer or for us to exit
                stop()
            return code or 1
        counts = _run_counts(state)
        if counts is None or counts != seen or _held(state):  # runs moved, too busy to answer, or needed
            last_use, seen = now, counts
        last_use = max(last_use, leases_last_use(directory, now))
        record(now)
        if now - last_use < idle:
            continue
        with directory.locked():  # ensure_server waits: nobody is handed a server that is leaving
            if time.time() - max(last_use, leases_last_use(directory, time.time())) < idle:
                continue  # handed out while we waited for the lock
            _forget(directory, state)
            logger.info(f"no flow or task run moved and no user process for {now - last_use:.0f} s "
                        f"({PREFECT_SERVER_IDLE}={idle:g}): stopping")
            stop()
            return 0


def _handed_out(directory: ServerDir, state: ServerState) -> bool:
    """Whether the directory's record names this keeper: `_start` writes it once the server first answers."""
    current = directory.state()
    return current is not None and current.pid == state.pid


def _run_counts(state: ServerState) -> tuple[int, ...] | None:
    """Flow runs and task runs, all and in active states: any change is use. None when it does not answer."""
    counts = []
    for kind in ("flow_runs", "task_runs"):
        for body in ({}, {kind: {"state": {"type": {"any_": list(ACTIVE_STATES)}}}}):
            answer = _api_post(state, f"/{kind}/count", body)
            if not isinstance(answer, int):
                return None
            counts.append(answer)
    return tuple(counts)


def _held(state: ServerState) -> bool:
    """A work-pool worker is online (`hpc-garage worker`, `prefect worker start`: it polls for the runs that
    schedules, the Run button and automations create), or a deployment has an active schedule (the server's
    scheduler creates its runs): the server is needed though no run moves."""
    from urllib.parse import quote

    for pool in _api_post(state, "/work_pools/filter", {}) or []:
        name = pool.get("name") if isinstance(pool, dict) else None
        workers = _api_post(state, f"/work_pools/{quote(name, safe='')}/workers/filter", {}) if name else None
        if any(isinstance(w, dict) and w.get("status") == "ONLINE" for w in workers or []):
            return True
    for deployment in _api_post(state, "/deployments/filter", {"limit": 200}) or []:
        if isinstance(deployment, dict) and not deployment.get("paused") \
                and any(isinstance(s, dict) and s.get("active") for s in deployment.get("schedules") or []):
            return True
    return False


def _api_post(state: ServerState, path: str, body: dict[str, Any]) -> Any:
    try:
        return state.api(timeout=10).post(path, body)
    except (OSError, ValueError):
        return None


def _forget(directory: ServerDir, state: ServerState) -> None:
    """Forget the server if the record still names this keeper (a replacement's is left alone)."""
    current = directory.state()
    if current is not None and current.pid == state.pid:
        directory.forget()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _port_free(host: str, port: int) -> bool:
    """Whether a server can listen on `port` now (bound as uvicorn binds, SO_REUSEADDR: a closed connection's
    TIME_WAIT does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
