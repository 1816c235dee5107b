"""Prefect's API failing under a running sweep (issue 11), on the real local SLURM, against a Prefect server
started for these tests only (its own PREFECT_HOME and port; the job gets its PREFECT_API_URL):
- the server SIGKILLed mid-sweep: the job exits 0 with the right result within a minute of the work ending,
  and its log says what was not recorded and where it was kept (hpc_garage/prefect/outage.py); the server
  started again on its database, `hpc-garage replay JOB` makes the API hold every trial COMPLETED and the flow
  run COMPLETED (hpc_garage/prefect/replay.py);
- the job cancelled mid-sweep: the flow run is in a final state in the API.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hpc_garage.prefect_api import PrefectApi
from tests.slurm_jobs import exit_code, wait_gone
from tests.test_faults import SWEEP, runs, wait_marks
from tests.conftest import outside_job_env

PY = sys.executable
TRIALS, DURATION = 12, 2.0  # 2 GPU workers on one node: about 12 s of work
LONG = 6.0  # s per trial where the sweep must still be running when the test stops it (`hpc-garage cancel`
#             alone took up to 20 s to start on this loaded 2-core machine)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


class Server:
    def __init__(self, home: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.home = home
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.start()

    def start(self) -> None:
        """`prefect server start` on this server's port and database (again, after a kill: the same API)."""
        env = {**os.environ, "PREFECT_HOME": str(self.home), "DO_NOT_TRACK": "1",
               "PREFECT_SERVER_UI_ENABLED": "false", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        self.process = subprocess.Popen([PY, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                                         str(self.port)], env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180  # a fresh database is migrated first: 15-60 s here
        while not self.answers():
            assert self.process.poll() is None and time.monotonic() < deadline, "the test's Prefect server did not start"
            time.sleep(0.3)

    def answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its own session: the server and its children
            self.process.wait()

    def flow_runs(self) -> list[dict]:
        return PrefectApi(self.url, timeout=10).post("/flow_runs/filter", {})  # a busy answer (503) is asked again

    def task_runs(self, flow_run_id: str) -> list[dict]:
        return PrefectApi(self.url, timeout=10).post("/task_runs/filter",
                                                     {"flow_runs": {"id": {"any_": [flow_run_id]}}})


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "prefect-home")
    yield s
    s.kill()


def submit_sweep(tmp_path: Path, server: Server, duration: float = DURATION) -> tuple[str, Path, Path, Path]:
    marks, out = tmp_path / "marks", tmp_path / "out.json"
    env = outside_job_env()
    env["PREFECT_API_URL"] = server.url
    done = subprocess.run([PY, "-m", "hpc_garage", "submit", "--site", "lab-gpu", "--nodes", "1", "--gpus-per-node",
                           "2", "--time", "10", str(SWEEP), "--trials", str(TRIALS), "--duration", str(duration),
                           "--marks", str(marks), "--out", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    job, log = re.search(r"submitted job (\S+)", done.stdout), re.search(r"log: (\S+)", done.stdout)
    assert job and log, done.stdout
    return job.group(1), marks, out, Path(log.group(1))


def gone_at(job: str, timeout: float) -> tuple[str, float]:
    final = wait_gone(job, timeout)
    return final, time.time()


def test_the_api_killed_mid_sweep_leaves_the_sweep_its_own_outcome(tmp_path: Path, server: Server) -> None:
    job, marks, out, log_path = submit_sweep(tmp_path, server)
    wait_marks(marks, "done", 2, timeout=150)
    server.kill()
    killed = time.time()
    final, ended = gone_at(job, 240)
    log = log_path.read_text(errors="replace")
    assert exit_code(final) == 0, log[-4000:]
    assert json.loads(out.read_text())["result"] == sum(i * i for i in range(TRIALS))
    assert set(runs(marks, "done")) == set(range(TRIALS))
    work_ended = out.stat().st_mtime  # the flow wrote its result: the work is over
    print(f"API killed {work_ended - killed:.1f} s before the work ended; job gone {ended - work_ended:.1f} s after")
    assert ended - work_ended < 60, (ended - work_ended, log[-4000:])
    said = re.search(r"Prefect's API does not answer: (\d+) finished task runs may be missing from it, and (\d+) "
                     r"events and (\d+) log lines", log)
    assert said and int(said.group(1)) == TRIALS + 1, log[-4000:]  # every trial and the total
    assert re.search(r"flow run \S+ is COMPLETED here; Prefect's API does not answer", log), log[-4000:]
    assert f"were kept for replay in {log_path.with_suffix('')}/unrecorded (`hpc-garage replay {job}`" in log
    unrecorded = json.loads((log_path.with_suffix("") / "unrecorded.json").read_text())  # runs/JOB.out -> runs/JOB/
    assert unrecorded["flow_run_state"] == "COMPLETED" and len(unrecorded["task_run_ids"]) == TRIALS + 1

    # the API back on its database: `hpc-garage replay JOB` sends what the job kept, and the API then holds
    # every trial and the total COMPLETED, and the flow run in its final state (counted from the API)
    restarted = time.time()
    server.start()
    deadline = time.monotonic() + 180
    while not server.answers():
        assert server.process.poll() is None and time.monotonic() < deadline, "the Prefect server did not restart"
        time.sleep(0.3)
    flow_run_id = unrecorded["flow_run_id"]
    before = sorted(t["state_type"] for t in server.task_runs(flow_run_id))
    env = outside_job_env(("PREFECT_API",))
    replayed = time.time()
    done = subprocess.run([PY, "-m", "hpc_garage", "replay", job], capture_output=True, text=True, env=env,
                          timeout=180)
    print(f"API restarted in {replayed - restarted:.1f} s; replay took {time.time() - replayed:.1f} s; before it "
          f"the API held {before.count('COMPLETED')} of {TRIALS + 1} task runs COMPLETED ({len(before)} in all)")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"holds {TRIALS + 1} of the {TRIALS + 1} task runs the flow listed as finished" in done.stdout, done.stdout
    task_runs = server.task_runs(flow_run_id)
    assert sorted(t["name"].split("-")[0] for t in task_runs) == ["total"] + ["trial"] * TRIALS, task_runs
    assert {t["state_type"] for t in task_runs} == {"COMPLETED"}, [(t["name"], t["state_type"]) for t in task_runs]
    assert [(r["id"], r["state_type"]) for r in server.flow_runs()] == [(flow_run_id, "COMPLETED")]
    again = subprocess.run([PY, "-m", "hpc_garage", "replay", job], capture_output=True, text=True, env=env,
                           timeout=120)
    assert again.returncode == 2 and "replayed already" in again.stderr, again.stdout + again.stderr


def test_a_cancelled_job_leaves_its_flow_run_in_a_final_state(tmp_path: Path, server: Server) -> None:
    job, marks, out, log_path = submit_sweep(tmp_path, server, LONG)
    wait_marks(marks, "done", 2, timeout=150)
    cancel = subprocess.run([PY, "-m", "hpc_garage", "cancel", job], capture_output=True, text=True, timeout=60)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    wait_gone(job, 60)
    assert not out.exists()  # it was stopped mid-sweep
    flow_runs = server.flow_runs()
    assert len(flow_runs) == 1, flow_runs
    assert flow_runs[0]["state_type"] in ("CRASHED", "CANCELLED"), (flow_runs[0]["state_type"],
                                                                    log_path.read_text(errors="replace")[-4000:])
    run_dir = log_path.with_suffix("")
    assert run_dir.is_dir() and not (run_dir / "scheduler.json").exists() and not (run_dir / "tls").exists()


def flow_process(marks: Path) -> int:
    """The pid of the sweep's own Python process (COMMAND), not `run`'s."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if str(marks) in argv and any(a.endswith("fault_sweep.py") for a in argv) and "hpc_garage" not in argv:
            return int(entry.name)
    raise AssertionError("no flow process")


def test_a_killed_flow_process_leaves_no_running_flow_run(tmp_path: Path, server: Server) -> None:
    """SIGKILL gives the flow no chance to say Crashed; `run` says it for it, even before any trial finished
    (the task runner noted its flow run in the run directory at its first submission)."""
    job, marks, out, log_path = submit_sweep(tmp_path, server, LONG)
    wait_marks(marks, "start", 1, timeout=150)
    assert not list(marks.glob("done-*"))  # no finished trial has told `run` the flow run
    os.kill(flow_process(marks), signal.SIGKILL)
    final = wait_gone(job, 120)
    log = log_path.read_text(errors="replace")
    assert exit_code(final) != 0 and not out.exists(), log[-4000:]
    flow_runs = server.flow_runs()
    assert [r["state_type"] for r in flow_runs] == ["CRASHED"], (flow_runs, log[-4000:])
    assert re.search(r"flow run \S+ set Crashed in Prefect's API \(COMMAND ended, exit code 137\)", log), log[-4000:]
