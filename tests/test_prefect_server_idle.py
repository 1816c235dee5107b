"""The managed Prefect server leaves when idle, comes back on demand, and runs on PostgreSQL when asked."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.files import pid_alive
from hpc_garage.prefect import server as prefect_server
from hpc_garage.prefect.server import ServerDir, ServerState, ensure_api, server_status, stop_server
from hpc_garage.prefect_api import PrefectApi

ROOT = Path(__file__).resolve().parent.parent
START = 300.0  # a fresh server migrates its database; on a loaded 2-core machine that takes minutes


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """A private HOME (so a private server), no Prefect configuration, a 3 s idle limit; the server stopped after."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_HOME", "PREFECT_PROFILES_PATH",
                 "PREFECT_API_AUTH_STRING", "HPC_GARAGE_PREFECT_DATABASE", "PREFECT_SERVER_DATABASE_CONNECTION_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HPC_GARAGE_PREFECT_SERVER_IDLE", "3")
    yield tmp_path
    stop_server()


def in_child(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh process of its own (its lease ends when it exits)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})}, timeout=START + 60)


HAND_OUT = f"import json; from hpc_garage.prefect.server import ensure_api; print(json.dumps(ensure_api(timeout={START})))"


def processes_in(directory: Path) -> list[int]:
    """Processes whose working directory is the server's state directory: the keeper and the server."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and Path(os.readlink(proc / "cwd")) == directory:
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def wait_until(check, timeout: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return bool(check())


def api_of(state: dict) -> PrefectApi:
    """hpc-garage's client for the server `state` (server.json) records: it asks a busy server again."""
    return ServerState(**state).api(timeout=30)


def count_flow_runs(state: dict, kind: str) -> int:
    return int(api_of(state).post("/flow_runs/count", {"flow_runs": {"state": {"type": {"any_": [kind]}}}}))


@contextlib.contextmanager
def holding() -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """A process that was handed the server (it holds a lease) and sleeps, and the API it was handed."""
    holder = subprocess.Popen([sys.executable, "-c", HAND_OUT + "; import sys; sys.stdout.flush(); "
                               "import time; time.sleep(3600)"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout is not None
        yield holder, json.loads(holder.stdout.readline())
    finally:
        holder.kill()
        holder.wait()


def server_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`hpc-garage server ARGS`, as a user types it."""
    return subprocess.run([sys.executable, "-m", "hpc_garage", "server", *args], capture_output=True, text=True,
                          cwd=ROOT)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=3):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_an_idle_server_leaves_and_the_next_run_starts_a_fresh_one(home: Path) -> None:
    # a flow that fails, in a process that then exits: it leaves no extra server, and the one it used leaves
    failing = ("import os\nfrom hpc_garage.prefect.server import ensure_api\n"
               f"os.environ.update(ensure_api(timeout={START}))\n"
               "from prefect import flow\n"
               "@flow\ndef broken():\n    raise RuntimeError('trial failed')\n"
               "broken(return_state=True)\nprint('flow done', flush=True)\n"
               "@flow\ndef killed():\n    os._exit(9)\n"  # its flow run stays RUNNING: nobody ends it
               "killed()")
    done = in_child(failing)
    assert "flow done" in done.stdout and done.returncode == 9, done.stderr[-2000:]
    first = json.loads(ServerDir.of().state_file.read_text())
    assert count_flow_runs(first, "RUNNING") == 1 and count_flow_runs(first, "FAILED") == 1
    status = server_status()
    assert status["running"] and status["database"] == "sqlite" and status["idle_timeout_s"] == 3
    assert status["uptime_s"] >= 0 and status["idle_s"] >= 0
    directory = ServerDir.here()
    assert len(processes_in(directory.path)) == 2  # the keeper and prefect server start: no extra server

    # no flow runs, no process holding it: it leaves after ~3 s (the keeper looks every 0.5 s)
    assert wait_until(lambda: not pid_alive(first["pid"]), 90), server_status()
    assert not directory.state_file.exists()
    assert not answers(first["url"])
    assert wait_until(lambda: not processes_in(directory.path), 30)
    assert "stopping" in directory.log_file.read_text()
    assert server_status()["running"] is False

    # the next run starts a fresh one cleanly
    again = json.loads(in_child(HAND_OUT).stdout)
    second = json.loads(directory.state_file.read_text())
    assert second["pid"] != first["pid"] and again["PREFECT_API_URL"] == second["url"]
    assert answers(second["url"])


@pytest.mark.slow
def test_a_process_that_moves_to_another_api_records_its_task_runs_there(home: Path) -> None:
    """One process, two APIs in turn (use_api: the test suite's per-module servers, a notebook pointed at a
    new server): Prefect's events worker stayed bound to the first, so the second never heard of the task
    runs (and each flow of hpc-garage's runner waited 2 minutes for them); use_api now restarts it there."""
    script = ("import os\nfrom prefect import flow, task\n"
              "from hpc_garage.prefect.server import ensure_api, stop_server\n"
              "from hpc_garage.prefect.flow_api import use_api\n"
              "@task\ndef one(i):\n    return i\n"
              "@flow\ndef sweep():\n    return sum(one(i) for i in range(3))\n"
              f"use_api(ensure_api(timeout={START}))\n"
              "assert sweep() == 3\n"
              "stop_server()\n"
              "for name in ('PREFECT_API_URL', 'PREFECT_API_AUTH_STRING'):\n    os.environ.pop(name)\n"
              f"use_api(ensure_api(timeout={START}))  # another server: a new port and auth string\n"
              "assert sweep() == 3\n"
              "print('done', flush=True)\n")
    done = in_child(script)
    assert "done" in done.stdout, done.stderr[-3000:]
    state = json.loads(ServerDir.of().state_file.read_text())  # the second server: it is still up

    def completed_task_runs() -> int:
        return int(api_of(state).post("/task_runs/count", {"task_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}))

    # the same database: the first flow's 3 (recorded by the first server) and the second flow's 3
    assert wait_until(lambda: completed_task_runs() == 6, 60), completed_task_runs()


@pytest.mark.slow
def test_a_server_in_use_stays(home: Path) -> None:
    """A process it was handed to keeps it while it runs, however long it is quiet; then it leaves."""
    with holding() as (holder, api):
        time.sleep(10)  # more than three idle limits
        shown = server_cli("status")
        status = json.loads(shown.stdout)  # what `hpc-garage server status` prints
        assert status["running"] and status["healthy"], status
        assert status["idle_s"] < 3 and status["idle_timeout_s"] == 3 and status["uptime_s"] >= 10
        # the secret itself is never printed (issue 22: status says how to read it, `hpc-garage server auth`)
        assert status["database"] == "sqlite" and prefect_server.auth_string() not in shown.stdout
        server_argv = Path(f"/proc/{status['server_pid']}/cmdline").read_bytes().split(b"\0")
        assert b"server" in server_argv and b"start" in server_argv  # the server itself, for the benchmarks
        assert answers(api["PREFECT_API_URL"])
        assert status["in_use_by"] == [holder.pid], status
        # `server stop` refuses while it is in use, in one line naming the user (--force: the next test)
        refused = server_cli("stop")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"in use by 1 process (pid {holder.pid}: python" in refused.stderr and "--force" in refused.stderr
        assert "Traceback" not in refused.stderr and pid_alive(status["pid"]) and answers(api["PREFECT_API_URL"])
    pid = server_status()["pid"]
    assert wait_until(lambda: not pid_alive(pid), 90)


@pytest.mark.slow
def test_server_stop_force_stops_a_server_in_use(home: Path) -> None:
    with holding() as (_, api):
        pid = server_status()["pid"]  # the keeper: the holder's child, a zombie once stopped until the holder ends
        forced = server_cli("stop", "--force")
        assert forced.returncode == 0 and forced.stdout.strip() == "stopped", forced.stdout + forced.stderr
        assert not answers(api["PREFECT_API_URL"]) and not ServerDir.of().state_file.exists()

        def ended() -> bool:
            try:
                return " Z " in Path(f"/proc/{pid}/stat").read_text()  # a zombie: it has exited
            except OSError:
                return True  # gone

        assert wait_until(ended, 30)


@pytest.mark.slow
def test_an_online_work_pool_worker_or_an_active_schedule_holds_the_server(home: Path) -> None:
    """Nobody holds a lease and no run moves, but a worker polls for runs or the scheduler will create some."""
    api = json.loads(in_child(HAND_OUT).stdout)  # its lease ends as it exits
    client = PrefectApi.from_env(api, timeout=30)
    assert client is not None
    call = client.call

    pid = server_status()["pid"]
    call("POST", "/work_pools/", {"name": "gpus", "type": "process"})
    call("POST", "/work_pools/gpus/workers/heartbeat", {"name": "w1", "heartbeat_interval_seconds": 60})
    flow = call("POST", "/flows/", {"name": "sweep"})
    deployment = call("POST", "/deployments/", {"name": "nightly", "flow_id": flow["id"],
                                                "schedules": [{"schedule": {"interval": 86400}, "active": True}]})
    time.sleep(10)  # more than three idle limits
    assert pid_alive(pid), "the server left while a worker was online"
    call("DELETE", "/work_pools/gpus/workers/w1")
    time.sleep(10)
    assert pid_alive(pid), "the server left while a deployment had an active schedule"
    call("PATCH", f"/deployments/{deployment['id']}", {"paused": True})
    assert wait_until(lambda: not pid_alive(pid), 90), "no worker, no schedule: it should leave"


def test_bad_settings_are_refused_in_one_line_and_nothing_starts(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPC_GARAGE_PREFECT_DATABASE", "mysql")
    with pytest.raises(UserError, match=r"^HPC_GARAGE_PREFECT_DATABASE='mysql': give sqlite, postgresql"):
        ensure_api()
    monkeypatch.setenv("HPC_GARAGE_PREFECT_DATABASE", "sqlite")
    monkeypatch.setenv("HPC_GARAGE_PREFECT_SERVER_IDLE", "soon")
    with pytest.raises(UserError, match=r"^HPC_GARAGE_PREFECT_SERVER_IDLE='soon': give seconds"):
        ensure_api()
    assert not (home / ".hpc-garage").exists()
    # the CLI says the same in one line, exit 2
    done = subprocess.run([sys.executable, "-m", "hpc_garage", "server", "status"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "HPC_GARAGE_PREFECT_DATABASE": "mysql"})
    assert done.returncode == 0  # status reads; it starts nothing and needs no database choice


def test_the_users_database_url_is_passed_through_without_its_password() -> None:
    choice = prefect_server.database_choice(
        {"HPC_GARAGE_PREFECT_DATABASE": "postgresql+asyncpg://me:s3cret@db.example:5432/prefect"})
    assert choice.kind == "url" and choice.label() == "postgresql+asyncpg://db.example:5432/prefect"
    assert prefect_server.database_choice({"PREFECT_SERVER_DATABASE_CONNECTION_URL": "postgresql+asyncpg://x@h/d"}).kind == "url"
    assert prefect_server.database_choice({}).kind == "sqlite"


@pytest.mark.slow
@pytest.mark.timeout(1500)  # three server starts; each migrates or checks its database
@pytest.mark.skipif(not Path("/usr/lib/postgresql").exists() and not shutil.which("initdb")
                    and os.environ.get("CI") != "true",  # CI installs them (scripts/test): there it must run
                    reason="PostgreSQL's server binaries are not installed (apt install postgresql)")
def test_postgresql_in_user_space(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPC_GARAGE_PREFECT_DATABASE", "postgresql")
    monkeypatch.setenv("HPC_GARAGE_PREFECT_SERVER_IDLE", "600")
    directory = ServerDir.here()
    postgres = prefect_server.ManagedPostgres(directory)
    try:
        env = ensure_api(timeout=START)
        status = server_status()
        assert status["healthy"] and status["database"] == "postgresql (managed)"
        assert (postgres.data / "PG_VERSION").exists()
        assert oct(postgres.base.stat().st_mode & 0o777) == "0o700"
        assert oct(directory.postgres_secrets.stat().st_mode & 0o777) == "0o600"
        socket = postgres.socket_dir / ".s.PGSQL.5432"
        assert socket.exists() and oct(postgres.socket_dir.stat().st_mode & 0o777) == "0o700"
        # a flow run goes into PostgreSQL, not into a SQLite file
        flow = ("import json,sys; from prefect import flow\n@flow\ndef f():\n    return 7\n"
                "print(f())")
        done = in_child(flow, env)
        assert done.stdout.strip().endswith("7"), done.stderr[-2000:]
        assert not list(directory.home.glob("*.db"))
        postmaster = int((postgres.data / "postmaster.pid").read_text().split()[0])
        assert stop_server() is True
        assert not pid_alive(postmaster)  # stopped with the server
        assert not socket.exists()

        # the next start reuses the database: the flow run is still there
        env = ensure_api(timeout=START)
        code = ("import asyncio\nfrom prefect.client.orchestration import get_client\n"
                "async def main():\n    async with get_client() as c:\n        print(len(await c.read_flow_runs()))\n"
                "asyncio.run(main())")
        assert in_child(code, env).stdout.strip() == "1"

        # a keeper killed outright takes its server and PostgreSQL with it (parent-death signals)
        keeper = server_status()["pid"]
        postmaster = int((postgres.data / "postmaster.pid").read_text().split()[0])
        os.kill(keeper, signal.SIGKILL)
        assert wait_until(lambda: not pid_alive(postmaster), 60)
        assert wait_until(lambda: not processes_in(directory.path), 60)
        env = ensure_api(timeout=START)  # and the next run starts cleanly on the same database
        assert in_child(code, env).stdout.strip() == "1"
    finally:
        stop_server()
        if os.geteuid() == 0:
            shutil.rmtree(postgres.base, ignore_errors=True)  # outside HOME: /var/tmp


def test_a_socket_path_too_long_for_unix_sockets_moves_to_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # as a user: the database lives in the state directory
    deep = tmp_path / ("d" * 90)
    postgres = prefect_server.ManagedPostgres(ServerDir(deep))
    assert postgres.data == deep / "postgres" / "data"
    assert postgres.socket_dir.parent == Path(tempfile.gettempdir())
    assert postgres.socket_dir.name.startswith(f"hpc-garage-pg-{os.getuid()}-")
    assert len(str(postgres.socket_dir / ".s.PGSQL.5432")) <= 100
    assert prefect_server.ManagedPostgres(ServerDir(tmp_path)).socket_dir == tmp_path / "postgres" / "run"
