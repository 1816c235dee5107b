"""(issue 22) A deployment run on an `hpc-garage` work pool against `hpc-garage submit` of the same sweep:
request -> job submitted, and request -> first task started, on the local SLURM (1 node x 4 GPU workers).

    python -m bench.deployment --runs 5 --poll 5 --out deployment.json

Deployment: `hpc-garage worker --pool bench-gpus --site lab-gpu` runs throughout (PREFECT_WORKER_QUERY_SECONDS
= --poll); the request is the API call that creates the flow run (what `prefect deployment run` and the
Run button do), its "submitted" the job's submit.json (written as sbatch returns), its first task the
earliest trial start the sweep records (examples/sweep.py, 4 trials of 0.1 s, `--gpu yes`). `submit`: the
command `hpc-garage submit --site lab-gpu examples/sweep.py ...` from its start, the same figures. Both run
on one running Prefect API (hpc-garage's server); each job is ended (SIGKILL) once its sample is on disk,
and the bench waits for free nodes before each contender. Goals (issue 22): submission within the poll
interval + 2 s; first task within 1.1x `submit`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (BIN, PYTHON, ROOT, Figure, Jobs, compare, outside_job_env, ratio_to_best,
                          read_json_when_ready, say, scratch, wait_for_free_nodes)

POOL = "bench-gpus"
SWEEP = ROOT / "examples" / "sweep.py"
PARAMETERS = {"seeds": 2, "lrs": [0.1, 0.01], "duration": 0.1, "gpu": "yes"}
ARGS = ["--seeds", "2", "--lrs", "0.1,0.01", "--duration", "0.1", "--gpu", "yes"]
DEPLOYMENT = "deployment run on an hpc-garage work pool (hpc-garage worker)"
SUBMIT = "hpc-garage submit"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--poll", type=float, default=5.0, help="the worker's PREFECT_WORKER_QUERY_SECONDS")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    Path(args.out).write_text(json.dumps({"figures": [f.to_dict() for f in measure(args.runs, args.poll)]},
                                         indent=2))
    return 0


def measure(runs: int, poll: float) -> list[Figure]:
    from hpc_garage.prefect.server import ensure_api
    from hpc_garage.prefect_api import PrefectApi

    env = outside_job_env(also=("PREFECT_",))
    api_env = ensure_api()  # one running API for both, as a site would have
    env |= api_env | {"PREFECT_WORKER_QUERY_SECONDS": f"{poll:g}"}
    api = PrefectApi.from_env(api_env, timeout=30)
    assert api is not None
    home = scratch("deployment-")
    jobs = Jobs()
    worker = _worker(env, home)
    samples: dict[str, list[dict[str, float]]] = {DEPLOYMENT: [], SUBMIT: []}
    directories = [home]  # removed once the worker and the jobs are gone
    try:
        deployment = _deploy(env, api)
        for i in range(runs):
            for name, run in ((DEPLOYMENT, lambda d: _deployment_run(d, api, deployment, jobs)),
                              (SUBMIT, lambda d: _submit(d, env, jobs))):
                wait_for_free_nodes()
                directories.append(scratch("deployment-run-"))
                sample = run(directories[-1])
                samples[name].append(sample)
                say(f"deployment run {i + 1}/{runs}: {name}: submitted {sample['submitted']:.1f} s, first task "
                    f"{sample['first_task']:.1f} s after the request")
    finally:
        worker.send_signal(signal.SIGINT)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            worker.kill()
        jobs.cancel()
        for directory in directories:
            shutil.rmtree(directory, ignore_errors=True)
    figures = []
    shape = "1 node x 4 GPU workers, 4 trials"
    for key, what, goal, check in (
            ("submitted", "request -> job submitted", f"<= poll interval + 2 s ({poll + 2:g} s)",
             lambda ours, peers: ours.median <= poll + 2),
            ("first_task", "request -> first task started", "<= 1.1x hpc-garage submit",
             lambda ours, peers: ratio_to_best(ours, peers) <= 1.1)):
        group = f"deployment run vs submit, {shape}: {what} (worker poll {poll:g} s)"
        block = [Figure(group, DEPLOYMENT, "s", [s[key] for s in samples[DEPLOYMENT]], ours=True),
                 Figure(group, SUBMIT, "s", [s[key] for s in samples[SUBMIT]])]
        compare(block, goal, check)
        figures += block
    return figures


def _worker(env: dict[str, str], home: Path) -> subprocess.Popen[bytes]:
    with open(home / "worker.log", "wb") as log:
        worker = subprocess.Popen([str(BIN / "hpc-garage"), "worker", "--pool", POOL, "--site", "lab-gpu"], env=env,
                                  cwd=home, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while "started!" not in (home / "worker.log").read_text():
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"hpc-garage worker: {(home / 'worker.log').read_text()[-500:]}")
        time.sleep(0.2)
    return worker


def _deploy(env: dict[str, str], api: Any) -> str:
    code = ("from prefect import flow; "
            f"flow.from_source(source={str(SWEEP.parent)!r}, entrypoint='sweep.py:sweep').deploy("
            f"name='bench', work_pool_name={POOL!r}, job_variables={{'nodes': 1}}, parameters={PARAMETERS!r})")
    done = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"deploying the sweep: {done.stderr[-500:]}")
    return str(api.get("/deployments/name/sweep/bench")["id"])


def _deployment_run(directory: Path, api: Any, deployment: str, jobs: Jobs) -> dict[str, float]:
    out = directory / "sweep.json"
    requested = time.time()
    flow_run = _retried(api.post, f"/deployments/{deployment}/create_flow_run", {"parameters": {"out": str(out)}})["id"]
    job = ""
    deadline = time.monotonic() + 120
    while not job:
        if time.monotonic() > deadline:
            raise RuntimeError(f"flow run {flow_run}: no job within 120 s")
        time.sleep(0.1)
        job = _retried(api.get, f"/flow_runs/{flow_run}").get("infrastructure_pid") or ""
    jobs.ids.append(job)
    return _sample(out, job, jobs, requested)


def _retried(call: Any, *args: Any) -> Any:
    """A call to the API, again after a 503 (SQLite busy: the server asks the client to retry, as Prefect's does)."""
    from hpc_garage.prefect_api import ApiError

    for attempt in range(6):
        try:
            return call(*args)
        except ApiError as exc:
            if exc.status != 503 or attempt == 5:
                raise
            time.sleep(0.5 * (attempt + 1))


def _submit(directory: Path, env: dict[str, str], jobs: Jobs) -> dict[str, float]:
    out = directory / "sweep.json"
    requested = time.time()
    done = subprocess.run([str(BIN / "hpc-garage"), "submit", "--site", "lab-gpu", "--nodes", "1", str(SWEEP), *ARGS,
                           "--out", str(out)], env=env, cwd=directory, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"hpc-garage submit: {done.stderr.strip()[-300:]}")
    return _sample(out, jobs.adopt(done.stdout), jobs, requested)


def _sample(out: Path, job: str, jobs: Jobs, requested: float) -> dict[str, float]:
    from hpc_garage.schedulers.submission import find

    submitted = float((find(job).record or {})["submitted"])
    result = read_json_when_ready(out, 300, alive=lambda: Jobs.queued(job))
    jobs.end(job)
    return {"submitted": submitted - requested, "first_task": min(r["start"] for r in result["records"]) - requested}


if __name__ == "__main__":
    sys.exit(main())
