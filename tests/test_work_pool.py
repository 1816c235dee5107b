"""The `hpc-garage` work pool: deployment runs become one batch job each, followed to their end.

The fast tests check the job variables and the job script; the SLURM ones run the real thing: a managed
Prefect server, `hpc-garage worker`, a path-based deployment of examples/sweep.py, `prefect deployment run`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
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
from tests.slurm_jobs import job_logs, wait_gone

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
    assert "#SBATCH --job-name=train-7f2d1e4c9b10" in script  # the flow run's short id: found again by name
    # the random end of its id: a schedule's runs made at once have UUIDv7 ids whose first 12 digits agree
    from hpc_garage.schedulers.flow_run_jobs import FlowRunJob

    made_at_once = [FlowRunJob(i, "", {}, {}, "", "").key for i in ("01a21f0f-e886-7b58-b1bd-b16dc3bdc6e9",
                                                                      "01a21f0f-e886-7d44-bf70-7795d1e0afc4")]
    assert made_at_once == ["b16dc3bdc6e9", "bf707795d1e0afc4"[-12:]] and len(set(made_at_once)) == 2
    assert "export PREFECT_API_URL=http://127.0.0.1:1/api\n" in script
    # the auth string is not in the script (the batch system keeps scripts where its staff read them): the
    # script names the private file the worker writes it to, and `run` reads it (test_secrets_... below)
    assert "u:p" not in script and "PREFECT_API_AUTH_STRING" not in script
    secrets = prepared.root / "prefect-flow-runs" / f"{FLOW_RUN}.secrets.json"
    assert f"export HPC_GARAGE_SECRETS={secrets}\n" in script
    assert "UNSET" not in script
    assert prepared.spec.command[-3:] == ["-m", "prefect.engine", FLOW_RUN]


def test_the_flow_runs_secrets_reach_its_job_through_a_private_file_and_no_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The auth string goes to a 0600 file written before sbatch; sbatch sees a script without it and an
    environment without it (Slurm keeps both); the job's `run` reads the file into its environment, and a
    follow-up job's sbatch (from inside the job) hands on the file's name, not its values."""
    from hpc_garage.schedulers import flow_run_jobs, get
    from hpc_garage.schedulers.flow_run_jobs import prepare_flow_run, take
    from hpc_garage.schedulers.submission.submitting import _environ

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "u:p w'x")  # the worker's own: sbatch would pass it on
    job = _job(tmp_path, nodes=1)
    prepared = prepare_flow_run(job)
    secrets = flow_run_jobs.secrets_file(prepared.root, FLOW_RUN)
    seen: dict[str, Any] = {}

    def sbatch(self: Any, argv: list[str], *, env: dict[str, str] | None = None, **kw: Any) -> str:
        seen.update(script=Path(argv[-1]).read_text(), env=env, secrets=json.loads(secrets.read_text()),
                    mode=secrets.stat().st_mode & 0o777)
        return "77\n"

    monkeypatch.setattr(type(get("slurm")), "run", sbatch)
    taken = take(job, prepared)
    assert taken.job_id == "77" and seen["secrets"] == {"PREFECT_API_AUTH_STRING": "u:p w'x"} and seen["mode"] == 0o600
    assert "u:p" not in seen["script"] and f"export HPC_GARAGE_SECRETS={secrets}\n" in seen["script"]
    assert seen["env"] is not None and "PREFECT_API_AUTH_STRING" not in seen["env"]
    assert seen["env"]["HOME"] == str(tmp_path)  # the rest of the environment as sbatch passes it on
    from hpc_garage.rundir import RunRoot

    assert "u:p" not in RunRoot(prepared.root).run_dir("77").script_file.read_text()
    # inside the job: `run` reads the file (tests/test_cli.py), and its follow-up's sbatch gets no secret
    monkeypatch.setenv("HPC_GARAGE_SECRETS", str(secrets))
    followed = _environ(())
    assert followed is not None and "PREFECT_API_AUTH_STRING" not in followed
    assert followed["HPC_GARAGE_SECRETS"] == str(secrets)
    monkeypatch.delenv("HPC_GARAGE_SECRETS")
    assert _environ(()) is None  # `hpc-garage submit`: sbatch gets this environment as it is
    flow_run_jobs.drop_secrets(FLOW_RUN, [RunRoot(prepared.root)])  # the worker saw the flow run end
    assert not secrets.exists() and (secrets.parent / f"{FLOW_RUN}.json").exists()  # its claim stays


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
    from hpc_garage.rundir import RunRoot

    adopted = RunRoot(prepared.root).run_dir("42")
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
                          "job_name", "sweep", "resume", "container", "scheduler_options"]
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
        key = flow_run_id.replace("-", "")[-12:]
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
    # the auth string reached the job through a private file, which leaves once the worker saw the run end
    from hpc_garage.rundir import RunRoot
    from hpc_garage.schedulers.flow_run_jobs import secrets_file

    root = garage.home / ".hpc-garage" / "runs"
    secrets = secrets_file(root, flow_run_id)
    assert f"export HPC_GARAGE_SECRETS={secrets}\n" in RunRoot(root).run_dir(record["job_id"]).script_file.read_text()
    deadline = time.monotonic() + 30
    while secrets.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not secrets.exists(), f"{secrets} outlived its flow run"


@pytest.mark.slurm
@pytest.mark.slow
def test_a_deployment_run_with_the_container_job_variable_runs_its_flow_and_trials_inside_that_image(
        garage: Garage, tmp_path: Path) -> None:
    """Issue 33: a deployment whose job variables name a site with a container runtime and, in `container`, the
    image. Its flow (tests/data/container_sweep.py, which imports a package only the image has; Prefect deploys
    it from here as a placeholder) and every trial run inside that image, one GPU each, not in the site's own
    image (a decoy directory that holds no Python), and the flow run completes."""
    from tests.containers import build_image, check_inside, site_file

    image = build_image(tmp_path / "img")
    decoy = tmp_path / "decoy-image"
    decoy.mkdir()
    site = site_file(tmp_path, decoy, runs=False, scheduler="slurm", queue="gpu",
                     node="{cores: 8, memory: 15GiB, gpus: 4}", workers="{per: gpu, reserve_memory: 512MiB}",
                     interface="lo")
    variables = {"site": str(site), "container": str(image), "nodes": 1}
    deploy = ("from prefect import flow; "
              f"flow.from_source(source={str(tmp_path)!r}, entrypoint='container_sweep.py:sweep').deploy("
              f"name='in-image', work_pool_name={POOL!r}, job_variables={variables!r})")
    done = subprocess.run([PY, "-c", deploy], env=garage.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    deployment = garage.call("GET", "/deployments/name/sweep/in-image")["id"]
    out, marks, seeds = tmp_path / "out.json", tmp_path / "marks", 8
    try:
        flow_run_id = garage.call("POST", f"/deployments/{deployment}/create_flow_run", {
            "parameters": {"seeds": seeds, "out": str(out), "marks": str(marks)}})["id"]
        run = garage.wait(flow_run_id, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
                          600, "a final state")
        (record,) = garage.records(flow_run_id)  # one job
        assert run["state_type"] == "COMPLETED", (run["state"], job_logs(garage.home / ".hpc-garage" / "runs"))
        records = check_inside(out, seeds)
        assert all(r["cuda_visible_devices"] and "," not in r["cuda_visible_devices"] for r in records), records
        assert len({r["cuda_visible_devices"] for r in records}) == 4  # the node's four GPUs, one trial each at once
        assert sorted(int(x) for x in marks.read_text().split()) == list(range(seeds))  # each trial ran once
        from hpc_garage.rundir import RunRoot

        script = RunRoot(garage.home / ".hpc-garage" / "runs").run_dir(record["job_id"]).script_file.read_text()
        assert f" --container {shlex.quote(str(image))} " in script  # the job variable, not the site's image
    finally:
        garage.call("DELETE", f"/deployments/{deployment}")


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
    runs = [garage.run({"seeds": 1, "lrs": [0.1], "duration": duration, "out": f"/dev/null"},
                       {"nodes": 1, "gpus_per_node": 1}) for duration in (0.3, 45, 45)]
    deadline = time.monotonic() + 120
    while not all(garage.records(r) for r in runs) or not any(garage.flow_run(r)["infrastructure_pid"] for r in runs):
        assert time.monotonic() < deadline, "the flow runs were not all submitted within 120 s"
        time.sleep(0.2)
    for flow_run_id in runs[1:]:  # the long two: their jobs outlive the worker's restart
        garage.wait(flow_run_id, lambda r: r["state_type"] == "RUNNING" and r["infrastructure_pid"], 300, "Running")
    garage.worker.send_signal(signal.SIGKILL)
    garage.worker.wait(10)
    # as if the kill had landed between sbatch and the worker noting the job, the job already running the flow
    # (proof 18): its claim has no job id, Prefect has no pid; the next worker finds the job by its name
    claim = garage.home / ".hpc-garage" / "runs" / "prefect-flow-runs" / f"{runs[2]}.json"
    noted = json.loads(claim.read_text())
    claim.write_text(json.dumps({k: v for k, v in noted.items() if k not in ("job_id", "run_dir", "submitted")}
                                | {"pid": garage.worker.pid, "claimed": time.time() - 60}))
    garage.call("PATCH", f"/flow_runs/{runs[2]}", {"infrastructure_pid": None})
    # as if the kill had landed between those records and Prefect keeping the job as the run's infrastructure
    # pid (CI, proof 16): the next worker follows the job and keeps it there itself
    garage.call("PATCH", f"/flow_runs/{runs[1]}", {"infrastructure_pid": None})
    assert garage.flow_run(runs[1])["infrastructure_pid"] is None
    garage.start_worker()
    for flow_run_id in runs:
        run = garage.wait(flow_run_id, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
                          600, "a final state")
        assert run["state_type"] == "COMPLETED", run["state"]
    for flow_run_id in runs:
        jobs = [r["job_id"] for r in garage.records(flow_run_id)]
        assert len(jobs) == 1, f"flow run {flow_run_id} was submitted as jobs {jobs}"
        assert garage.flow_run(flow_run_id)["infrastructure_pid"] == jobs[0]
    assert json.loads(claim.read_text())["job_id"] == noted["job_id"]  # noted for the workers after it


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
    """`requeue: auto` and a 120 s walltime (winding down 15-20 s before) for about 120 s of trials on 4 GPUs:
    `run` winds down and submits a follow-up job; the worker follows the flow run into it; one flow run
    COMPLETED. A short checkpoint_grace (the trials never checkpoint): with the default 60 s, a job winds down
    half-way, and a loaded machine's follow-up job can end before it reaches a trial the sweep still lacks.
    The walltime is sized for a loaded machine (CI: 2 cores, load ~10-20), where starting a job took 49 s: a
    60 s walltime left no time for a trial, so every job wound down before its first and the chain never
    progressed; 120 s leaves ~50 s of trials per job under that load, and the sweep still outlasts one job
    on an idle machine."""
    site = tmp_path / "lab-gpu-requeue.yaml"
    site.write_text((ROOT / "site-configs" / "lab-gpu.yaml").read_text()
                    + "requeue: auto\nwalltime_margin: 15s\ncheckpoint_grace: 5s\n")
    out = tmp_path / "sweep.json"
    flow_run_id = garage.run({"seeds": 20, "duration": 12, "out": str(out)},
                             {"site": str(site), "nodes": 2, "gpus_per_node": 2, "time": "2"})

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
def test_a_deployments_job_handed_a_stale_scheduler_file_fails_its_flow_run_in_one_line_and_exits_2(
        garage: Garage, tmp_path: Path) -> None:
    """The job's COMMAND, Prefect's engine for the flow run, meets task_runner()'s refusal as it loads the flow:
    one line in the job's log (the engine's two tracebacks are not shown), exit 2, the flow run Failed with the
    line. (A flow run scheduled for 2099: the pool's worker leaves it alone.)"""
    dead = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / "scheduler.json"
    stale.write_text(json.dumps({"type": "Scheduler", "address": "tls://127.0.0.1:1", "hpc_garage": {
        "job_id": "123", "tls": None, "workers": [], "host": os.uname().nodename, "pid": int(dead.stdout)}}))
    deployment = garage.call("GET", "/deployments/name/sweep/gpu")
    flow_run_id = garage.call("POST", f"/deployments/{deployment['id']}/create_flow_run", {"state": {
        "type": "SCHEDULED", "state_details": {"scheduled_time": "2099-01-01T00:00:00Z"}}})["id"]
    done = subprocess.run([PY, "-m", "hpc_garage.prefect.flow_run", flow_run_id], cwd=ROOT / "examples",
                          env=garage.env | {"HPC_GARAGE_SCHEDULER_FILE": str(stale)}, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("hpc-garage: error:")]
    assert len(ours) == 1 and f"scheduler file {stale} is stale" in ours[0], done.stderr
    run = garage.flow_run(flow_run_id)
    assert run["state_type"] == "FAILED" and run["state"]["message"] == ours[0].replace("error: ", "", 1)


WORKER = ["-m", "hpc_garage", "worker", "--pool", POOL, "--site", "lab-gpu"]
SIGINT_BIT = 1 << (signal.SIGINT - 1)  # in /proc/PID/status's SigIgn mask


def _ignores_sigint(status: str) -> bool:
    return bool(int(re.search(r"^SigIgn:\s*([0-9a-f]+)", status, re.M).group(1), 16) & SIGINT_BIT)


def _start_worker(garage: Garage, how: str, log: Path) -> tuple[subprocess.Popen[str], int]:
    """A worker, started as scripts/test starts its shards (`&` in a non-interactive bash: SIGINT ignored) or by
    Popen (`python -m hpc_garage`) with SIGINT at Python's default; what to wait on, and the worker's pid."""
    if how == "bash &":  # the console script where there is one (a venv's bin/, pip's scripts directory)
        script = Path(PY).parent / "hpc-garage"
        command = [str(script), *WORKER[2:]] if script.is_file() else [PY, *WORKER]
        line = f"{shlex.join(command)} >>{shlex.quote(str(log))} 2>&1 & echo $!; wait $!"
        shell = subprocess.Popen(["bash", "-c", line], env=garage.env, cwd=garage.home, stdout=subprocess.PIPE,
                                 text=True, start_new_session=True)
        assert shell.stdout is not None
        return shell, int(shell.stdout.readline())
    default_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.argv[1], sys.argv[1:])")
    with log.open("a") as out:
        worker = subprocess.Popen([PY, "-c", default_sigint, PY, *WORKER], env=garage.env, cwd=garage.home,
                                  stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return worker, worker.pid


@pytest.mark.slurm
@pytest.mark.slow
def test_a_worker_ends_within_10_s_of_sigint_or_sigterm_however_started_and_its_job_goes_on(garage: Garage,
                                                                                          tmp_path: Path) -> None:
    """Issue 31: started with `&` from a script a process has SIGINT ignored, and the worker ran on for minutes
    after one. Started either way and following a job, each signal ends it within 10 s; the job goes on, and
    the next worker follows it (a scancel then crashes the flow run naming the job: only a follower says so)."""
    probe = subprocess.run(["bash", "-c", "cat /proc/self/status & wait"], capture_output=True, text=True)
    assert _ignores_sigint(probe.stdout)  # what `&` in a script does, which the worker has to overcome
    flow_run_id = garage.run({"seeds": 1, "lrs": [0.1], "duration": 900, "out": "/dev/null"},
                             {"nodes": 1, "gpus_per_node": 1})
    job = garage.wait(flow_run_id, lambda r: r["infrastructure_pid"], 120, "a job")["infrastructure_pid"]
    assert garage.worker is not None
    garage.worker.send_signal(signal.SIGTERM)  # the fixture's worker, which submitted the job
    assert garage.worker.wait(10) == 128 + signal.SIGTERM
    try:
        for i, (how, sig) in enumerate([("bash &", signal.SIGINT), ("bash &", signal.SIGTERM),
                                        ("Popen", signal.SIGINT), ("Popen", signal.SIGTERM)]):
            log = tmp_path / f"worker-{i}.log"
            proc, pid = _start_worker(garage, how, log)
            deadline = time.monotonic() + 180
            while f"follows job {job}" not in (log.read_text() if log.exists() else ""):
                assert proc.poll() is None and time.monotonic() < deadline, (how, log.read_text()[-3000:])
                time.sleep(0.5)
            assert _ignores_sigint(Path(f"/proc/{pid}/status").read_text()) is False  # taken, not ignored
            os.kill(pid, sig)
            try:
                code = proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"{how}: the worker still ran 10 s after {sig.name}:\n{log.read_text()[-3000:]}")
            assert code == 128 + sig, (how, sig.name, code, log.read_text()[-3000:])
            assert f"{sig.name}: the worker stops" in log.read_text()
            assert _queued(job), f"{how}, {sig.name}: job {job} ended with its worker"
        before = garage.log.read_text().count(f"follows job {job}")
        garage.start_worker()  # the fixture's again, for the tests after this one
        deadline = time.monotonic() + 180
        while garage.log.read_text().count(f"follows job {job}") == before:
            assert garage.worker.poll() is None and time.monotonic() < deadline, garage.log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        if garage.worker is None or garage.worker.poll() is not None:
            garage.start_worker()
    subprocess.run(["scancel", job], check=True)
    run = garage.wait(flow_run_id, lambda r: r["state_type"] == "CRASHED" and f"job {job}" in r["state"]["message"],
                      60, f"Crashed naming job {job}")
    assert run["state"]["message"].startswith(f"job {job} ended") and len(garage.records(flow_run_id)) == 1


@pytest.mark.slurm
@pytest.mark.slow
def test_the_pools_concurrency_limit_holds_while_jobs_queue_and_run(garage: Garage) -> None:
    """Limit 1: a flow run counts as Pending while its job queues and Running while it runs (Prefect's own
    limit then keeps the second flow run Scheduled); the second job is submitted only once the first flow run
    is final in Prefect's API (its end_time: Prefect frees the slot then, before `run`'s teardown ends the job)."""
    garage.call("PATCH", f"/work_pools/{POOL}", {"concurrency_limit": 1})
    try:
        first, second = (garage.run({"seeds": 1, "lrs": [0.1], "duration": 3, "out": "/dev/null"},
                                    {"nodes": 1, "gpus_per_node": 1}) for _ in range(2))
        done = [garage.wait(r, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED"), 600, "final")
                for r in (first, second)]
        assert [d["state_type"] for d in done] == ["COMPLETED", "COMPLETED"]
        (job1,), (job2,) = garage.records(first), garage.records(second)
        early, late = sorted(((job1, first), (job2, second)), key=lambda j: j[0]["submitted"])
        assert late[0]["submitted"] >= _ended_at(garage, early[1]) - 1, \
            "the second job was submitted while the first flow run ran"
    finally:
        garage.call("PATCH", f"/work_pools/{POOL}", {"concurrency_limit": None})


@pytest.mark.slurm
@pytest.mark.slow
def test_no_script_holds_the_apis_auth_string_and_the_jobs_still_reach_the_api(garage: Garage, tmp_path: Path) -> None:
    """With the managed server's auth string set: a deployment run, a `submit` and a `submit` on a jobqueue site
    (driver and worker jobs). Slurm's stored copy of each batch script (`scontrol write batch_script`, what
    its staff and accounting read), each job.sh, each temporary submit script caught while it lives, and every
    other file of the run root but the private ones hold no part of the secret; every flow still reports to
    the API (the deployment run is Completed by its job's engine, which had the secret from its 0600 file)."""
    import threading

    from tests.test_jobqueue_slurm import worker_jobs

    secret = garage.auth.split(":", 1)[1]
    assert len(secret) >= 16
    runs = garage.home / ".hpc-garage" / "runs"
    caught: dict[str, str] = {}
    private: dict[str, tuple[int, str]] = {}  # the flow run's secrets file, while it lives (mode, text)
    stop = threading.Event()

    def catch() -> None:  # the temporary scripts handed to sbatch live for a moment only
        while not stop.is_set():
            for temp in runs.glob(".submit-*.sh"):
                try:
                    caught[temp.name] = temp.read_text()
                except OSError:
                    pass
            for kept in runs.glob("prefect-flow-runs/*.secrets.json"):
                try:
                    private[kept.name] = (kept.stat().st_mode & 0o777, kept.read_text())
                except OSError:
                    pass
            time.sleep(0.005)

    watcher = threading.Thread(target=catch, daemon=True)
    watcher.start()
    try:
        flow_run_id = garage.run({"seeds": 1, "lrs": [0.1], "duration": 0.3, "out": "/dev/null"},
                                 {"nodes": 1, "gpus_per_node": 1})
        submitted = [subprocess.run([PY, "-m", "hpc_garage", "submit", "--site", site, "--wait",
                                     str(ROOT / "examples" / "sweep.py"), "--gpu", "yes", "--seeds", "1", "--lrs", "0.1",
                                     "--duration", "0.3", "--out", str(tmp_path / f"{site}.json")],
                                    capture_output=True, text=True, env=garage.env, cwd=tmp_path, timeout=420)
                     for site in ("lab-gpu", "lab-jobqueue")]
        run = garage.wait(flow_run_id, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"),
                          600, "a final state")
    finally:
        stop.set()
        watcher.join()
    assert run["state_type"] == "COMPLETED", run["state"]
    jobs = [record["job_id"] for record in garage.records(flow_run_id)]
    for done in submitted:
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        jobs.append(re.search(r"submitted job (\S+)", done.stdout).group(1))  # type: ignore[union-attr]
    workers = [j["job_id"] for j in worker_jobs(runs / jobs[-1])["jobs"]]
    assert workers and len(jobs) == 3
    for job in jobs + workers:
        stored = subprocess.run(["scontrol", "write", "batch_script", job, "-"], capture_output=True, text=True,
                                timeout=30)
        assert stored.returncode == 0 and "#!" in stored.stdout, (job, stored.stderr)
        assert secret not in stored.stdout, f"job {job}'s batch script holds the auth string"
        if job in jobs:  # the script sbatch got is the job.sh hpc-garage keeps
            assert stored.stdout == (runs / job / "job.sh").read_text()
    assert "HPC_GARAGE_SECRETS=" in (runs / jobs[0] / "job.sh").read_text()
    assert all(secret not in text for text in caught.values()), sorted(caught)
    public = [p for p in garage.home.rglob("*") if p.is_file() and p.stat().st_mode & 0o077]
    assert not [p for p in public if secret in p.read_text(errors="replace")]
    mode, text = private[f"{flow_run_id}.secrets.json"]  # while the flow run's job ran
    assert oct(mode) == "0o600" and json.loads(text)["PREFECT_API_AUTH_STRING"] == garage.auth
    secrets = runs / "prefect-flow-runs" / f"{flow_run_id}.secrets.json"
    deadline = time.monotonic() + 30  # gone once the worker saw the flow run end
    while secrets.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not secrets.exists(), f"{secrets} outlived its flow run"


def _deploy(garage: Garage, name: str, **options: Any) -> str:
    """Another deployment of examples/sweep.py on the pool (one GPU, a short sweep), with Prefect's own
    deploy() options; its id."""
    deploy = ("from prefect import flow; "
              f"flow.from_source(source={str(ROOT / 'examples')!r}, entrypoint='sweep.py:sweep').deploy("
              f"name={name!r}, work_pool_name={POOL!r}, job_variables={{'nodes': 1, 'gpus_per_node': 1}}, "
              "parameters={'gpu': 'yes', 'seeds': 1, 'lrs': [0.1], 'duration': 3, 'out': '/dev/null'}, "
              + ", ".join(f"{k}={v}" for k, v in options.items()) + ")")
    done = subprocess.run([PY, "-c", deploy], env=garage.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return garage.call("GET", f"/deployments/name/sweep/{name}")["id"]


def _ended_at(garage: Garage, flow_run_id: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(garage.flow_run(flow_run_id)["end_time"].replace("Z", "+00:00")).timestamp()


@pytest.mark.slurm
@pytest.mark.slow
def test_a_deployments_concurrency_limit_keeps_its_second_run_waiting_until_the_first_ends(garage: Garage) -> None:
    """`concurrency_limit=1` on the deployment (Prefect's own): of two runs made at once, the second waits
    (AwaitingConcurrencySlot) and its job is submitted only once the first flow run has ended."""
    deployment = _deploy(garage, "limited", concurrency_limit=1)
    try:
        first, second = (garage.call("POST", f"/deployments/{deployment}/create_flow_run", {})["id"]
                         for _ in range(2))
        done = [garage.wait(r, lambda r: r["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"), 600,
                            "a final state") for r in (first, second)]
        assert [d["state_type"] for d in done] == ["COMPLETED", "COMPLETED"], [d["state"] for d in done]
        (job1,), (job2,) = garage.records(first), garage.records(second)
        early, late = sorted(((job1, first), (job2, second)), key=lambda j: j[0]["submitted"])
        assert late[0]["submitted"] >= _ended_at(garage, early[1]) - 1, "the second job was submitted while the first ran"
        history = garage.call("GET", f"/flow_run_states/?flow_run_id={late[1]}")
        assert "AwaitingConcurrencySlot" in [h["name"] for h in history], [(h["type"], h["name"]) for h in history]
    finally:
        garage.call("DELETE", f"/deployments/{deployment}")


@pytest.mark.slurm
@pytest.mark.slow
def test_an_interval_schedule_fires_and_its_runs_become_jobs_that_complete(garage: Garage) -> None:
    """A 1-minute interval schedule: Prefect's scheduler (in hpc-garage's server, which the schedule and the
    worker hold: the same server throughout) makes its runs; the worker submits each as a job; two complete."""
    status = [PY, "-m", "hpc_garage", "server", "status"]
    before = json.loads(subprocess.run(status, env=garage.env, capture_output=True, text=True, timeout=60).stdout)
    deployment = _deploy(garage, "every-minute", interval=60)
    try:
        deadline = time.monotonic() + 420
        while True:
            runs = garage.call("POST", "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment]}}})
            completed = [r for r in runs if r["state_type"] == "COMPLETED"]
            if len(completed) >= 2:
                break
            assert time.monotonic() < deadline, [(r["state_type"], r["expected_start_time"]) for r in runs]
            assert not [r for r in runs if r["state_type"] in ("FAILED", "CRASHED")], [r["state"] for r in runs]
            time.sleep(5)
        starts = sorted(r["expected_start_time"] for r in completed)
        assert len(set(starts)) == len(starts) and all(r["auto_scheduled"] for r in completed)
        for run in completed:
            (record,) = garage.records(run["id"])  # one job each, as a Run-button run gets
            assert run["infrastructure_pid"] == record["job_id"]
    finally:
        garage.call("DELETE", f"/deployments/{deployment}")
    after = json.loads(subprocess.run(status, env=garage.env, capture_output=True, text=True, timeout=60).stdout)
    assert after["pid"] == before["pid"] and after["url"] == before["url"], (before, after)


@pytest.mark.slurm
@pytest.mark.slow
def test_run_once_submits_and_exits_and_a_later_call_settles_the_job(garage: Garage) -> None:
    """For sites that end long login-node processes: `hpc-garage worker --run-once` from cron or scrontab."""
    garage.worker.send_signal(signal.SIGINT)  # no long-running worker from here on
    garage.worker.wait(60)
    once = [PY, "-m", "hpc_garage", "worker", "--pool", POOL, "--run-once"]
    # the job waits in the queue until it is cancelled: one that had started its flow run would be ended by
    # Prefect's own engine on scancel's SIGTERM (Crashed, "aborted by a termination signal"), leaving nothing to
    # settle (seen once under load, when the job started before the scancel)
    flow_run_id = garage.run({"seeds": 1, "lrs": [0.1], "duration": 60, "out": "/dev/null"},
                             {"nodes": 1, "gpus_per_node": 1, "scheduler_options": ["--begin=now+600"]})
    done = subprocess.run(once, env=garage.env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "submitted job" in done.stdout + done.stderr, done.stdout + done.stderr
    (record,) = garage.records(flow_run_id)
    state = subprocess.run(["squeue", "-h", "-j", record["job_id"], "-o", "%T"], capture_output=True, text=True)
    assert state.stdout.strip() == "PENDING" and garage.flow_run(flow_run_id)["infrastructure_pid"] == record["job_id"]
    subprocess.run(["scancel", record["job_id"]], check=True)
    wait_gone(record["job_id"], 240)  # COMPLETING too: the later call settles a job that has ended, not one ending
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
