"""One Prefect API for the whole job: the user's, or one hpc-garage-owned `prefect server start` per host.

Without a configured API, Prefect starts a temporary server in the flow process *and in every Dask worker*
(all on one SQLite file: "database is locked", 20–25 s before the first task). So `ensure_api` returns the
environment that points the flow and every worker at a single API. Our server is reused across runs (its
PREFECT_HOME persists, so migrations run once and a restart takes ~5 s), listens on a free port, and asks
for a random basic-auth string, because on a shared login node anyone can reach its port.

State per (user, machine, bind address), in `~/.hpc-garage/prefect/<short hostname>/` (0700):
  server.json (0600) url, pid, auth, host, port    server.log   the server's output    home/  PREFECT_HOME
  lock               held while checking or starting, so concurrent callers share one server
  leases/<pid>        one per process that was handed the server (its start time guards against pid reuse)
  activity.json       the keeper's last look: when the server was last in use, its idle limit
A bind address other than 127.0.0.1 gets its own subdirectory `bind-<host>/` (and its own server).
Prefect itself is never imported here (≈2 s): the server is a subprocess, health checks use hpc-garage's
plain HTTP client (hpc_garage/prefect_api.py), which never sends them through a proxy.

The server leaves when idle. The process we start is a keeper (`python -m hpc_garage.prefect.server keep`,
this module): it starts `prefect server start` (and a PostgreSQL, see below) as its children and stops them
and itself once the server has been unused for HPC_GARAGE_PREFECT_SERVER_IDLE seconds (default 1800). In
use means: a process it was handed to still runs (a lease), or the API's flow-run and task-run counts per
state moved since the last look, or the API did not answer (a busy server is a used one). It stops under
the same lock `ensure_server` takes, after removing server.json, so an exiting server is never handed out.

The database: SQLite in PREFECT_HOME by default. HPC_GARAGE_PREFECT_DATABASE=postgresql runs a PostgreSQL
of the user's own (initdb into the state directory, a unix socket in a private directory, no TCP, a random
password), started and stopped with the server; a postgresql+asyncpg:// URL uses that database instead.
PostgreSQL refuses to run as root: as root (containers, CI) it runs as the `postgres` system user (Debian's
package creates it; else `nobody`), in /var/tmp/hpc-garage-postgres-<hash>/ owned by that user.

The UI: served at the server's root (HPC_GARAGE_PREFECT_UI=0 leaves it off), so the "View at" link Prefect
prints opens. Its pages are public files, but every call for data goes to the API, behind the auth string
(the UI's login page asks for it, `hpc-garage server auth` prints it), and so do the event and log
websockets (Prefect checks their in-band auth message since PrefectHQ/prefect#17741; seen on 3.8.8 and 3.9.1,
tests/test_prefect_ui.py checks every route). The UI asks for the API at `/api` of the page it was loaded from, so it works through any `ssh -L`
tunnel. Prefect copies its UI (15 MiB) into PREFECT_HOME/ui_build on a server's first start (0.2–0.4 s; the
package's own directory may be read-only on a site); the server's memory is the same with or without it
(`python -m bench --only ui`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.tunnel import ssh_tunnel
from hpc_garage.log import setup as setup_messages
from hpc_garage.files import locked, pid_alive, read_json, write_private
from hpc_garage.prefect_api import PrefectApi, auth_headers, no_proxy_for
from hpc_garage.variables import PREFECT_DATABASE, PREFECT_SERVER_ENV, PREFECT_SERVER_IDLE, PREFECT_UI, seconds, switch

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
IDLE_DEFAULT = 1800.0  # s unused before the server stops (HPC_GARAGE_PREFECT_SERVER_IDLE)
ACTIVE_STATES = ("PENDING", "RUNNING", "CANCELLING", "PAUSED", "SCHEDULED")

logger = logging.getLogger(__spec__.name)  # not __name__: the keeper runs this module as __main__ (server.log)

_children: dict[int, subprocess.Popen[bytes]] = {}  # servers started by this process, to see early exits


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


def ensure_api(host: str = LOOPBACK, *, env: Mapping[str, str] | None = None,
               timeout: float = START_TIMEOUT) -> dict[str, str]:
    """The environment to export to the flow and every worker so that all of them use one Prefect API.

    The user's API when one is configured (PREFECT_API_URL in the environment or the active profile);
    otherwise our server on `host` for this machine, reused if it answers, else started.
    """
    env = os.environ if env is None else env
    if url := configured_api_url(env):  # its auth string and managed-server note travel with it (a deployment's job)
        return {"PREFECT_API_URL": url, **{k: env[k] for k in ("PREFECT_API_AUTH_STRING", PREFECT_SERVER_ENV) if env.get(k)}}
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
    """Our server for this machine and bind address: the running one if it answers, else a new one.

    The caller holds a lease on it until it exits: the server does not leave while its user runs.
    """
    database = database_choice(os.environ)  # a bad setting is refused before anything starts
    idle = seconds(os.environ, PREFECT_SERVER_IDLE, IDLE_DEFAULT)
    ui = switch(os.environ, PREFECT_UI, True)
    if database.kind == "postgresql":
        postgres_bin()
    directory = state_dir(host)
    # this process, the keeper it may start, and their children reach the server straight, Prefect's own
    # clients included, whatever http_proxy says (issue 23)
    os.environ.update(no_proxy_for([_url_host(host)], os.environ))
    for pid, child in list(_children.items()):  # servers of ours stopped by someone else (`server stop`, idle)
        if child.poll() is not None:
            _children.pop(pid, None)
    with locked(directory / "lock"):
        state = _read_state(directory)
        if state is not None and _pid_alive(state.pid) and _answers(state, patience=REUSE_PATIENCE):
            _lease(directory)
            return state
        if state is not None:
            _terminate(state)  # dead, hung, or answering to another auth string: replace it
        state = _start(directory, host, timeout, idle, database, ui=ui)
        _lease(directory)
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
    state = _read_state(state_dir(host))
    running = state is not None and _pid_alive(state.pid) and _answers(state, patience=REUSE_PATIENCE)
    now = state.database if running and state is not None else database_choice(os.environ).label()
    if now != database:
        how = "runs on" if running else f"would start on (from {PREFECT_DATABASE})"
        stop = f"stop it (hpc-garage server stop --host {host}), " if running else ""
        raise UserError(f"{who}: its Prefect API was hpc-garage's server on database {database}, and the one here "
                        f"{how} {now}; {stop}set {PREFECT_DATABASE} to that database and retry")
    return ensure_server(host).client_env()


def stop_server(host: str = LOOPBACK) -> bool:
    """Stop our server for this machine and bind address; False when none was running."""
    directory = state_dir(host)
    with locked(directory / "lock"):
        state = _read_state(directory)
        (directory / "server.json").unlink(missing_ok=True)
        return state is not None and _terminate(state)


def server_status(host: str = LOOPBACK) -> dict[str, Any]:
    """What `hpc-garage server status` shows; never the auth string or a password."""
    directory = state_dir(host)
    state = _read_state(directory)
    alive = state is not None and _pid_alive(state.pid)
    status: dict[str, Any] = {"state_file": str(directory / "server.json"), "log": str(directory / "server.log"),
                              "running": alive, "healthy": bool(alive and state and _answers(state))}
    if state is not None:
        now = time.time()
        activity = read_json(directory / "activity.json") or {}
        last = float(activity.get("last_activity") or state.started) if activity.get("pid") == state.pid \
            else state.started
        status |= {"url": state.url, "pid": state.pid, "host": state.host, "started": state.started,
                   "database": state.database, "uptime_s": round(now - state.started, 1)}
        if alive:
            status |= {"idle_s": round(max(0.0, now - last), 1), "idle_timeout_s": state.idle_timeout}
            if activity.get("pid") == state.pid and activity.get("server_pid"):
                status["server_pid"] = int(activity["server_pid"])  # `prefect server start`, beside its keeper
        status |= ui_status(state, str(directory / "server.json"))
    return status


def ui_status(state: ServerState, state_file: str) -> dict[str, str]:
    """Where the UI is, the line that reaches it from a laptop, and where its auth string is (never the string)."""
    if not state.ui:
        return {"ui": f"off: this server was started without it ({PREFECT_UI}=0, or an older hpc-garage); "
                      "`hpc-garage server stop` once no run uses it, and the next run starts one with it"}
    import getpass
    from urllib.parse import urlsplit

    where = "" if state.host in (LOOPBACK, "localhost") else f" --host {state.host}"
    path = urlsplit(state.ui).path
    return {"ui": f"{state.ui}/",
            "from_a_laptop": ssh_tunnel(state.host if state.host not in ("0.0.0.0", "::") else _url_host(state.host),
                                        state.port, f"{getpass.getuser()}@{socket.getfqdn()}", f"{path}/"),
            "auth_string": f"the UI's login page asks for it: `hpc-garage server auth{where}` prints it "
                           f"(key \"auth\" of {state_file})"}


def auth_string(host: str = LOOPBACK, machine: str | None = None) -> str:
    """The running server's basic-auth string, for the UI's login page (`hpc-garage server auth`). `machine`:
    another machine's server (a job's node), read from the home directory it shares with this one."""
    machine = machine or machine_name()
    path = _state_path(host, machine) / "server.json"
    state = _read_state(path.parent)
    here = machine == machine_name()
    if state is None or (here and not _pid_alive(state.pid)):
        why = "names a server that has ended" if state is not None else "does not exist"
        raise UserError(f"--host {host} --machine {machine}: no hpc-garage Prefect server runs there ({path} {why}); "
                        "`hpc-garage status JOB` prints the command for a job's server, `hpc-garage server "
                        "status` says whether this machine's runs")
    return state.auth


# --------------------------------------------------------------------------------------------- database


@dataclass(frozen=True)
class Database:
    kind: str  # "sqlite" (Prefect's default), "postgresql" (one we run), "url" (one the user gives)
    url: str | None = None

    def label(self) -> str:
        if self.kind != "url" or not self.url:
            return "postgresql (managed)" if self.kind == "postgresql" else self.kind
        after = self.url.split("://", 1)[-1]
        return f"{self.url.split('://', 1)[0]}://{after.rsplit('@', 1)[-1]}"  # no user or password


def database_choice(env: Mapping[str, str]) -> Database:
    """HPC_GARAGE_PREFECT_DATABASE, else the user's own PREFECT_SERVER_DATABASE_CONNECTION_URL, else SQLite."""
    text = env.get(PREFECT_DATABASE, "").strip()
    if not text:
        given = env.get("PREFECT_SERVER_DATABASE_CONNECTION_URL", "").strip()
        return Database("url", given) if given else Database("sqlite")
    if text.lower() == "sqlite":
        return Database("sqlite")
    if text.lower() in ("postgresql", "postgres"):
        return Database("postgresql")
    if text.startswith("postgresql+asyncpg://"):
        return Database("url", text)
    raise UserError(f"{PREFECT_DATABASE}={text!r}: give sqlite, postgresql (a PostgreSQL that hpc-garage runs "
                    "in your state directory) or a URL postgresql+asyncpg://USER:PASSWORD@HOST/DATABASE")


POSTGRES_TOOLS = ("initdb", "postgres", "pg_isready", "createdb")


def postgres_bin() -> Path:
    """The directory holding initdb, postgres, pg_isready and createdb: initdb's on PATH (links followed, as
    a site's module or /usr/local/bin may link only some), else Debian's /usr/lib/postgresql/<newest>/bin."""
    candidates = [Path(found).resolve().parent] if (found := shutil.which("initdb")) else []
    candidates += sorted((p.parent for p in Path("/usr/lib/postgresql").glob("*/bin/initdb")), reverse=True,
                         key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0)
    for directory in candidates:
        if all((directory / tool).exists() for tool in POSTGRES_TOOLS):
            return directory
    raise UserError(f"{PREFECT_DATABASE}=postgresql: no directory with {', '.join(POSTGRES_TOOLS)} (initdb's "
                    "on PATH, /usr/lib/postgresql/*/bin); install PostgreSQL's server (apt install postgresql, "
                    "or the site's module), or give a postgresql+asyncpg:// URL, or unset it for SQLite")


class ManagedPostgres:
    """A PostgreSQL of the user's own beside the server: created once, started and stopped with it."""

    PORT = "5432"  # names the socket file only: no TCP

    def __init__(self, directory: Path) -> None:
        self.bin = postgres_bin()
        self.secrets = directory / "postgres.json"  # 0600: the password; the server's URL is built from it
        self.run_as: tuple[str, str] | None = None
        if os.geteuid() == 0:  # "root execution of the PostgreSQL server is not permitted"
            user = "postgres" if _user_exists("postgres") else "nobody"
            import grp
            import pwd

            self.run_as = (user, grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name)
            digest = _short_hash(str(directory))
            self.base = Path("/var/tmp") / f"hpc-garage-postgres-{digest}"
        else:
            self.base = directory / "postgres"
        self.data = self.base / "data"
        self.socket_dir = self.base / "run"
        if len(str(self.socket_dir / f".s.PGSQL.{self.PORT}")) > 100:  # sun_path holds 107 bytes
            short = f"hpc-garage-pg-{os.getuid()}-{_short_hash(str(self.base))}"
            self.socket_dir = Path(tempfile.gettempdir()) / short
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, log: int) -> str:
        """Start it (creating it first if need be); the connection URL for Prefect."""
        for d in (self.base, self.socket_dir):
            self._private_dir(d)
        password = str((read_json(self.secrets) or {}).get("password") or "")
        fresh = not (self.data / "PG_VERSION").exists()
        if fresh:
            if self.data.exists():
                shutil.rmtree(self.data)  # a half-made one from an interrupted initdb
            password = secrets.token_hex(24)
            pwfile = self.base / "pwfile"
            write_private(pwfile, password + "\n")
            self._chown(pwfile)
            try:
                self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", "prefect", "-E", "UTF8",
                           "--auth=scram-sha-256", f"--pwfile={pwfile}", "--no-instructions"], log)
            finally:
                pwfile.unlink(missing_ok=True)
            write_private(self.secrets, json.dumps({"password": password, "data": str(self.data)}))
        elif not password:
            raise UserError(f"{self.data} exists but {self.secrets} (its password) does not; remove {self.base} "
                            "to start a fresh database")
        self._wait_for_previous()
        command = [str(self.bin / "postgres"), "-D", str(self.data), "-k", str(self.socket_dir), "-p", self.PORT,
                   "-c", "listen_addresses=", "-c", "unix_socket_permissions=0700"]
        self.process = subprocess.Popen(self._as_owner(command, pdeathsig="INT"), stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=log, cwd=self.base,
                                        preexec_fn=_die_with_parent(signal.SIGINT))
        env = {**os.environ, "PGPASSWORD": password}
        deadline = time.monotonic() + 60
        while subprocess.run([str(self.bin / "pg_isready"), "-q", "-h", str(self.socket_dir), "-p", self.PORT,
                              "-U", "prefect", "-d", "postgres"],
                             env=env, stdout=log, stderr=log).returncode != 0:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise UserError(f"PostgreSQL in {self.data} did not start (see the server log)")
            time.sleep(0.2)
        if fresh:
            subprocess.run([str(self.bin / "createdb"), "-h", str(self.socket_dir), "-p", self.PORT, "-U", "prefect",
                            "prefect"], env=env, stdout=log, stderr=log, check=True)
        return f"postgresql+asyncpg://prefect:{password}@/prefect?host={self.socket_dir}&port={self.PORT}"

    def _wait_for_previous(self, timeout: float = 30.0) -> None:
        """A PostgreSQL of a server that was just killed may still be shutting down on these files."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                pid = int((self.data / "postmaster.pid").read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return
            if not pid_alive(pid):
                return
            time.sleep(0.2)

    def stop(self) -> None:
        """Fast shutdown (SIGINT): sessions are ended, the data is consistent."""
        if self.process is not None:
            _stop_child(self.process, signal.SIGINT, grace=6.0)

    def _run(self, command: list[str], log: int) -> None:
        subprocess.run(self._as_owner(command), stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True,
                       cwd=self.base)

    def _as_owner(self, command: list[str], pdeathsig: str | None = None) -> list[str]:
        if self.run_as is None:
            return command
        user, group = self.run_as
        dies = [f"--pdeathsig={pdeathsig}"] if pdeathsig else []  # a change of uid clears the parent's setting
        return ["setpriv", f"--reuid={user}", f"--regid={group}", "--clear-groups", *dies, *command]

    def _private_dir(self, path: Path) -> None:
        """0700 and ours (or the run-as user's): never a directory someone else made for us."""
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._chown(path)
        info = os.lstat(path)
        owner = os.getuid() if self.run_as is None else _uid(self.run_as[0])
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != owner:
            raise UserError(f"{path} is not a directory owned by uid {owner}; remove it")
        os.chmod(path, 0o700)

    def _chown(self, path: Path) -> None:
        if self.run_as is not None:
            shutil.chown(path, *self.run_as)


def _short_hash(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid


def machine_name() -> str:
    """This machine's short host name: what names its servers' state directory."""
    return socket.gethostname().split(".")[0]


def state_dir(host: str = LOOPBACK) -> Path:
    """Per machine because ~ is usually shared by every node of a cluster; per bind address under it."""
    directory = _state_path(host, machine_name())
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for d in (directory, *directory.parents):
        if d == Path.home() / ".hpc-garage":
            break
        os.chmod(d, 0o700)
    return directory


def _state_path(host: str, machine: str) -> Path:
    base = Path.home() / ".hpc-garage" / "prefect" / machine
    return base if host in (LOOPBACK, "localhost") else base / f"bind-{host}"


# ---------------------------------------------------------------------------------------------- starting


def ui_base(root: str, env: Mapping[str, str]) -> str:
    """The UI's base URL under the server's `root`: `/v2` where Prefect ships its V2 UI and the user did not
    turn it off. Its pages send a browser without the auth string to its login page and back; the V1 UI's
    deep links (Prefect's default "View at" link) show "Page not found" instead."""
    prefect = _prefect_dir()
    has_v2 = prefect is not None and (prefect / "server" / "ui-v2" / "index.html").exists()
    return f"{root}/v2" if has_v2 and switch(env, "PREFECT_SERVER_UI_V2_ENABLED", True) else root


def ui_settings(home: Path, ui: str) -> dict[str, str]:
    """Prefect's settings for our server's UI (at base URL `ui`; "": off). Its API at `/api` of whatever
    address the page was loaded from (a laptop's `ssh -L` port, the node's name or IP: the server cannot
    know which); its copy of the UI in our PREFECT_HOME (Prefect's default is inside the installed package,
    often read-only on a site); the links the server writes itself (automations' notifications) at `ui`."""
    if not ui:
        return {"PREFECT_SERVER_UI_ENABLED": "false"}
    return {"PREFECT_SERVER_UI_ENABLED": "true", "PREFECT_SERVER_UI_API_URL": "/api",
            "PREFECT_SERVER_UI_STATIC_DIRECTORY": str(home / "ui_build"), "PREFECT_UI_URL": ui,
            "PREFECT_SERVER_UI_SERVE_BASE": "/"}


def _start(directory: Path, host: str, timeout: float, idle: float, database: Database, *,
           ui: bool = True) -> ServerState:
    port = _free_port(host)
    auth = f"hpc-garage:{secrets.token_urlsafe(24)}"
    ui_url = ui_base(f"http://{_url_host(host)}:{port}", os.environ) if ui else ""
    env = {**BATCHING, **os.environ, **QUIET,
           "PREFECT_HOME": str(directory / "home"),
           "PREFECT_SERVER_API_AUTH_STRING": auth,
           **ui_settings(directory / "home", ui_url)}
    env.pop("PREFECT_API_URL", None)
    package_root = str(Path(__file__).resolve().parents[2])  # the keeper imports this very copy, whatever the cwd
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "hpc_garage.prefect.server", "keep", "--host", host, "--port", str(port),
               "--idle", repr(idle), *([] if ui else ["--no-ui"])]
    log = directory / "server.log"
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
        process = subprocess.Popen(command, env=env, cwd=directory, stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    _children[process.pid] = process
    state = ServerState(url=f"http://{_url_host(host)}:{port}/api", pid=process.pid, auth=auth, host=host,
                        port=port, started=time.time(), database=database.label(), idle_timeout=idle, ui=ui_url)
    deadline = time.monotonic() + timeout
    while not _answers(state):
        if (code := process.poll()) is not None or time.monotonic() > deadline:
            _terminate(state)
            why = f"exited with code {code}" if code is not None else f"did not answer within {timeout:.0f} s"
            reason = _reason(log)
            raise UserError(f"the Prefect server hpc-garage started (prefect server start --host {host} --port "
                            f"{port}, database {database.label()}) {why}{f': {reason}' if reason else ''}; "
                            f"last lines of {log}: {_tail(log)} (or set PREFECT_API_URL to a server you run)")
        time.sleep(0.2)
    write_private(directory / "server.json", json.dumps(asdict(state), indent=2))
    return state


def _lease(directory: Path) -> None:
    """Mark this process as a user of the server, until it exits (the keeper checks)."""
    leases = directory / "leases"
    leases.mkdir(mode=0o700, exist_ok=True)
    write_private(leases / str(os.getpid()), str(_start_ticks(os.getpid())))


def _leases_last_use(directory: Path, now: float) -> float:
    """`now` while a leaseholder runs; else the newest lease's time. Leases of ended processes are removed."""
    last = 0.0
    for lease in (directory / "leases").glob("*"):
        try:
            pid, ticks = int(lease.name), lease.read_text().strip()
            last = max(last, lease.stat().st_mtime)
        except (OSError, ValueError):
            continue
        if pid_alive(pid) and ticks == str(_start_ticks(pid)):
            return now
        lease.unlink(missing_ok=True)
    return last


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot): a reused pid has another."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


# ------------------------------------------------------------------------------------------- the keeper


def _keep(argv: list[str]) -> int:
    """`python -m hpc_garage.prefect.server keep`: run the server (and its PostgreSQL) until idle or told to stop."""
    import argparse

    parser = argparse.ArgumentParser(prog="hpc_garage.prefect.server keep")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--idle", type=float, required=True)
    parser.add_argument("--no-ui", dest="ui", action="store_false")
    args = parser.parse_args(argv)
    setup_messages(label="hpc-garage server keeper", clock=True, stream="stdout")  # server.log: `...[12:00:00]: ...`
    directory = Path.cwd()  # _start runs the keeper in the state directory
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
        server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", args.host,
                                   "--port", str(args.port), *([] if args.ui else ["--no-ui"]), "--analytics-off"],
                                  env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent(signal.SIGTERM))
        url = f"http://{_url_host(args.host)}:{args.port}/api"
        state = ServerState(url=url, pid=os.getpid(), auth=env["PREFECT_SERVER_API_AUTH_STRING"], host=args.host,
                            port=args.port, started=time.time(), idle_timeout=args.idle)
        def stop() -> None:
            _stop_child(server, signal.SIGTERM, grace=6.0)
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
            _stop_child(server, signal.SIGTERM, grace=6.0)
        if postgres is not None:
            postgres.stop()


def _watch(directory: Path, state: ServerState, server: subprocess.Popen[bytes], idle: float,
           stop: Callable[[], None]) -> int:
    """Look every few seconds whether the server is used; stop once it has not been for `idle` seconds.

    `stop` (the server, then its PostgreSQL) runs under the lock: a new server starts on the same database
    files only after this one has let go of them."""
    interval = max(0.5, min(30.0, idle / 6))
    last_use, seen = time.time(), None

    def record(now: float) -> None:
        write_private(directory / "activity.json", json.dumps(
            {"pid": state.pid, "server_pid": server.pid, "last_activity": last_use, "checked": now,
             "idle_timeout": idle}))

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
                with locked(directory / "lock"):
                    _forget(directory, state)
                    stop()
            else:  # it never answered: `_start` holds the lock, waiting for it to answer or for us to exit
                stop()
            return code or 1
        counts = _run_counts(state)
        if counts is None or counts != seen or _held(state):  # runs moved, too busy to answer, or needed
            last_use, seen = now, counts
        last_use = max(last_use, _leases_last_use(directory, now))
        record(now)
        if now - last_use < idle:
            continue
        with locked(directory / "lock"):  # ensure_server waits: nobody is handed a server that is leaving
            if time.time() - max(last_use, _leases_last_use(directory, time.time())) < idle:
                continue  # handed out while we waited for the lock
            _forget(directory, state)
            logger.info(f"no flow or task run moved and no user process for {now - last_use:.0f} s "
                        f"({PREFECT_SERVER_IDLE}={idle:g}): stopping")
            stop()
            return 0


def _handed_out(directory: Path, state: ServerState) -> bool:
    """Whether server.json names this keeper: `_start` writes it once the server first answers."""
    current = _read_state(directory)
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


def _forget(directory: Path, state: ServerState) -> None:
    """Remove server.json if it still names this keeper (a replacement's is left alone)."""
    current = _read_state(directory)
    if current is not None and current.pid == state.pid:
        (directory / "server.json").unlink(missing_ok=True)


def _stop_child(process: subprocess.Popen[bytes], how: signal.Signals, grace: float) -> None:
    if process.poll() is None:
        process.send_signal(how)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _die_with_parent(how: signal.Signals) -> Callable[[], None]:
    """For Popen's preexec_fn: the child gets `how` when the keeper dies, even by SIGKILL (Linux prctl)."""

    def arrange() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(how), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    return arrange


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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


def _url_host(host: str) -> str:
    """An address clients can use: the machine's name for a wildcard bind."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


# ------------------------------------------------------------------------------------------- inspecting


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
        if time.monotonic() >= deadline or not _pid_alive(state.pid):
            return False
        time.sleep(0.5)


def _pid_alive(pid: int) -> bool:
    if (child := _children.get(pid)) is not None:
        return child.poll() is None  # our own child: poll() also reaps it, a zombie is not alive
    return pid_alive(pid)


def _is_our_server(state: ServerState) -> bool:
    """Guard against pid reuse: only our keeper (or an older `prefect server start`) on our port is signalled."""
    try:
        argv = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    ours = b"hpc_garage.prefect.server" in argv and b"keep" in argv
    return (ours or b"prefect" in b" ".join(argv) and b"server" in argv) and str(state.port).encode() in argv


def _terminate(state: ServerState, grace: float = 10.0) -> bool:
    """Stop the server's whole session (uvicorn and any children); False if it was not running."""
    running = _pid_alive(state.pid) and _is_our_server(state)
    # a keeper killed outright may leave its children (the server, PostgreSQL) in its process group: a group
    # id is never reused while it has members, so these are its own
    leftovers = not running and bool(_members(state))
    if running or leftovers:
        os.killpg(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while (_pid_alive(state.pid) or _members(state)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_alive(state.pid) or _members(state):
            os.killpg(state.pid, signal.SIGKILL)
    if (child := _children.pop(state.pid, None)) is not None:
        child.wait(timeout=5)  # reap it
    return running


def _members(state: ServerState) -> list[int]:
    """Live processes of the keeper's process group other than itself, if one of them is our server."""
    members, ours = [], False
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int(proc.name) == state.pid:
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != state.pid or fields[0] == "Z":
                continue
            members.append(int(proc.name))
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ours = ours or (b"server" in argv and str(state.port).encode() in argv) or argv[0].endswith(b"postgres")
        except (OSError, IndexError, ValueError):
            continue
    return members if ours else []


def _read_state(directory: Path) -> ServerState | None:
    try:
        return ServerState(**json.loads((directory / "server.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None


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


def _builtin_profiles() -> dict[str, dict[str, Any]]:
    """Prefect's shipped profiles (`local` points at 127.0.0.1:4200), found without importing prefect."""
    prefect = _prefect_dir()
    return dict(_read_toml(prefect / "settings" / "profiles.toml").get("profiles", {})) if prefect else {}


def _prefect_dir() -> Path | None:
    """The installed prefect package's directory, found without importing it (≈2 s)."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")
    for location in (spec.submodule_search_locations or []) if spec else []:
        return Path(location)
    return None


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


if __name__ == "__main__":
    if sys.argv[1:2] != ["keep"]:
        sys.exit("usage: python -m hpc_garage.prefect.server keep --host HOST --port PORT --idle SECONDS")
    sys.exit(_keep(sys.argv[2:]))
