"""The server's database: SQLite in PREFECT_HOME by default, or PostgreSQL.

HPC_GARAGE_PREFECT_DATABASE=postgresql runs a PostgreSQL of the user's own (initdb into the state directory, a
unix socket in a private directory, no TCP, a random password), started and stopped with the server by the
keeper; a postgresql+asyncpg:// URL uses that database instead. PostgreSQL refuses to run as root: as root
(containers, CI) it runs as the `postgres` system user (Debian's package creates it; else `nobody`), in
/var/tmp/hpc-garage-postgres-<hash>/ owned by that user.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_garage.core.errors import UserError
from hpc_garage.files import pid_alive, read_json, write_private
from hpc_garage.prefect.server.processes import die_with_parent, stop_child
from hpc_garage.prefect.server.state import ServerDir
from hpc_garage.variables import PREFECT_DATABASE


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

    def __init__(self, directory: ServerDir) -> None:
        self.bin = postgres_bin()
        self.secrets = directory.postgres_secrets
        self.run_as: tuple[str, str] | None = None
        if os.geteuid() == 0:  # "root execution of the PostgreSQL server is not permitted"
            user = "postgres" if _user_exists("postgres") else "nobody"
            import grp
            import pwd

            self.run_as = (user, grp.getgrgid(pwd.getpwnam(user).pw_gid).gr_name)
            digest = _short_hash(str(directory.path))
            self.base = Path("/var/tmp") / f"hpc-garage-postgres-{digest}"
        else:
            self.base = directory.postgres_files
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
                                        preexec_fn=die_with_parent(signal.SIGINT))
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
            stop_child(self.process, signal.SIGINT, grace=6.0)

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
