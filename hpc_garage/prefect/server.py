"""One Prefect API for the whole job: the user's, or one hpc-garage-owned `prefect server start` per host.

Without a configured API, Prefect starts a temporary server in the flow process *and in every Dask worker*
(all on one SQLite file: "database is locked", 20–25 s before the first task). So `ensure_api` returns the
environment that points the flow and every worker at a single API. Our server is reused across runs (its
PREFECT_HOME persists, so migrations run once and a restart takes ~5 s), listens on a free port, and asks
for a random basic-auth string, because on a shared login node anyone can reach its port.

State per (user, machine, bind address), in `~/.hpc-garage/prefect/<short hostname>/` (0700):
  server.json (0600) url, pid, auth, host, port    server.log   the server's output    home/  PREFECT_HOME
  lock               held while checking or starting, so concurrent callers share one server
A bind address other than 127.0.0.1 gets its own subdirectory `bind-<host>/` (and its own server).
Prefect itself is never imported here (≈2 s): the server is a subprocess, health checks use urllib.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.files import pid_alive, write_private

LOOPBACK = "127.0.0.1"
QUIET = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
# A sweep reports hundreds of task runs a second. Prefect's defaults record them one message at a time
# (about 40 ms of server CPU per task here); batches of up to 100, flushed every second, cost about half.
# Records reach the database at most a second later; nothing is dropped. The user's settings win. (The
# task-run recorder truncates its flush interval to whole seconds: 0.5 would make it flush in a busy loop.)
BATCHING = {
    f"PREFECT_SERVER_SERVICES_{service}_{knob}": value
    for service in ("TASK_RUN_RECORDER", "EVENT_PERSISTER")
    for knob, value in (("READ_BATCH_SIZE", "100"), ("BATCH_SIZE", "100"), ("FLUSH_INTERVAL", "1"))
} | {"PREFECT_SERVER_SERVICES_TRIGGERS_READ_BATCH_SIZE": "100"}
START_TIMEOUT = 120.0  # a fresh database takes 11–17 s to migrate here; shared file systems are slower
REUSE_PATIENCE = 10.0  # a busy server on a loaded login node is slow, not dead: never replace it hastily

_children: dict[int, subprocess.Popen[bytes]] = {}  # servers started by this process, to see early exits


@dataclass(frozen=True)
class ServerState:
    url: str  # ends in /api, as PREFECT_API_URL wants it
    pid: int
    auth: str
    host: str
    port: int
    started: float

    def client_env(self) -> dict[str, str]:
        return {"PREFECT_API_URL": self.url, "PREFECT_API_AUTH_STRING": self.auth, **QUIET}


def ensure_api(host: str = LOOPBACK, *, env: Mapping[str, str] | None = None,
               timeout: float = START_TIMEOUT) -> dict[str, str]:
    """The environment to export to the flow and every worker so that all of them use one Prefect API.

    The user's API when one is configured (PREFECT_API_URL in the environment or the active profile);
    otherwise our server on `host` for this machine, reused if it answers, else started.
    """
    env = os.environ if env is None else env
    if url := configured_api_url(env):
        return {"PREFECT_API_URL": url}
    return ensure_server(host, timeout=timeout).client_env()


def configured_api_url(env: Mapping[str, str]) -> str | None:
    """PREFECT_API_URL as Prefect would resolve it: the environment, else the active profile."""
    if url := env.get("PREFECT_API_URL", "").strip():
        return url
    profiles = _builtin_profiles()
    home = Path(env.get("PREFECT_HOME") or "~/.prefect").expanduser()
    path = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    user = _read_toml(path)
    for name, settings in user.get("profiles", {}).items():
        profiles[name] = {**profiles.get(name, {}), **settings}
    active = env.get("PREFECT_PROFILE") or user.get("active") or "ephemeral"
    url = profiles.get(active, {}).get("PREFECT_API_URL")
    return str(url) if url else None


def ensure_server(host: str = LOOPBACK, *, timeout: float = START_TIMEOUT) -> ServerState:
    """Our server for this machine and bind address: the running one if it answers, else a new one."""
    directory = state_dir(host)
    with _locked(directory / "lock"):
        state = _read_state(directory)
        if state is not None and _pid_alive(state.pid) and _answers(state, patience=REUSE_PATIENCE):
            return state
        if state is not None:
            _terminate(state)  # dead, hung, or answering to another auth string: replace it
        return _start(directory, host, timeout)


def stop_server(host: str = LOOPBACK) -> bool:
    """Stop our server for this machine and bind address; False when none was running."""
    directory = state_dir(host)
    with _locked(directory / "lock"):
        state = _read_state(directory)
        (directory / "server.json").unlink(missing_ok=True)
        return state is not None and _terminate(state)


def server_status(host: str = LOOPBACK) -> dict[str, Any]:
    """What `hpc-garage server status` shows; never the auth string."""
    directory = state_dir(host)
    state = _read_state(directory)
    alive = state is not None and _pid_alive(state.pid)
    status: dict[str, Any] = {"state_file": str(directory / "server.json"), "log": str(directory / "server.log"),
                              "running": alive, "healthy": bool(alive and state and _answers(state))}
    if state is not None:
        status |= {"url": state.url, "pid": state.pid, "host": state.host, "started": state.started}
    return status


def state_dir(host: str = LOOPBACK) -> Path:
    """Per machine because ~ is usually shared by every node of a cluster; per bind address under it."""
    base = Path.home() / ".hpc-garage" / "prefect" / socket.gethostname().split(".")[0]
    directory = base if host in (LOOPBACK, "localhost") else base / f"bind-{host}"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in (directory, *directory.parents):
        if d == Path.home() / ".hpc-garage":
            break
        os.chmod(d, 0o700)
    return directory


# ---------------------------------------------------------------------------------------------- starting


def _start(directory: Path, host: str, timeout: float) -> ServerState:
    port = _free_port(host)
    auth = f"hpc-garage:{secrets.token_urlsafe(24)}"
    env = {**BATCHING, **os.environ, **QUIET,
           "PREFECT_HOME": str(directory / "home"),
           "PREFECT_SERVER_API_AUTH_STRING": auth,
           "PREFECT_SERVER_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port),
               "--no-ui", "--analytics-off"]
    log = directory / "server.log"
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        process = subprocess.Popen(command, env=env, cwd=directory, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    _children[process.pid] = process
    state = ServerState(url=f"http://{_url_host(host)}:{port}/api", pid=process.pid, auth=auth, host=host,
                        port=port, started=time.time())
    deadline = time.monotonic() + timeout
    while not _answers(state):
        if (code := process.poll()) is not None or time.monotonic() > deadline:
            _terminate(state)
            why = f"exited with code {code}" if code is not None else f"did not answer within {timeout:.0f} s"
            raise UserError(f"the Prefect server hpc-garage started ({' '.join(command[1:])}) {why}; "
                            f"last lines of {log}: {_tail(log)} (or set PREFECT_API_URL to a server you run)")
        time.sleep(0.2)
    write_private(directory / "server.json", json.dumps(asdict(state), indent=2))
    return state


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _url_host(host: str) -> str:
    """An address clients can use: the machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


# ------------------------------------------------------------------------------------------- inspecting


def _answers(state: ServerState, patience: float = 0.0) -> bool:
    """Up and accepting our auth string (health alone would also pass for a stranger on the port)."""
    token = base64.b64encode(state.auth.encode()).decode()
    request = urllib.request.Request(f"{state.url}/admin/version", headers={"Authorization": f"Basic {token}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a site's http_proxy
    deadline = time.monotonic() + patience
    while True:
        try:
            with opener.open(request, timeout=2) as response:
                return bool(response.status == 200)
        except urllib.error.HTTPError as exc:
            if exc.code in (401, 403, 404):
                return False  # it answered, and refused us: another auth string, or not a Prefect server
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() >= deadline or not _pid_alive(state.pid):
            return False
        time.sleep(0.5)


def _pid_alive(pid: int) -> bool:
    if (child := _children.get(pid)) is not None:
        return child.poll() is None  # our own child: poll() also reaps it, a zombie is not alive
    return pid_alive(pid)


def _is_our_server(state: ServerState) -> bool:
    """Guard against pid reuse: only a `prefect server start` on our port is ever signalled."""
    try:
        argv = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"prefect" in b" ".join(argv) and b"server" in argv and str(state.port).encode() in argv


def _terminate(state: ServerState, grace: float = 10.0) -> bool:
    """Stop the server's whole session (uvicorn and any children); False if it was not running."""
    running = _pid_alive(state.pid) and _is_our_server(state)
    if running:
        os.killpg(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while _pid_alive(state.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_alive(state.pid):
            os.killpg(state.pid, signal.SIGKILL)
    if (child := _children.pop(state.pid, None)) is not None:
        child.wait(timeout=5)  # reap it
    return running


def _read_state(directory: Path) -> ServerState | None:
    try:
        return ServerState(**json.loads((directory / "server.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) or "(empty)"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _builtin_profiles() -> dict[str, dict[str, Any]]:
    """Prefect's shipped profiles (`local` points at 127.0.0.1:4200), found without importing prefect."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")
    for location in (spec.submodule_search_locations or []) if spec else []:
        return dict(_read_toml(Path(location) / "settings" / "profiles.toml").get("profiles", {}))
    return {}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
