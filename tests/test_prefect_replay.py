"""`hpc-garage replay JOB` (hpc_garage/prefect/replay.py) against a real Prefect server: what a run directory
kept is sent once (a second replay sends nothing again; lines added since are sent alone), and each bad input
is one line with exit 2 that names what to do; a job whose API was hpc-garage's managed server reaches the
one that runs now (started again on another port and auth string). The kept files are written here as the flow's outage path
writes them (events as Prefect's task engine makes them, with their flow run); tests/test_prefect_faults.py
replays a real job's after SIGKILLing its API.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hpc_garage.prefect_api import PrefectApi
from tests.conftest import outside_job_env

PY = sys.executable
JOB = "4242"


def api_client(api: dict[str, str]) -> PrefectApi:
    """hpc-garage's one client of Prefect's API: a server busy under load (503) is asked again, as Prefect's own
    client does; an error status raises with the server's answer (a bare httpx call read a 503's body as a run)."""
    client = PrefectApi.from_env(api, timeout=30)
    assert client is not None, api
    return client


def hpcg(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, env=env, timeout=180)


def hpcg_here(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`hpcg` in this process, for refusals (the CLI's own `main`, in exactly `env`): no interpreter and no
    Prefect import per call."""
    import contextlib
    import io
    from unittest import mock

    from hpc_garage.cli import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch.dict(os.environ, env, clear=True), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        main(list(args))
    code = exited.value.code
    return subprocess.CompletedProcess(["hpc-garage", *args], code if isinstance(code, int) else 1, out.getvalue(),
                                       err.getvalue())


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A site whose run directory is private to this test, and the environment that finds it."""
    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "replay-lab.yaml").write_text(f"scheduler: slurm\nnode: {{cores: 4, memory: 8GiB}}\n"
                                           f"run_directory: {tmp_path / 'runs'}\n")
    env = outside_job_env()
    return tmp_path / "runs", {**env, "HPC_GARAGE_SITES_PATH": str(sites)}


def task_run_events(task_run_id: str, flow_run_id: str, index: int) -> list[str]:
    """Pending, Running, Completed of one task run, shaped as Prefect's task engine emits them."""
    from prefect.events.schemas.events import Event

    at = datetime.now(timezone.utc) - timedelta(minutes=5)
    events, previous = [], None
    for step, (kind, name) in enumerate((("PENDING", "Pending"), ("RUNNING", "Running"), ("COMPLETED", "Completed"))):
        event = Event(
            id=uuid.uuid4(), occurred=at + timedelta(seconds=step), event=f"prefect.task-run.{name}", follows=previous,
            resource={"prefect.resource.id": f"prefect.task-run.{task_run_id}", "prefect.resource.name": f"t-{index}",
                      "prefect.state-type": kind, "prefect.state-name": name, "prefect.orchestration": "client"},
            related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}],
            payload={"validated_state": {"type": kind, "name": name, "message": "", "state_details": {}},
                     "task_run": {"name": f"t-{index}", "task_key": "t-key", "dynamic_key": str(index),
                                  "run_count": 1 if step else 0, "tags": [], "task_inputs": {}}})
        previous = event.id
        events.append(event.model_dump_json())
    return events


def kept_run(run_dir: Path, url: str, flow_run_id: str, task_run_ids: list[str]) -> Path:
    """A run directory as a job leaves it when its API died: unrecorded.json, unrecorded/ with one process's
    events and log lines, and the flow run's kept final state."""
    kept = run_dir / "unrecorded"
    kept.mkdir(parents=True)
    (run_dir / "unrecorded.json").write_text(json.dumps({"api_url": url, "flow_run_id": flow_run_id,
                                                         "task_run_ids": task_run_ids}))
    lines = [line for i, t in enumerate(task_run_ids) for line in task_run_events(t, flow_run_id, i)]
    (kept / "events-node1-100.jsonl").write_text("".join(line + "\n" for line in lines))
    log = {"name": "prefect.flow_runs", "level": 20, "message": "kept while the API was down",
           "timestamp": datetime.now(timezone.utc).isoformat(), "flow_run_id": flow_run_id, "task_run_id": None}
    (kept / "logs-node1-100.jsonl").write_text(json.dumps(log) + "\n")
    (kept / "flow-runs.json").write_text(json.dumps({flow_run_id: {"type": "COMPLETED", "name": "Completed",
                                                                   "message": None, "timestamp": None}}))
    return kept


@pytest.mark.slow  # a real Prefect server (fixture `api`)
def test_replay_sends_what_was_kept_once(runs: tuple[Path, dict[str, str]], api: dict[str, str]) -> None:
    root, env = runs  # the environment names the API's auth string, as a user's would (PREFECT_API_*)
    url = api["PREFECT_API_URL"]
    http = api_client(api)
    flow = http.post("/flows/", {"name": "replay-test"})
    flow_run_id = http.post("/flow_runs/", {"flow_id": flow["id"], "state": {"type": "RUNNING"}})["id"]
    task_run_ids = [str(uuid.uuid4()) for _ in range(3)]
    kept = kept_run(root / JOB, url, flow_run_id, task_run_ids)

    def held() -> tuple[list[str], str, int]:
        task_runs = http.post("/task_runs/filter", {"task_runs": {"id": {"any_": task_run_ids}}})
        flow_run = http.get(f"/flow_runs/{flow_run_id}")
        logs = http.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}})
        return sorted(t["state_type"] for t in task_runs), flow_run["state_type"], len(logs)

    assert held() == ([], "RUNNING", 0)
    first = hpcg("replay", JOB, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"job {JOB}: sent 9 events and 1 log lines" in first.stdout
    assert f"flow run {flow_run_id} set COMPLETED (was RUNNING)" in first.stdout
    assert "holds 3 of the 3 task runs the flow listed as finished in a final state, and 3 of the 3" in first.stdout
    assert held() == (["COMPLETED"] * 3, "COMPLETED", 1)  # counted from the API, not from the files
    assert oct((kept / "replayed.json").stat().st_mode & 0o777) == "0o600"

    again = hpcg("replay", JOB, env=env)
    assert again.returncode == 2 and again.stdout == "", again.stdout + again.stderr
    assert again.stderr.count("\n") == 1 and "nothing to replay" in again.stderr and "replayed already" in again.stderr
    assert held() == (["COMPLETED"] * 3, "COMPLETED", 1)  # nothing was sent again: still one log line

    later = str(uuid.uuid4())  # a process that appended after the first replay: only its lines go out
    task_run_ids.append(later)
    with (kept / "events-node1-100.jsonl").open("a") as f:
        f.write("".join(line + "\n" for line in task_run_events(later, flow_run_id, 3)))
    third = hpcg("replay", JOB, "--site", "replay-lab", env=env)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "sent 3 events and 0 log lines" in third.stdout and "and 1 of the 1 the replayed events" in third.stdout
    assert held() == (["COMPLETED"] * 4, "COMPLETED", 1)


def test_replay_refuses_bad_input_in_one_line(runs: tuple[Path, dict[str, str]]) -> None:
    root, env = runs
    unknown = hpcg_here("replay", "987654321", "--site", "replay-lab", env=env)
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1, unknown.stderr
    assert "job 987654321: no run directory here; pass --site" in unknown.stderr

    (root / "5151").mkdir(parents=True)  # a job whose API answered throughout: nothing kept
    nothing = hpcg_here("replay", "5151", env=env)
    assert nothing.returncode == 2 and nothing.stderr.count("\n") == 1, nothing.stderr
    assert "job 5151: nothing to replay" in nothing.stderr

    with socket.socket() as s:  # a port nothing listens on: the API is still down
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    kept = kept_run(root / JOB, down, str(uuid.uuid4()), [str(uuid.uuid4())])
    still_down = hpcg_here("replay", JOB, env={k: v for k, v in env.items() if k != "PREFECT_API_URL"})  # else it wins
    assert still_down.returncode == 2 and still_down.stderr.count("\n") == 1, still_down.stderr
    assert f"Prefect's API at {down} does not answer yet" in still_down.stderr
    assert f"retry `hpc-garage replay {JOB}`" in still_down.stderr
    assert not (kept / "replayed.json").exists()  # nothing marked: the next try sends it all

    summary = json.loads((root / JOB / "unrecorded.json").read_text())  # the job's API was hpc-garage's server:
    refused = []  # on another machine; on this one, on another database than the server here has or would have
    for server, says in (({"machine": "elsewhere", "host": "127.0.0.1", "database": "sqlite"},
                          "its Prefect API was hpc-garage's server on elsewhere (host 127.0.0.1, database sqlite); "
                          "run this on elsewhere, or set PREFECT_API_URL"),
                         ({"machine": socket.gethostname().split(".")[0], "host": "127.0.0.1",
                           "database": "postgresql (managed)"},
                          "its Prefect API was hpc-garage's server on database postgresql (managed), and the one "
                          "here")):
        (root / JOB / "unrecorded.json").write_text(json.dumps({**summary, "prefect_server": server}))
        refused.append(hpcg_here("replay", JOB, env={k: v for k, v in env.items() if k != "PREFECT_API_URL"}))
        assert refused[-1].returncode == 2 and refused[-1].stderr.count("\n") == 1, refused[-1].stderr
        assert f"job {JOB}: {says}" in refused[-1].stderr, refused[-1].stderr
    for result in (unknown, nothing, still_down, *refused):
        assert "Traceback" not in result.stderr


@pytest.mark.slow  # a real Prefect server (fixture `api`), started again
def test_replay_reaches_the_managed_server_started_again(runs: tuple[Path, dict[str, str]], api: dict[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's API was hpc-garage's server; it stopped (`hpc-garage server stop`, as when it idles out) and
    nothing started it again: replay starts it, on another port and auth string, and the API then holds the
    job's runs. Runs last in this module: it replaces the module's server (about 15 s, most of it the start)."""
    from hpc_garage.variables import RUN_DIR_ENV
    from hpc_garage.prefect import outage
    from hpc_garage.prefect.server import ServerDir

    root, env = runs
    env = {k: v for k, v in env.items() if not k.startswith("PREFECT_API_")}  # the user names no API of theirs
    url, auth = api["PREFECT_API_URL"], api["PREFECT_API_AUTH_STRING"]
    http = api_client(api)
    flow = http.post("/flows/", {"name": "replay-managed-test"})
    flow_run_id = http.post("/flow_runs/", {"flow_id": flow["id"], "state": {"type": "RUNNING"}})["id"]
    task_run_ids = [str(uuid.uuid4()) for _ in range(2)]
    run_dir = root / "4343"
    kept_run(run_dir, url, flow_run_id, task_run_ids)
    (run_dir / "unrecorded.json").unlink()
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))  # the summary as the job's flow process writes it, with the
    outage._note_unrecorded({"flow_run_id": flow_run_id, "task_run_ids": task_run_ids})  # API env it was given
    summary = json.loads((run_dir / "unrecorded.json").read_text())
    assert summary["api_url"] == url and summary["prefect_server"]["database"] == "sqlite", summary

    stopped = hpcg("server", "stop", "--force", env=env)  # this test's process holds it (fixture `api`)
    assert stopped.returncode == 0 and not ServerDir.of().state_file.exists(), stopped.stdout + stopped.stderr
    replayed = hpcg("replay", "4343", env=env)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    now = json.loads(ServerDir.of().state_file.read_text())  # the server replay started
    assert (now["url"], now["auth"]) != (url, auth) and now["url"] in replayed.stdout, replayed.stdout
    assert f"flow run {flow_run_id} set COMPLETED (was RUNNING)" in replayed.stdout
    http = api_client({"PREFECT_API_URL": now["url"], "PREFECT_API_AUTH_STRING": now["auth"]})
    task_runs = http.post("/task_runs/filter", {"task_runs": {"id": {"any_": task_run_ids}}})
    assert sorted(t["state_type"] for t in task_runs) == ["COMPLETED"] * 2  # counted from the new instance
    assert http.get(f"/flow_runs/{flow_run_id}")["state_type"] == "COMPLETED"
