"""A `hpc-garage run` outside a batch job is a job too (schedulers/local.py): `status` lists it while its process
lives, `cancel` ends it, `resume` and `logs` say what they can do for it; a run on another host is known from
its state file."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.rundir import RunRoot
from hpc_garage.schedulers import submission
from hpc_garage.schedulers.local import Local, job_id
from tests.conftest import outside_job_env

PY = sys.executable
ID = re.compile(r"local-\d{8}-\d{6}-(\d+)")


def cli(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout)


def listed(env: dict[str, str], cwd: Path) -> list[dict[str, Any]]:
    done = cli(["status", "--json"], env, cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def until(check: Any, timeout: float = 180, what: str = "", log: Path | None = None) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.3)
    said = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"not within {timeout:.0f} s: {what}\n{said}")


@pytest.fixture
def login(tmp_path: Path) -> dict[str, str]:
    """A login node's environment with a private HOME (its run root) and a Prefect API that COMMAND, which
    does not use Prefect, never needs."""
    home = tmp_path / "home"
    home.mkdir()
    return outside_job_env() | {"HOME": str(home), "PREFECT_API_URL": "http://127.0.0.1:9/api"}


@pytest.mark.slow
def test_status_lists_a_login_node_run_while_it_runs_and_cancel_ends_it(tmp_path: Path,
                                                                         login: dict[str, str]) -> None:
    go, log = tmp_path / "go", tmp_path / "run.log"
    command = [PY, "-c", f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.1)"]
    with log.open("w") as sink:  # a file, not an unread pipe: a run that logs more than a pipe holds would block
        proc = subprocess.Popen([PY, "-m", "hpc_garage", "run", "--site", "local", "--", *command], env=login,
                                cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT)
    try:
        job = until(lambda: next((j for j in listed(login, tmp_path) if (j["run"] or {}).get("phase") == "running"
                                  and not j["finished"]), None),
                    what="`status` lists the run as running on its workers", log=log)
        assert job["summary"].startswith("running"), job
        assert ID.fullmatch(job["job_id"]).group(1) == str(proc.pid)  # the run's own process
        assert job["scheduler"] == "local" and job["site"] == "local" and job["finished"] is False
        one = cli(["status", job["job_id"]], login, tmp_path)
        assert one.returncode == 0, one.stderr
        assert f"local state:    RUNNING (pid {proc.pid} on {socket.gethostname()})" in one.stdout
        for args, says in ((["logs", job["job_id"]], "its output went to the terminal that started it"),
                           (["resume", job["job_id"]], f"is still running in job {job['job_id']}")):
            refused = cli(args, login, tmp_path)
            assert refused.returncode == 2 and says in refused.stderr and len(refused.stderr.splitlines()) == 1, \
                refused.stderr
        cancelled = cli(["cancel", job["job_id"]], login, tmp_path)
        assert cancelled.returncode == 0, cancelled.stderr
        assert cancelled.stdout.strip() == f"cancelled job {job['job_id']} (it was running; `kill -TERM {proc.pid}`)"
        assert proc.wait(timeout=60) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = next(j for j in listed(login, tmp_path) if j["job_id"] == job["job_id"])
    assert ended["finished"] is True and ended["summary"].startswith("cancelled"), ended
    again = cli(["cancel", job["job_id"]], login, tmp_path)
    assert again.returncode == 2 and "is not running (its process is gone)" in again.stderr


@pytest.mark.slow
def test_a_login_node_run_that_ends_is_listed_done(tmp_path: Path, login: dict[str, str]) -> None:
    done = cli(["run", "--site", "local", "--", PY, "-c", "pass"], login, tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    [job] = listed(login, tmp_path)
    assert job["summary"] == "done" and job["scheduler"] == "local" and job["name"] == Path(PY).name
    assert job["run_dir"] == str(Path(login["HOME"]) / ".hpc-garage" / "runs" / job["job_id"])
    report = cli(["report", job["job_id"]], login, tmp_path)
    assert report.returncode == 0 and "trials" in report.stdout, report.stdout + report.stderr


def test_the_process_of_a_run_is_told_from_others_by_its_command_and_start(tmp_path: Path) -> None:
    batch = Local()
    ours = subprocess.Popen([PY, "-c", "import time  # hpc_garage\ntime.sleep(60)"])
    other = subprocess.Popen([PY, "-c", "import time\ntime.sleep(60)"])
    try:
        assert batch.status(job_id(pid=ours.pid)).phase == "running"
        assert batch.status(job_id(time.time() - 7200, ours.pid)) is None  # a recycled pid: started later
        assert batch.status(job_id(pid=other.pid)) is None  # not an hpc-garage process
    finally:
        for p in (ours, other):
            p.kill()
            p.wait()
    assert batch.status(job_id(pid=ours.pid)) is None  # gone
    assert batch.status("12345") is None
    assert batch.cancel_argv(job_id(pid=77)) == ["kill", "-TERM", "77"]
    assert batch.wind_down_argv(job_id(pid=77)) == ["kill", "-URG", "77"]


@pytest.mark.parametrize(("host", "state", "summary"), [
    ("login9", {"phase": "running", "workers": 2}, "running (2 workers)"),
    ("login9", {"phase": "done", "exit_code": 0}, "done"),
    ("login9", {"phase": "failed", "exit_code": None}, "failed (exit code unknown)"),
    (None, {"phase": "running", "workers": 2}, "ended (last seen running)"),  # this host: its process is gone
])
def test_a_run_of_another_host_is_known_from_its_state_file(tmp_path: Path, host: str | None,
                                                             state: dict[str, Any], summary: str) -> None:
    rundir = RunRoot(tmp_path).run_dir(job_id(pid=2 ** 22 + 1)).create()  # above Linux's pid_max: no process
    rundir.write_submit_record({"job_id": rundir.job_id, "scheduler": "local", "site": "local",
                                "host": host or socket.gethostname(), "log": {}, "submitted": time.time()})
    rundir.write_state(state | {"updated": time.time()})
    [view] = submission.status_all([RunRoot(tmp_path)])
    assert view.summary() == summary
    if host and state["phase"] == "running":
        assert view.status.reason == "on login9, as its state file says (its process is checked only there)"


def test_job_ids_outside_a_batch_job_name_their_start_and_pid() -> None:
    found = ID.fullmatch(job_id(0.0, 4242))
    assert found and found.group(1) == "4242"
    assert job_id(time.mktime((2026, 11, 29, 3, 4, 5, 0, 0, -1)), 7) == "local-20261129-030405-7"
    assert os.getpid() == int(ID.fullmatch(job_id()).group(1))


def test_a_run_of_another_host_is_not_signalled_from_here(tmp_path: Path) -> None:
    rundir = RunRoot(tmp_path).run_dir(job_id(pid=os.getpid())).create()  # a pid that lives here: not signalled
    rundir.write_submit_record({"job_id": rundir.job_id, "scheduler": "local", "site": "local", "host": "login9",
                                "log": {}, "submitted": time.time()})
    rundir.write_state({"phase": "running", "workers": 2, "checkpoint_grace": 30, "updated": time.time()})
    [view] = submission.status_all([RunRoot(tmp_path)])
    with pytest.raises(UserError, match=rf"^job {rundir.job_id} runs on login9, not on this host: cancel it there "
                                        rf"\(`ssh login9 hpc-garage cancel {rundir.job_id}`\)$"):
        submission.cancel(view)
    assert not rundir.cancel_requested()
