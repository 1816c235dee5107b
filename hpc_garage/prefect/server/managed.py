"""hpc-garage's own `prefect server start`, one per machine and bind address: reused, started, stopped, shown.

It is reused across runs (its PREFECT_HOME persists, so migrations run once and a restart takes ~5 s), listens
on a free port, and asks for a random basic-auth string, because on a shared login node anyone can reach its
port. What is started is its keeper (keeper.py), which starts the server and leaves with it when idle. Prefect
itself is never imported here (≈2 s): the server is a subprocess, and health checks use hpc-garage's plain
HTTP client (hpc_garage/prefect_api.py), which never sends them through a proxy.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.prefect.server.postgres import Database, database_choice, postgres_bin
from hpc_garage.prefect.server.processes import children, hold_lease, leaseholders, process_alive, terminate
from hpc_garage.prefect.server.state import (IDLE_DEFAULT, LOOPBACK, QUIET, ServerDir, ServerState, machine_name,
                                             url_host)
from hpc_garage.prefect.server.ui import ui_base, ui_settings, ui_status
from hpc_garage.prefect_api import no_proxy_for
from hpc_garage.variables import PREFECT_DATABASE, PREFECT_SERVER_IDLE, PREFECT_UI, seconds, switch

logger = logging.getLogger(__name__)

# A sweep reports hundreds of task runs a second. Prefect's defaults record them one message at a time
# (about 40 ms of server CPU per task here); batches of up to 100, flushed every second, cost about half.
# Records reach the database at most a second later (the event persister's only while it keeps up: serve.py).
# The user's settings win. (The task-run recorder truncates its flush interval to whole seconds: 0.5 would make
# it flush in a busy loop.)
BATCHING = {
    f"PREFECT_SERVER_SERVICES_{service}_{knob}": value
    for service in ("TASK_RUN_RECORDER", "EVENT_PERSISTER")
    for knob, value in (("READ_BATCH_SIZE", "100"), ("BATCH_SIZE", "100"), ("FLUSH_INTERVAL", "1"))
} | {"PREFECT_SERVER_SERVICES_TRIGGERS_READ_BATCH_SIZE": "100"}

START_TIMEOUT = 120.0  # a fresh database takes 11–17 s to migrate here; shared file systems are slower
REUSE_PATIENCE = 10.0  # a busy server on a loaded login node is slow, not dead: never replace it hastily


def ensure_server(host: str = LOOPBACK, *, timeout: float = START_TIMEOUT) -> ServerState:
    """Our server for this machine and bind address: the running one if it answers, else a new one.

    The caller holds a lease on it until it exits: the server does not leave while its user runs.
    """
    database = database_choice(os.environ)  # a bad setting is refused before anything starts
    idle = seconds(os.environ, PREFECT_SERVER_IDLE, IDLE_DEFAULT)
    ui = switch(os.environ, PREFECT_UI, True)
    if database.kind == "postgresql":
        postgres_bin()
    directory = ServerDir.here(host)
    # this process, the keeper it may start, and their children reach the server straight, Prefect's own
    # clients included, whatever http_proxy says (issue 23)
    os.environ.update(no_proxy_for([url_host(host)], os.environ))
    for pid, child in list(children.items()):  # servers of ours stopped by someone else (`server stop`, idle)
        if child.poll() is not None:
            children.pop(pid, None)
    with directory.locked():
        state = directory.state()
        if state is not None and process_alive(state.pid) and _answers(state, patience=REUSE_PATIENCE):
            hold_lease(directory)
            return state
        if state is not None:
            terminate(state)  # dead, hung, or answering to another auth string: replace it
        state = _start(directory, host, timeout, idle, database, ui=ui)
        hold_lease(directory)
        return state


def managed_api(recorded: Mapping[str, Any], who: str) -> dict[str, str]:
    """The environment for the managed server a run used (`recorded`: its PREFECT_SERVER_ENV) as it runs now:
    it may have idled out or died and started again on another port with another auth string, and none
    running is started, as for any flow. Refused in one line (`who` says for what) where that server was
    another machine's, or where the one here runs, or would start, on another database than it did."""
    machine, host = str(recorded.get("machine") or "?"), str(recorded.get("host") or LOOPBACK)
    database = str(recorded.get("database") or "sqlite")
    if machine != machine_name():
        raise UserError(f"{who}: its Prefect API was hpc-garage's server on {machine} (host {host}, database "
                        f"{database}); run this on {machine}, or set PREFECT_API_URL to a server on that database")
    state = ServerDir.here(host).state()
    running = state is not None and process_alive(state.pid) and _answers(state, patience=REUSE_PATIENCE)
    now = state.database if running and state is not None else database_choice(os.environ).label()
    if now != database:
        how = "runs on" if running else f"would start on (from {PREFECT_DATABASE})"
        stop = f"stop it (hpc-garage server stop --host {host}), " if running else ""
        raise UserError(f"{who}: its Prefect API was hpc-garage's server on database {database}, and the one here "
                        f"{how} {now}; {stop}set {PREFECT_DATABASE} to that database and retry")
    return ensure_server(host).client_env()


def stop_server(host: str = LOOPBACK, *, force: bool = True) -> bool:
    """Stop our server for this machine and bind address; False when none was running. `force=False` (what
    `hpc-garage server stop` does unless given --force): UserError, and nothing stopped, while processes it
    was handed still run: a sweep that loses its API mid-run loses its Prefect record from then on."""
    directory = ServerDir.here(host)
    with directory.locked():
        state = directory.state()
        if not force and state is not None and process_alive(state.pid) and (users := leaseholders(directory)):
            raise UserError(f"server stop: the Prefect server at {state.url} is in use by {len(users)} "
                            f"process{'es' if len(users) > 1 else ''} ({_commands(users)}); stopping it would cut "
                            "them off from their API mid-run. Wait for them to end (it stops by itself "
                            f"{state.idle_timeout:g} s after its last use), or give --force")
        directory.forget()
        return state is not None and terminate(state)


def _commands(pids: list[int], shown: int = 3) -> str:
    """"pid 12: python3 sweep.py, …": who holds the server, as `ps` would name them."""
    named = []
    for pid in pids[:shown]:
        try:
            argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
        except OSError:
            argv = []
        named.append(f"pid {pid}" + (f": {' '.join([Path(argv[0]).name, *argv[1:3]])}" if argv else ""))
    return ", ".join(named) + (f" and {len(pids) - shown} more" if len(pids) > shown else "")


def server_status(host: str = LOOPBACK) -> dict[str, Any]:
    """What `hpc-garage server status` shows; never the auth string or a password."""
    directory = ServerDir.here(host)
    state = directory.state()
    alive = state is not None and process_alive(state.pid)
    status: dict[str, Any] = {"state_file": str(directory.state_file), "log": str(directory.log_file),
                              "running": alive, "healthy": bool(alive and state and _answers(state))}
    if state is not None:
        now = time.time()
        activity = directory.activity()
        last = float(activity.get("last_activity") or state.started) if activity.get("pid") == state.pid \
            else state.started
        status |= {"url": state.url, "pid": state.pid, "host": state.host, "started": state.started,
                   "database": state.database, "uptime_s": round(now - state.started, 1)}
        if alive:
            status |= {"idle_s": round(max(0.0, now - last), 1), "idle_timeout_s": state.idle_timeout,
                       "in_use_by": leaseholders(directory)}  # pids: `server stop` waits for them (or --force)
            if activity.get("pid") == state.pid and activity.get("server_pid"):
                status["server_pid"] = int(activity["server_pid"])  # `prefect server start`, beside its keeper
        status |= ui_status(state, str(directory.state_file))
    return status


def auth_string(host: str = LOOPBACK, machine: str | None = None) -> str:
    """The running server's basic-auth string, for the UI's login page (`hpc-garage server auth`). `machine`:
    another machine's server (a job's node), read from the home directory it shares with this one."""
    machine = machine or machine_name()
    directory = ServerDir.of(host, machine)
    path, state = directory.state_file, directory.state()
    here = machine == machine_name()
    if state is None or (here and not process_alive(state.pid)):
        why = "names a server that has ended" if state is not None else "does not exist"
        raise UserError(f"--host {host} --machine {machine}: no hpc-garage Prefect server runs there ({path} {why}); "
                        "`hpc-garage status JOB` prints the command for a job's server, `hpc-garage server "
                        "status` says whether this machine's runs")
    return state.auth


def _start(directory: ServerDir, host: str, timeout: float, idle: float, database: Database, *,
           ui: bool = True) -> ServerState:
    """Start the keeper on a free port; again on another port when one was taken between our choice and the
    server's bind (another process on a busy login node), at most PORT_TRIES ports."""
    tried: set[int] = set()
    while True:
        port = _free_port(host)
        try:
            return _start_on(port, directory, host, timeout, idle, database, ui=ui)
        except _PortTaken as taken:
            tried.add(port)
            if len(tried) >= PORT_TRIES or _free_port(host) in tried:  # the same port again: no race, refuse
                raise taken.error from None
            logger.info("port %s of %s was taken as the Prefect server started: trying another", port, host)


PORT_TRIES = 3


class _PortTaken(Exception):
    def __init__(self, error: UserError) -> None:
        super().__init__(str(error))
        self.error = error


def _start_on(port: int, directory: ServerDir, host: str, timeout: float, idle: float, database: Database, *,
              ui: bool) -> ServerState:
    auth = f"hpc-garage:{secrets.token_urlsafe(24)}"
    ui_url = ui_base(f"http://{url_host(host)}:{port}", os.environ) if ui else ""
    env = {**BATCHING, **os.environ, **QUIET,
           "PREFECT_HOME": str(directory.home),
           "PREFECT_SERVER_API_AUTH_STRING": auth,
           **ui_settings(directory.home, ui_url)}
    env.pop("PREFECT_API_URL", None)
    package_root = str(Path(__file__).resolve().parents[3])  # the keeper imports this very copy, whatever the cwd
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "hpc_garage.prefect.server", "keep", "--host", host, "--port", str(port),
               "--idle", repr(idle), *([] if ui else ["--no-ui"])]
    log = directory.log_file
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        process = subprocess.Popen(command, env=env, cwd=directory.path, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    children[process.pid] = process
    state = ServerState(url=f"http://{url_host(host)}:{port}/api", pid=process.pid, auth=auth, host=host,
                        port=port, started=time.time(), database=database.label(), idle_timeout=idle, ui=ui_url)
    deadline = time.monotonic() + timeout
    while not _answers(state):
        if (code := process.poll()) is not None or time.monotonic() > deadline:
            terminate(state)
            why = f"exited with code {code}" if code is not None else f"did not answer within {timeout:.0f} s"
            reason = _reason(log)
            error = UserError(f"the Prefect server hpc-garage started (prefect server start --host {host} --port "
                              f"{port}, database {database.label()}) {why}{f': {reason}' if reason else ''}; "
                              f"last lines of {log}: {_tail(log)} (or set PREFECT_API_URL to a server you run)")
            if code is not None and "already in use" in _tail(log, 40):
                raise _PortTaken(error)
            raise error
        time.sleep(0.2)
    directory.record(state)
    return state


def _answers(state: ServerState, patience: float = 0.0) -> bool:
    """Up and accepting our auth string (health alone would also pass for a stranger on the port)."""
    api = state.api(timeout=2)
    deadline = time.monotonic() + patience
    while True:
        try:
            status = api.answer("GET", "/admin/version").status
        except (OSError, ValueError):
            status = 0
        if 200 <= status < 300:
            return status == 200
        if status in (401, 403, 404):
            return False  # it answered, and refused us: another auth string, or not a Prefect server
        if time.monotonic() >= deadline or not process_alive(state.pid):
            return False
        time.sleep(0.5)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _reason(path: Path) -> str:
    """The line of the server's log that says why it stopped (the last exception or error named), or ""."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        text = line.strip()
        if "exited with code" in text:
            continue  # the keeper's own summary, not the cause
        if _CAUSE.search(text):
            return text
    return ""


_CAUSE = re.compile(r"^[\w.]*(Error|Exception)\b|already in use|No module named|\berror\b", re.IGNORECASE)


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty)"
