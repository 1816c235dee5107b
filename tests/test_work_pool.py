"""The `hpc-garage` work pool: deployment runs become one batch job each, followed to their end.

The fast tests check the job variables and the job script; the SLURM ones run the real thing: a managed
Prefect server, `hpc-garage worker`, a path-based deployment of examples/sweep.py, `prefect deployment run`.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.prefect_api import PrefectApi
from tests.test_e2e import check_placement
from tests.conftest import outside_job_env

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
POOL = "test-gpus"
FLOW_RUN = "0b8c6a2e-5d0f-4c3e-9a51-7f2d1e4c9b10"


# ------------------------------------------------------------------------------------ fast: variables


def test_job_variables_are_submits_flags_checked_the_same_way() -> None:
    from hpc_garage.schedulers.flow_run_jobs import request_of

    site, request, sweep, resume = request_of({"site": "lab-gpu", "nodes": 2, "gpus_per_node": "3", "mem": "8GiB",
                                              "time": "1h", "qos": "short", "scheduler_options": ["--constraint=x"],
                                              "sweep": "lr-scan", "resume": True})
    assert site == "lab-gpu" and sweep == "lr-scan" and resume is True
    assert (request.nodes, request.gpus_per_node, request.memory, request.walltime) == (2, 3, 8 * 2**30, 3600)
    assert request.extra_directives == ("--constraint=x",) and request.qos == "short"
    for values, words in (({}, "job variable site is not set"),
                          ({"site": "lab-gpu", "nodes": "two"}, "job variable nodes 'two': give a whole number"),
                          ({"site": "lab-gpu", "mem": "lots"}, "job variable mem 'lots'"),
                          ({"site": "lab-gpu", "time": "soon"}, "job variable time 'soon'"),
                          ({"site": "lab-gpu", "scheduler_options": "--exclusive"}, "give a list"),
                          ({"site": "lab-gpu", "resume": "yes"}, "give true or false"),
                          ({"site": "lab-gpu", "gpus": 2}, "job variable 'gpus' is not one of hpc-garage's")):
        with pytest.raises(UserError, match=re.escape(words)) as caught:
            request_of(values)
        assert "\n" not in str(caught.value)


def _job(tmp_path: Path, **values: Any) -> Any:
    from hpc_garage.schedulers.flow_run_jobs import FlowRunJob

    return FlowRunJob(flow_run_id=FLOW_RUN, flow_run_name="brave-otter", values={"site": "lab-gpu", **values},
                      env={"PREFECT_API_URL": "http://127.0.0.1:1/api", "PREFECT_API_AUTH_STRING": "u:p w'x",
                           "UNSET": None}, workdir=str(tmp_path), default_sweep="sweep-gpu")


def test_the_job_runs_prefects_engine_for_the_flow_run_with_the_api_exported(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_garage.schedulers.flow_run_jobs import prepare_flow_run

    monkeypatch.setenv("HOME", str(tmp_path))
    prepared = prepare_flow_run(_job(tmp_path, nodes=2, job_name="train"))
    script = prepared.script
    assert f'-- "$PY" -m prefect.engine {FLOW_RUN}\n' in script
    assert "--sweep sweep-gpu --sweep-epoch 1" in script
    assert f"cd {tmp_path} " in script and "#SBATCH --nodes=2" in script
    assert "#SBATCH --job-name=train-0b8c6a2e5d0f" in script  # the flow run's short id: found again by name
    assert "export PREFECT_API_AUTH_STRING='u:p w'\"'\"'x'" in script
    assert "UNSET" not in script
    assert prepared.spec.command[-3:] == ["-m", "prefect.engine", FLOW_RUN]


def test_a_bad_value_is_refused_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_garage.schedulers.flow_run_jobs import prepare_flow_run

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(UserError, match=r"^--gpus-per-node 99: a lab-gpu node has 4 GPUs; ask for 0 to 4$"):
        prepare_flow_run(_job(tmp_path, gpus_per_node=99))
    with pytest.raises(UserError, match="not an environment variable name"):
        prepare_flow_run(replace(_job(tmp_path), env={"A-B": "1"}))
    assert not (tmp_path / "home").exists()


def test_a_flow_run_is_submitted_once_whatever_its_claim_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claim with a job id is that job; a dead worker's claim without one is settled by the queue (a job of
    the claimed name), else submitted; a live worker's claim is left to it. No batch system is called here."""
    import socket

    from hpc_garage.schedulers import flow_run_jobs, get
    from hpc_garage.schedulers.flow_run_jobs import Busy, prepare_flow_run, take

    monkeypatch.setenv("HOME", str(tmp_path))
    job = _job(tmp_path, nodes=1)
    prepared = prepare_flow_run(job)
    claims = flow_run_jobs.claims_dir(prepared)
    claims.mkdir(parents=True)
    claim = claims / f"{FLOW_RUN}.json"
    submitted: list[str] = []
    monkeypatch.setattr(flow_run_jobs, "submit", lambda p: submitted.append("x") or pytest.fail("submitted again"))

    claim.write_text(json.dumps({"flow_run": FLOW_RUN, "job_id": "41", "site": "lab-gpu"}))
    assert (take(job, prepared).job_id, take(job, prepared).fresh) == ("41", False)

    asked: list[str] = []
    batch = type(get("slurm"))
    monkeypatch.setattr(batch, "jobs_named", lambda self, name: asked.append(name) or ["42"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    claim.write_text(json.dumps({"flow_run": FLOW_RUN, "job_name": prepared.spec.job_name, "host": socket.gethostname(),
                                 "pid": dead.pid, "claimed": 1.0}))
    stray = prepared.root / ".submit-dead.sh"  # the dead worker's temporary copy, handed to sbatch
    stray.write_text(prepared.script)
    taken = take(job, prepared)
    assert taken.job_id == "42" and asked == [prepared.spec.job_name]
    assert json.loads(claim.read_text())["job_id"] == "42"  # noted: the queue is not asked again
    # it died before it recorded the job: the job gets its run directory as `submit` gives it (status, logs,
    # resume and walltime follow-ups read them), and the dead worker's temporary script goes
    from hpc_garage.rundir import RunDir

    adopted = RunDir.for_job(prepared.root, "42")
    record = adopted.submit_record()
    assert record is not None and record["job_id"] == "42" and record["job_name"] == prepared.spec.job_name
    assert record["log"]["path"] == taken.log and adopted.script_file.read_text() == prepared.script
    assert oct(adopted.script_file.stat().st_mode & 0o777) == "0o600" and not stray.exists()

    alive = subprocess.Popen(["sleep", "30"])
    try:
        claim.write_text(json.dumps({"flow_run": FLOW_RUN, "job_name": "x", "host": socket.gethostname(),
                                     "pid": alive.pid, "claimed": 1.0}))
        with pytest.raises(Busy):
            take(job, prepared)
    finally:
        alive.kill()
        alive.wait()
    assert not submitted


def test_the_run_form_is_submits_flags_with_the_sites_defaults() -> None:
    from hpc_garage.work_pool import HpcGarageWorker, base_job_template

    assert HpcGarageWorker.type == "hpc-garage"
    template = base_job_template("lab-gpu")
    form = template["variables"]["properties"]
    assert list(form) == ["env", "site", "nodes", "gpus_per_node", "cores_per_node", "mem", "time", "account", "qos",
                          "job_name", "sweep", "resume", "scheduler_options"]
    assert form["site"]["default"] == "lab-gpu" and "lab-gpu: 4." in form["gpus_per_node"]["description"]
    assert set(template["job_configuration"]) == set(form)
    assert all(value == "{{ " + key + " }}" for key, value in template["job_configuration"].items())


def test_prefect_finds_the_worker_type_through_its_entry_point() -> None:
    code = ("from prefect.workers.base import BaseWorker; "
            "print(BaseWorker.get_worker_class_from_type('hpc-garage').__module__)")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "hpc_garage.work_pool", done.stderr[-2000:]


# --------------------------------------------------------------------------------- SLURM + Prefect


@dataclass
class Garage:
    home: Path
    env: dict[str, str]
    api: str
    auth: str
    log: Path
    worker: subprocess.Popen[bytes] | None = None

    def start_worker(self) -> None:
        with self.log.open("ab") as out:
            self.worker = subprocess.Popen([PY, "-m", "hpc_garage", "worker", "--pool", POOL, "--site", "lab-gpu"],
                                           env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=self.home,
                                           start_new_session=True)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """hpc-garage's client: a busy server (two shared cores) answers 503 at times, and is asked again."""
        client = PrefectApi.from_env({"PREFECT_API_URL": self.api, "PREFECT_API_AUTH_STRING": self.auth}, timeout=30)
        assert client is not None
        return client.call(method, path, body)

    def run(self, parameters: dict[str, Any], job_variables: dict[str, Any] | None = None) -> str:
        deployment = self.call("GET", "/deployments/name/sweep/gpu")
        created = self.call("POST", f"/deployments/{deployment['id']}/create_flow_run",
                            {"parameters": parameters, "job_variables": job_variables or {}})
        return created["id"]

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        return self.call("GET", f"/flow_runs/{flow_run_id}")

    def wait(self, flow_run_id: str, until: Any, timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            run = self.flow_run(flow_run_id)
            if until(run):
                return run
            if time.monotonic() > deadline:
                raise AssertionError(f"flow run {flow_run_id}: {what} not within {timeout:.0f} s; it is "
                                     f"{run['state_type']} ({(run.get('state') or {}).get('message')}); "
                                     f"worker log:\n{self.log.read_text()[-3000:]}")
            time.sleep(1)

    def records(self, flow_run_id: str) -> list[dict[str, Any]]:
        """Every job hpc-garage submitted for this flow run (its submit.json), however many workers tried."""
        key = flow_run_id.replace("-", "")[:12]
        runs = self.home / ".hpc-garage" / "runs"
        found = [json.loads(p.read_text()) for p in runs.glob("*/submit.json")]
        return [r for r in found if r["job_name"].endswith(key)]

    def running(self, flow_run_id: str, timeout: float = 400) -> str:
        """Wait until the sweep's trials run (its job's workers are up and the flow has started); its job id."""
        run = self.wait(flow_run_id, lambda r: r["state_type"] == "RUNNING" and r["infrastructure_pid"], timeout,
                        "Running")
        job = run["infrastructure_pid"]
        state = self.home / ".hpc-garage" / "runs" / job / "state.json"
        deadline = time.monotonic() + 120
        while not (state.exists() and (json.loads(state.read_text()).get("progress") or {}).get("running")):
            assert time.monotonic() < deadline, f"job {job}: no trial running within 120 s"
            time.sleep(1)
        return job


def _queued(job: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    return bool(out) and out not in ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT")


@pytest.fixture(scope="module")
def garage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Garage]:
    """hpc-garage's Prefect server in a private HOME, `hpc-garage worker --pool test-gpus --site lab-gpu`, and
    the deployment sweep/gpu of examples/sweep.py (path-based: its directory is on the shared filesystem)."""
    home = tmp_path_factory.mktemp("pool-home")
    env = outside_job_env(("PREFECT",))
    env |= {"HOME": str(home), "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"}
    garage = Garage(home, env, "", "", home / "worker.log")
    garage.start_worker()
    deadline = time.monotonic() + 180
    while "started!" not in (garage.log.read_text() if garage.log.exists() else ""):
        assert garage.worker.poll() is None and time.monotonic() < deadline, garage.log.read_text()[-3000:]
        time.sleep(0.5)
    state = json.loads(next((home / ".hpc-garage" / "prefect").glob("*/server.json")).read_text())
    garage.api, garage.auth = state["url"], state["auth"]
    garage.env |= {"PREFECT_API_URL": garage.api, "PREFECT_API_AUTH_STRING": garage.auth}
    deploy = ("from prefect import flow; "
              f"flow.from_source(source={str(ROOT / 'examples')!r}, entrypoint='sweep.py:sweep').deploy("
              f"name='gpu', work_pool_name={POOL!r}, job_variables={{'nodes': 2}}, "
              "parameters={'gpu': 'yes', 'duration': 0.3})")
    done = subprocess.run([PY, "-c", deploy], env=garage.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    yield garage
    if garage.worker is not None and garage.worker.poll() is None:
        garage.worker.send_signal(signal.SIGINT)
        try:
            garage.worker.wait(30)
        except subprocess.TimeoutExpired:
            garage.worker.kill()
    for record in (home / ".hpc-garage" / "runs").glob("*/submit.json"):  # follow-up jobs too
        job = json.loads(record.read_text()).get("job_id")
        if job and _queued(job):
            subprocess.run(["scancel", job])
    subprocess.run([PY, "-m", "hpc_garage", "server", "stop", "--force"], env=env, capture_output=True)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_deployment_run_is_one_job_and_completes_with_every_gpu_trial_on_its_own_gpu(garage: Garage,
                                                                                       tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    done = subprocess.run(["prefect", "deployment", "run", "sweep/gpu", "-p", "seeds=4", "-p", f"out={out}"],
                          env=garage.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    flow_run_id = re.search(r"flow-run/([0-9a-f-]{36})", done.stdout).group(1)
    run = garage.wait(flow_run_id, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
                      600, "a final state")
    assert run["state_type"] == "COMPLETED", run["state"]
    (record,) = garage.records(flow_run_id)  # one job
    assert run["infrastructure_pid"] == record["job_id"]
    summary = json.loads(out.read_text())
    assert summary["experiments"] == 8 and summary["result"] == summary["expected"]
    by_gpu = check_placement(summary, gpus=True)
    assert len(by_gpu) == 8  # 2 nodes x 4 GPUs, one trial each
    deadline = time.monotonic() + 60  # the flow run is done; its job tears the cluster down and leaves
    while _queued(record["job_id"]) and time.monotonic() < deadline:
        time.sleep(1)
    status = subprocess.run([PY, "-m", "hpc_garage", "status", record["job_id"], "--json"], env=garage.env,
                            capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["summary"] == "done", status.stdout + status.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_cancel_through_the_api_cancels_the_job_and_the_flow_run_ends_cancelled(garage: Garage,
                                                                                 tmp_path: Path) -> None:
    """Prefect's cancel winds the job down as `hpc-garage cancel` does (issue 31): its trials are told to stop
    and get the site's checkpoint_grace (5 s here: these trials never checkpoint), then the job ends."""
    site = tmp_path / "lab-gpu-grace.yaml"
    site.write_text((ROOT / "site-configs" / "lab-gpu.yaml").read_text() + "checkpoint_grace: 5s\n")
    flow_run_id = garage.run({"seeds": 4, "duration": 120}, {"site": str(site), "nodes": 1, "gpus_per_node": 2})
    job = garage.running(flow_run_id)
    cancelled = time.monotonic()
    garage.call("POST", f"/flow_runs/{flow_run_id}/set_state",
                {"state": {"type": "CANCELLING", "message": "cancelled by the test"}, "force": True})
    while _queued(job):
        assert time.monotonic() - cancelled < 30, f"job {job} still queued 30 s after the cancel"
        time.sleep(1)
    run = garage.wait(flow_run_id, lambda r: r["state_type"] == "CANCELLED", 30, "Cancelled")
    assert run["state_type"] == "CANCELLED"
    ended = json.loads((garage.home / ".hpc-garage" / "runs" / job / "state.json").read_text())
    assert ended.get("cancelled") is True and ended.get("wind_down") in (  # the worker's signal, or `run` asked
        "cancelled (`hpc-garage cancel`)", "cancelled in Prefect"), ended
    assert ended.get("interrupted") == 2 and ended.get("next_job") is None, ended  # both running trials told
    time.sleep(3)
    left = subprocess.run(["pgrep", "-f", flow_run_id], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of the cancelled flow run are left: {left}"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_scancelled_from_a_shell_crashes_its_flow_run_naming_the_job(garage: Garage) -> None:
    flow_run_id = garage.run({"seeds": 4, "duration": 120}, {"nodes": 1, "gpus_per_node": 2})
    job = garage.running(flow_run_id)
    subprocess.run(["scancel", job], check=True)
    run = garage.wait(flow_run_id, lambda r: r["state_type"] == "CRASHED" and f"job {job}" in r["state"]["message"],
                      60, f"Crashed naming job {job}")
    assert run["state"]["message"].startswith(f"job {job} ended (CANCELLED")


@pytest.mark.slurm
@pytest.mark.slow
def test_a_worker_killed_and_restarted_submits_no_flow_run_twice(garage: Garage) -> None:
    runs = [garage.run({"seeds": 1, "lrs": [0.1], "duration": 0.3, "out": f"/dev/null"},
                       {"nodes": 1, "gpus_per_node": 1}) for _ in range(3)]
    deadline = time.monotonic() + 120
    while not any(garage.flow_run(r)["infrastructure_pid"] for r in runs):
        assert time.monotonic() < deadline, "no flow run submitted within 120 s"
        time.sleep(0.2)
    garage.worker.send_signal(signal.SIGKILL)
    garage.worker.wait(10)
    garage.start_worker()
    for flow_run_id in runs:
        run = garage.wait(flow_run_id, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
                          600, "a final state")
        assert run["state_type"] == "COMPLETED", run["state"]
    for flow_run_id in runs:
        jobs = [r["job_id"] for r in garage.records(flow_run_id)]
        assert len(jobs) == 1, f"flow run {flow_run_id} was submitted as jobs {jobs}"
        assert garage.flow_run(flow_run_id)["infrastructure_pid"] == jobs[0]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_bad_job_variable_fails_the_flow_run_at_once_in_one_line_and_submits_nothing(garage: Garage) -> None:
    flow_run_id = garage.run({"seeds": 1}, {"gpus_per_node": 99})
    run = garage.wait(flow_run_id, lambda r: r["state_type"] in ("FAILED", "CRASHED", "COMPLETED"), 30, "Failed")
    assert run["state_type"] == "FAILED"
    assert run["state"]["message"] == "hpc-garage: --gpus-per-node 99: a lab-gpu node has 4 GPUs; ask for 0 to 4"
    assert not garage.records(flow_run_id) and not run["infrastructure_pid"]
    assert not (garage.home / ".hpc-garage" / "runs" / "prefect-flow-runs" / f"{flow_run_id}.json").exists()


@pytest.mark.slurm
@pytest.mark.slow
def test_a_sweep_past_its_walltime_goes_on_in_a_follow_up_job_as_the_same_flow_run(garage: Garage,
                                                                                 tmp_path: Path) -> None:
    """`requeue: auto` and a 60 s walltime (winding down 15 s before) for about 50 s of trials on 4 GPUs: `run`
    winds down and submits a follow-up job; the worker follows the flow run into it; one flow run COMPLETED.
    A short checkpoint_grace (the trials never checkpoint): with the default 60 s, a 60 s job winds down
    half-way, and a loaded machine's follow-up job can end before it reaches a trial the sweep still lacks."""
    site = tmp_path / "lab-gpu-requeue.yaml"
    site.write_text((ROOT / "site-configs" / "lab-gpu.yaml").read_text()
                    + "requeue: auto\nwalltime_margin: 15s\ncheckpoint_grace: 5s\n")
    out = tmp_path / "sweep.json"
    flow_run_id = garage.run({"seeds": 20, "duration": 5, "out": str(out)},
                             {"site": str(site), "nodes": 2, "gpus_per_node": 2, "time": "1"})

    def ended(run: dict[str, Any]) -> bool:  # a job's engine leaves it Crashed until the worker moves it on
        return run["state_type"] in ("COMPLETED", "FAILED", "CANCELLED") or (
            run["state_type"] == "CRASHED" and (run["state"]["message"] or "").startswith("job "))

    run = garage.wait(flow_run_id, ended, 900, "a final state")
    jobs = sorted(garage.records(flow_run_id), key=lambda r: r["submitted"])
    assert run["state_type"] == "COMPLETED", (run["state"], [j["job_id"] for j in jobs])
    assert len(jobs) >= 2 and all(j.get("follows") == before["job_id"] for before, j in zip(jobs, jobs[1:])), jobs
    # the job that finished the sweep (a follow-up it had already submitted was cancelled, unstarted)
    assert run["infrastructure_pid"] in [j["job_id"] for j in jobs[1:]]
    summary = json.loads(out.read_text())
    assert summary["result"] == summary["expected"] and summary["experiments"] == 40
    history = garage.call("GET", f"/flow_run_states/?flow_run_id={flow_run_id}")
    continued = [s["message"] for s in history if s["type"] == "PENDING" and "continues in job" in (s["message"] or "")]
    assert continued, [(s["type"], s["message"]) for s in history]


@pytest.mark.slurm
@pytest.mark.slow
def test_a_job_of_a_flow_run_that_has_ended_runs_nothing(garage: Garage) -> None:
    """A stray job (a follow-up submitted at the walltime of a flow that finished anyway, a requeue after the
    end): Prefect's engine would run the Completed flow run again; the job's COMMAND runs nothing."""
    deployment = garage.call("GET", "/deployments/name/sweep/gpu")
    flow_run_id = garage.call("POST", f"/deployments/{deployment['id']}/create_flow_run",
                              {"state": {"type": "COMPLETED", "message": "done elsewhere"}})["id"]
    done = subprocess.run([PY, "-m", "hpc_garage.prefect.flow_run", flow_run_id], env=garage.env, cwd=ROOT / "examples",
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "is COMPLETED already: nothing to run" in done.stderr, done.stdout + done.stderr
    run = garage.flow_run(flow_run_id)
    assert run["state_type"] == "COMPLETED" and run["state"]["message"] == "done elsewhere"


@pytest.mark.slurm
@pytest.mark.slow
def test_the_pools_concurrency_limit_holds_while_jobs_queue_and_run(garage: Garage) -> None:
    """Limit 1: a flow run counts as Pending while its job queues and Running while it runs (Prefect's own
    limit then keeps the second flow run Scheduled); the second job is submitted only after the first."""
    garage.call("PATCH", f"/work_pools/{POOL}", {"concurrency_limit": 1})
    try:
        first, second = (garage.run({"seeds": 1, "lrs": [0.1], "duration": 3, "out": "/dev/null"},
                                    {"nodes": 1, "gpus_per_node": 1}) for _ in range(2))
        done = [garage.wait(r, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED"), 600, "final")
                for r in (first, second)]
        assert [d["state_type"] for d in done] == ["COMPLETED", "COMPLETED"]
        (job1,), (job2,) = garage.records(first), garage.records(second)
        runs = sorted((job1, job2), key=lambda r: r["submitted"])
        ended = json.loads((garage.home / ".hpc-garage" / "runs" / runs[0]["job_id"] / "state.json").read_text())
        assert runs[1]["submitted"] >= ended["updated"] - 5, "the second job was submitted while the first ran"
    finally:
        garage.call("PATCH", f"/work_pools/{POOL}", {"concurrency_limit": None})


@pytest.mark.slurm
@pytest.mark.slow
def test_run_once_submits_and_exits_and_a_later_call_settles_the_job(garage: Garage) -> None:
    """For sites that end long login-node processes: `hpc-garage worker --run-once` from cron or scrontab."""
    garage.worker.send_signal(signal.SIGINT)  # no long-running worker from here on
    garage.worker.wait(60)
    once = [PY, "-m", "hpc_garage", "worker", "--pool", POOL, "--run-once"]
    flow_run_id = garage.run({"seeds": 1, "lrs": [0.1], "duration": 60, "out": "/dev/null"},
                             {"nodes": 1, "gpus_per_node": 1})
    done = subprocess.run(once, env=garage.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "submitted job" in done.stdout + done.stderr, done.stdout + done.stderr
    (record,) = garage.records(flow_run_id)
    assert _queued(record["job_id"]) and garage.flow_run(flow_run_id)["infrastructure_pid"] == record["job_id"]
    subprocess.run(["scancel", record["job_id"]], check=True)
    deadline = time.monotonic() + 60
    while _queued(record["job_id"]) and time.monotonic() < deadline:
        time.sleep(1)
    again = subprocess.run(once, env=garage.env, capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    run = garage.flow_run(flow_run_id)
    assert run["state_type"] == "CRASHED" and run["state"]["message"].startswith(f"job {record['job_id']} ended")
    assert len(garage.records(flow_run_id)) == 1


@pytest.mark.slurm
@pytest.mark.slow
def test_a_worker_that_loses_its_own_api_keeps_its_job_and_catches_up(tmp_path: Path) -> None:
    """The user's own Prefect server (PREFECT_API_URL): it dies while the flow run's job waits in the queue
    (`--begin=now+60`) and comes back on the same address; the worker, alive throughout, follows the job to
    the flow run's end, and submitted it once."""
    from tests.test_prefect_faults import Server

    server = Server(tmp_path / "prefect-home")
    env = outside_job_env(("PREFECT",))
    env |= {"HOME": str(tmp_path), "PREFECT_API_URL": server.url, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    garage = Garage(tmp_path, env, server.url, "", tmp_path / "worker.log")
    try:
        garage.start_worker()
        deadline = time.monotonic() + 180
        while "started!" not in (garage.log.read_text() if garage.log.exists() else ""):
            assert garage.worker.poll() is None and time.monotonic() < deadline, garage.log.read_text()[-3000:]
            time.sleep(0.5)
        deploy = ("from prefect import flow; "
                  f"flow.from_source(source={str(ROOT / 'examples')!r}, entrypoint='sweep.py:sweep').deploy("
                  f"name='gpu', work_pool_name={POOL!r}, parameters={{'gpu': 'yes', 'duration': 0.3}})")
        done = subprocess.run([PY, "-c", deploy], env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        flow_run_id = garage.run({"seeds": 1, "lrs": [0.1], "out": "/dev/null"},
                                 {"nodes": 1, "gpus_per_node": 1, "scheduler_options": ["--begin=now+60"]})
        job = garage.wait(flow_run_id, lambda r: r["infrastructure_pid"], 120, "a job")["infrastructure_pid"]
        server.kill()
        time.sleep(20)  # the worker's calls fail; the job waits for its start time
        assert garage.worker.poll() is None, garage.log.read_text()[-3000:]
        server.start()
        run = garage.wait(flow_run_id, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED"), 400, "final")
        assert run["state_type"] == "COMPLETED", run["state"]
        assert [r["job_id"] for r in garage.records(flow_run_id)] == [job]
    finally:
        if garage.worker is not None and garage.worker.poll() is None:
            garage.worker.kill()
        server.kill()

