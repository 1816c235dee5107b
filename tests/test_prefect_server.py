"""One Prefect API per job: the user's when configured, else one shared, authenticated hpc-garage server."""

from __future__ import annotations

import base64
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from hpc_garage.prefect import server as prefect_server
from hpc_garage.prefect.server import processes
from hpc_garage.core.errors import UserError
from hpc_garage.prefect.server import ServerDir, configured_api_url, ensure_api, server_status, stop_server


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private HOME and no Prefect configuration from the machine running the tests."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_HOME", "PREFECT_PROFILES_PATH",
                 "PREFECT_API_AUTH_STRING"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def get(url: str, auth: str | None = None) -> int:
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


# ------------------------------------------------------------------------------ the server directory


def _server_dir_paths(directory: ServerDir) -> dict[str, Path]:
    return {"server.json": directory.state_file, "server.log": directory.log_file, "home": directory.home,
            "activity.json": directory.activity_file, "leases": directory.leases, "leases/12": directory.lease(12),
            "postgres.json": directory.postgres_secrets, "postgres": directory.postgres_files}


def test_every_path_in_the_server_directory_comes_from_the_server_dir(home: Path) -> None:
    """Per machine (~ is shared by every node) and per bind address; `of` creates nothing, `here` makes it
    private."""
    machine = prefect_server.machine_name()
    directory = ServerDir.of()
    assert directory == ServerDir.of("localhost") == ServerDir(home / ".hpc-garage" / "prefect" / machine)
    assert ServerDir.of("10.0.0.5").path == directory.path / "bind-10.0.0.5"
    assert ServerDir.of(machine="node7").path == home / ".hpc-garage" / "prefect" / "node7"
    assert not (home / ".hpc-garage").exists()
    paths = _server_dir_paths(directory)
    assert {name: str(path.relative_to(directory.path)) for name, path in paths.items()} == {n: n for n in paths}
    assert ServerDir.here() == directory and stat.S_IMODE(directory.path.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / ".hpc-garage" / "prefect").stat().st_mode) == 0o700


def test_the_server_directory_records_the_server_and_forgets_it(home: Path) -> None:
    directory = ServerDir.here()
    assert directory.state() is None and directory.activity() == {}
    state = prefect_server.ServerState(url="http://127.0.0.1:4242/api", pid=12, auth="hpc-garage:x",
                                       host="127.0.0.1", port=4242, started=1.0)
    directory.record(state)
    assert directory.state() == state and stat.S_IMODE(directory.state_file.stat().st_mode) == 0o600
    directory.state_file.write_text('{"url": ')  # half-written (its writer killed): no server
    assert directory.state() is None
    directory.record(state)
    directory.forget()
    assert directory.state() is None and not directory.state_file.exists()
    directory.write_activity({"pid": 12, "last_activity": 5.0})
    assert directory.activity() == {"pid": 12, "last_activity": 5.0}
    with directory.locked():
        assert (directory.path / "lock").exists()


def test_no_other_module_spells_a_name_in_the_server_directory() -> None:
    """Each name appears in prefect/server/state.py alone: a module that spells one again fails here, naming
    file and line. ("postgres" is left out: it is also the program's and its system user's name.)"""
    import ast

    import hpc_garage

    package = Path(hpc_garage.__file__).parent
    names = {name for name in _server_dir_paths(ServerDir(Path("/d"))) if "/" not in name} | {"lock"}
    names -= {"postgres"}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path == package / "prefect" / "server" / "state.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {node.value!r}")
    assert not found, "spelled outside hpc_garage/prefect/server/state.py:\n" + "\n".join(found)


def test_the_users_api_wins_and_nothing_is_started(home: Path) -> None:
    env = {"PREFECT_API_URL": "http://prefect.example:4200/api", "HOME": str(home)}
    assert ensure_api(env=env) == {"PREFECT_API_URL": "http://prefect.example:4200/api"}
    assert not (home / ".hpc-garage").exists()


def test_the_active_profile_counts_as_configured(home: Path) -> None:
    prefect_home = home / ".prefect"
    prefect_home.mkdir()
    (prefect_home / "profiles.toml").write_text(
        'active = "mine"\n[profiles.mine]\nPREFECT_API_URL = "http://mine:4200/api"\n')
    assert configured_api_url({}) == "http://mine:4200/api"
    assert configured_api_url({"PREFECT_PROFILE": "local"}) == "http://127.0.0.1:4200/api"  # Prefect's own
    assert configured_api_url({"PREFECT_PROFILE": "ephemeral"}) is None
    assert ensure_api(env={}) == {"PREFECT_API_URL": "http://mine:4200/api"}


@pytest.mark.slow
def test_one_server_shared_reused_authenticated_and_stopped(home: Path) -> None:
    # two processes at once: the lock makes them share one server
    code = "import json; from hpc_garage.prefect.server import ensure_api; print(json.dumps(ensure_api()))"
    callers = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    envs = [json.loads(p.communicate(timeout=180)[0]) for p in callers]
    assert envs[0] == envs[1]
    env = envs[0]
    state = json.loads(ServerDir.of().state_file.read_text())
    assert env == {"PREFECT_API_URL": state["url"], "PREFECT_API_AUTH_STRING": state["auth"],
                   "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                   "PREFECT_UI_URL": state["url"].removesuffix("/api") + "/v2",  # its UI (tests/test_prefect_ui.py)
                   "HPC_GARAGE_PREFECT_SERVER": json.dumps({"machine": os.uname().nodename.split(".")[0],
                                                            "host": "127.0.0.1", "database": "sqlite"})}
    directory = home / ".hpc-garage" / "prefect" / os.uname().nodename.split(".")[0]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(ServerDir(directory).state_file.stat().st_mode) == 0o600
    assert ServerDir(directory).home.is_dir()  # its own PREFECT_HOME: migrations happen once

    url, auth = env["PREFECT_API_URL"], env["PREFECT_API_AUTH_STRING"]
    assert get(f"{url}/health") == 200
    assert get(f"{url}/admin/version") == 401  # Prefect 3.8 enforces the auth string
    assert get(f"{url}/admin/version", "hpc-garage:wrong") == 401
    assert get(f"{url}/admin/version", auth) == 200
    server_pid = server_status()["server_pid"]  # Prefect's server, in serve.py's process (its SQLite by index)
    assert b"hpc_garage.prefect.server\0prefect\0server\0start\0" in Path(f"/proc/{server_pid}/cmdline").read_bytes()

    started = time.monotonic()
    assert ensure_api() == env  # reused, not restarted
    assert time.monotonic() - started < 1

    # a server that died is replaced; the state file follows
    os.kill(state["pid"], signal.SIGKILL)
    while processes.process_alive(state["pid"]):
        time.sleep(0.05)
    replaced = ensure_api()
    assert replaced["PREFECT_API_URL"] != url or replaced["PREFECT_API_AUTH_STRING"] != auth
    status = server_status()
    assert status["healthy"] and status["url"] == replaced["PREFECT_API_URL"] and "auth" not in status

    assert stop_server() is True
    assert server_status()["running"] is False
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{replaced['PREFECT_API_URL']}/health", timeout=2)
    assert stop_server() is False


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path):  # noqa: ANN201
    """An interpreter whose `-m prefect server start` misbehaves as the test says."""

    def make(body: str) -> Path:
        script = tmp_path / "fake-python"
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
        monkeypatch.setattr(sys, "executable", str(script))
        return script

    return make


def test_a_server_that_exits_is_reported_with_its_log(fake_python) -> None:  # noqa: ANN001
    fake_python('echo "starting"; echo "OSError: [Errno 98] address already in use"; exit 3')
    with pytest.raises(UserError) as caught:
        ensure_api()
    message = str(caught.value)
    assert "exited with code 3" in message and "address already in use" in message
    assert "\n" not in message
    assert not ServerDir.of().state_file.exists()


def test_a_port_taken_between_choice_and_bind_is_tried_again_on_another(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """Another process on a busy login node binds the port hpc-garage chose before the server does (seen in
    CI): the start goes on on another port; the same port offered again is no race, and is refused."""
    from hpc_garage.prefect.server import managed

    ports, started = iter([5001, 5002, 5003]), []

    def start_on(port: int, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        started.append(port)
        if port == 5001:
            raise managed._PortTaken(UserError(f"port {port}: address already in use"))
        return f"server on {port}"

    monkeypatch.setattr(managed, "_free_port", lambda host: next(ports))
    monkeypatch.setattr(managed, "_start_on", start_on)
    assert managed._start(tmp_path, "127.0.0.1", 1.0, 60.0, None) == "server on 5003"  # 5002: the check
    assert started == [5001, 5003]
    monkeypatch.setattr(managed, "_free_port", lambda host: 5001)
    started.clear()
    with pytest.raises(UserError, match="port 5001: address already in use"):
        managed._start(tmp_path, "127.0.0.1", 1.0, 60.0, None)
    assert started == [5001]


def test_a_server_that_never_answers_is_stopped(fake_python) -> None:  # noqa: ANN001
    fake_python('echo "hanging"; sleep 600')
    before = set(processes.children)  # another module's server, stopped by `server stop`, may be listed
    with pytest.raises(UserError, match="did not answer within 1 s.*hanging"):
        ensure_api(timeout=1)
    assert set(processes.children) <= before  # killed and reaped, not left behind


def test_the_server_batches_its_records_and_the_users_settings_win(fake_python, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL", "2")
    fake_python('env > server-env.txt; exit 3')
    with pytest.raises(UserError):
        ensure_api()
    env_file = ServerDir.of().path / "server-env.txt"  # the fake keeper's, in its working directory
    seen = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert seen["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"] == "100"
    assert seen["PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL"] == "2"  # the user's
    assert seen["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_READ_BATCH_SIZE"] == "100"

    # the names are Prefect's: its settings read them (a misspelt one would be ignored silently)
    from prefect.settings import Settings

    monkeypatch.delenv("PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL")
    for name, value in prefect_server.BATCHING.items():
        monkeypatch.setenv(name, value)
    services = Settings().server.services
    assert (services.task_run_recorder.batch_size, services.task_run_recorder.read_batch_size) == (100, 100)
    assert int(services.task_run_recorder.flush_interval) >= 1  # the recorder flushes every int(interval) s
    assert (services.event_persister.batch_size, services.event_persister.flush_interval) == (100, 1)
    assert services.triggers.read_batch_size == 100


# ---- a server that cannot start: refused at once, naming the cause (not after the start timeout, 120 s)

CANNOT_START = """
import os, sys, time
cause, entry, value = sys.argv[1:4]
import prefect  # the real one: the broken copy below goes first on PYTHONPATH for the server's processes only
from hpc_garage.prefect.server import managed
if cause == "import":
    os.environ["PYTHONPATH"] = value
else:
    managed._free_port = lambda host: int(value)  # another process took the port hpc-garage chose
import hpc_garage
import hpc_garage.prefect.task_runner  # imported before the clock starts: the refusal is timed, not imports
from hpc_garage.cli import main
from prefect import flow
started = time.monotonic()
try:
    if entry == "task_runner":
        @flow(task_runner=hpc_garage.task_runner())
        def sweep() -> None:
            pass
    else:
        main(["run", "--", sys.executable, "-c", "pass"])
except SystemExit as exc:
    print(f"exit {exc.code}")
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}")
print(f"took {time.monotonic() - started:.2f}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("entry", ["task_runner", "run"])
@pytest.mark.parametrize("cause", ["import", "port"])
def test_a_server_that_cannot_start_is_refused_at_once(cause: str, entry: str, home: Path, tmp_path: Path) -> None:
    """Prefect cannot be imported by the server (a broken install), or its port is taken: the keeper's child
    exits at once, and so does the keeper (it used to outlive it, holding `task_runner()` and `run` for the
    whole start timeout); the one line names the cause and the server log."""
    import socket

    broken = tmp_path / "broken"
    (broken / "prefect").mkdir(parents=True)
    (broken / "prefect" / "__init__.py").write_text(
        "raise ImportError(\"cannot import name 'SERVER_API' from 'prefect.server' (a broken install)\")\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        value = str(broken) if cause == "import" else str(taken.getsockname()[1])
        done = subprocess.run([sys.executable, "-c", CANNOT_START, cause, entry, value], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path)
    said = done.stdout + done.stderr
    took = float(done.stdout.rsplit("took ", 1)[1].split()[0])
    print(f"{cause}, {entry}: refused after {took:.1f} s")
    assert took < 10, said
    line = next(x for x in said.splitlines() if "the Prefect server hpc-garage started" in x)
    assert (entry == "run") == ("exit 2" in said), said
    log = ServerDir.of().log_file
    assert f"last lines of {log}" in line, line
    cause_named = "cannot import name 'SERVER_API'" if cause == "import" else f"port {value} of 127.0.0.1 is already in use"
    assert f"exited with code {1 if cause == 'import' else 2}: " in line and cause_named in line, line
    assert not ServerDir.of().state_file.exists()


def test_a_group_that_ends_before_its_signal_is_no_error() -> None:
    """terminate() looks, then signals: under load the group's last member can end in between."""
    ended = subprocess.Popen(["true"], start_new_session=True)
    ended.wait()  # reaped: its group has no member left
    with pytest.raises(ProcessLookupError):
        os.killpg(ended.pid, signal.SIGKILL)  # what terminate() called before
    processes._signal_group(ended.pid, signal.SIGKILL)
