"""(2) Start-up: job running -> all workers registered, and submit -> first task started, on the local SLURM
(1 and 2 nodes x 4 workers); and the login-node path, `hpc-garage run -- python sweep.py` -> first task.

    python -m bench.startup --runs 5 --nodes 1,2 --out startup.json [--skip-login]

SLURM contenders, each a user's whole path from submitting to a first Prefect task:
- hpc-garage's mpi launcher: `hpc-garage submit --site lab-gpu` (the site plus one set-up line that stamps
  the job's start); `run` starts the scheduler, one rank per GPU and the flow (first_task.py); its workers
  count as registered when `run` publishes the scheduler file (its mtime), the peers' when
  `client.wait_for_workers` returns.
- the same inside a container (issue 33): the site with a `container:` block, Charliecloud's `ch-run` and the
  image scripts/container-image builds (this host's Python and the project's wheel); `run`, the flow and every
  worker run inside it. Its ratio to the row without a container is beside its ratios to the peers.
- hpc-garage's dask-mpi mode: the same with `mpi: {launch: dask-mpi}` (site lab-gpu-dask-mpi): one MPI rank
  per worker (`srun --mpi=pmix`), each running dask-mpi's worker side against `run`'s scheduler.
- dask-mpi written by hand: `mpirun dask-mpi --scheduler-file ...` (scheduler on rank 0) plus the user's
  client script, `Client(scheduler_file=...)` + prefect-dask (peer_driver.py), in one batch script.
- dask-jobqueue's SLURMRunner under plain srun (slurmrunner_driver.py).
- dask-jobqueue's SLURMCluster from the login node, one job per node, 4 worker processes each.
Every peer gets the same running Prefect API (else each worker starts its own server, ~20 s): the
comparison is of the clusters, not of Prefect set-up. Peers' client scripts import Prefect while their
workers start. Each run's sample is written by its first task as it starts; the bench then kills the job
(SIGKILL) rather than wait for its flow and teardown, which no figure includes. `phases` in the output (and
the report's Details) say where the wall time went: waiting for free nodes, submit -> sample, ending jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import (BENCH_TMP, BIN, PYTHON, ROOT, SCRIPTS, Figure, Jobs, Phases, compare, ratio_to_best,
                          read_json_when_ready, say, scratch, wait_for_free_nodes)

OURS = "hpc-garage mpi launcher (hpc-garage submit)"
OURS_DASK_MPI = "hpc-garage dask-mpi mode, mpi: {launch: dask-mpi} (hpc-garage submit)"
OURS_CONTAINER = "hpc-garage mpi launcher inside a Charliecloud image (hpc-garage submit, site container:)"
DASK_MPI = "dask-mpi CLI + Client(scheduler_file) by hand"
RUNNER = "dask-jobqueue SLURMRunner under srun"
CLUSTER = "dask-jobqueue SLURMCluster, one job per node"
LOGIN_OURS = "hpc-garage run -- python sweep.py"
LOGIN_PLAIN = "@flow(task_runner=DaskTaskRunner()), no Prefect server configured"
SITE = "bench-lab-gpu"
SITE_DASK_MPI = "bench-lab-gpu-dask-mpi"
SITE_CONTAINER = "bench-lab-gpu-container"
WITHOUT_CONTAINER = "the same without a container"
WORKERS_PER_NODE = 4
PHASES = Phases()  # where the wall time goes: waiting for nodes, submit -> sample, ending the job, login runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--nodes", default="1,2")
    parser.add_argument("--skip-login", action="store_true")
    parser.add_argument("--skip-slurm", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    figures: list[Figure] = []
    jobs = Jobs()
    try:
        if not args.skip_slurm:
            for nodes in (int(x) for x in args.nodes.split(",")):
                figures += slurm_startup(nodes, args.runs, jobs)
        if not args.skip_login:
            figures += login_startup(args.runs)
    finally:
        jobs.cancel()
    Path(args.out).write_text(json.dumps({"figures": [f.to_dict() for f in figures], "phases": PHASES.to_dict()},
                                         indent=2))
    return 0


# -------------------------------------------------------------------------------------------- SLURM


def slurm_startup(nodes: int, runs: int, jobs: Jobs) -> list[Figure]:
    from hpc_garage.prefect.server import ensure_api

    api = ensure_api()  # one running API for everyone, as a site would have
    sites = scratch("sites-")
    lab = (ROOT / "site-configs" / "lab-gpu.yaml").read_text()
    stamp = '\nsetup:\n  - date +%s.%N > "$HPC_GARAGE_BENCH_DIR/job_start"\n'
    (sites / f"{SITE}.yaml").write_text(lab + stamp)
    (sites / f"{SITE_DASK_MPI}.yaml").write_text((ROOT / "site-configs" / "lab-gpu-dask-mpi.yaml").read_text() + stamp)
    env = {**os.environ, **api, "HPC_GARAGE_SITES_PATH": str(sites)}
    contenders: dict[str, Callable[[Path], dict[str, float]]] = {
        OURS: lambda d: _hpc_garage(d, nodes, env, jobs),
        OURS_DASK_MPI: lambda d: _hpc_garage(d, nodes, env, jobs, site=SITE_DASK_MPI),
    }
    image = _container_image(sites)  # issue 33: the same submit, every process inside an image
    if image is not None:
        container = (f"container: {{runtime: charliecloud, image: {image}, python: /opt/python/bin/python3, "
                     "gpus: none, binds: [/run/munge]}\n")  # srun inside the image authenticates through munged
        (sites / f"{SITE_CONTAINER}.yaml").write_text(lab + stamp + container)
        contenders[OURS_CONTAINER] = lambda d: _hpc_garage(d, nodes, env, jobs, site=SITE_CONTAINER)
    contenders |= {
        DASK_MPI: lambda d: _dask_mpi(d, nodes, env, jobs),
        RUNNER: lambda d: _slurm_runner(d, nodes, env, jobs),
        CLUSTER: lambda d: _slurm_cluster(d, nodes, env, jobs),
    }
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
    failures: dict[str, str] = {}
    for i in range(runs):
        for name, run in contenders.items():
            if name in failures:
                continue
            before = dict(PHASES.seconds)
            with PHASES("waiting for free nodes"):
                wait_for_free_nodes()
            directory = scratch("startup-")
            try:
                sample = run(directory)
            except Exception as exc:  # noqa: BLE001 - a peer that fails here is reported, not fatal
                failures[name] = f"{type(exc).__name__}: {exc}"[:300]
                say(f"start-up {nodes} node(s): {name} failed: {failures[name]}")
                continue
            samples[name].append(sample)
            shutil.rmtree(directory, ignore_errors=True)
            say(f"start-up {nodes} node(s) run {i + 1}/{runs}: {name}: registered {sample['registered']:.1f} s "
                f"after the job started, first task {sample['first_task']:.1f} s after submit "
                f"({PHASES.since(before)})")
    shutil.rmtree(sites, ignore_errors=True)
    shape = f"{nodes} node{'s' if nodes > 1 else ''} x {WORKERS_PER_NODE} workers"
    figures = []
    for key, what in (("registered", "job running -> all workers registered"),
                      ("first_task", "submit -> first task started")):
        group = f"start-up, {shape}: {what}"
        block = [Figure(group, name, "s", [s[key] for s in samples[name]],
                        ours=name in (OURS, OURS_DASK_MPI, OURS_CONTAINER),
                        note=failures.get(name, "")) for name in contenders]
        compare(block, "<= 0.8x the best peer", lambda ours, peers: ratio_to_best(ours, peers) <= 0.8)
        plain, inside = (next((f for f in block if f.label == label), None) for label in (OURS, OURS_CONTAINER))
        if plain is not None and inside is not None and plain.median and inside.median is not None:
            inside.ratios[WITHOUT_CONTAINER] = inside.median / plain.median
        figures += block
    return figures


def _container_image(sites: Path) -> Path | None:
    """The container tests' image (scripts/container-image: this host's Python and the project's wheel in a
    Charliecloud directory image), built once per run; None, and said, where Charliecloud is missing."""
    if shutil.which("ch-run") is None:
        say("start-up: no ch-run here: the row inside a container is not measured (apt-get install charliecloud)")
        return None
    image = sites / "image"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "container-image"), str(image)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": PYTHON})
    if done.returncode != 0:
        raise RuntimeError(f"scripts/container-image: {done.stderr.strip()[-300:]}")
    return image


def _hpc_garage(directory: Path, nodes: int, env: dict[str, str], jobs: Jobs, site: str = SITE) -> dict[str, float]:
    out = directory / "out.json"
    run_env = {**env, "HPC_GARAGE_BENCH_DIR": str(directory)}
    script = directory / "first_task.py"  # in the working directory, which a container binds (the checkout not)
    shutil.copy(SCRIPTS / "first_task.py", script)
    submitted = time.time()
    with PHASES("submit -> sample"):
        done = subprocess.run([str(BIN / "hpc-garage"), "submit", "--site", site, "--nodes", str(nodes),
                               str(script), str(out)], env=run_env, cwd=directory,
                              capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"hpc-garage submit: {done.stderr.strip()[-300:]}")
    job = jobs.adopt(done.stdout + done.stderr)
    return _finish(directory, job, jobs, submitted)


def _batch_script(directory: Path, nodes: int, tasks_per_node: int, body: str) -> Path:
    script = directory / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --job-name=bench-peer
#SBATCH --partition=gpu
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={tasks_per_node}
#SBATCH --cpus-per-task=1
#SBATCH --gres=gpu:4
#SBATCH --mem=15000M
#SBATCH --time=00:10:00
#SBATCH --output={directory}/slurm-%j.out
date +%s.%N > {directory}/job_start
{body}
""")
    return script


def _dask_mpi(directory: Path, nodes: int, env: dict[str, str], jobs: Jobs) -> dict[str, float]:
    workers = WORKERS_PER_NODE * nodes
    scheduler_file = directory / "scheduler.json"
    body = f"""export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl=tcp,self
mpirun -n {workers + 1} {BIN / 'dask-mpi'} --scheduler-file {scheduler_file} --scheduler-port 0 --interface lo \\
  --nthreads 2 --memory-limit 3.5GB --worker-options '{{"resources": {{"GPU": 1}}}}' --no-dashboard &
{PYTHON} {SCRIPTS / 'peer_driver.py'} --scheduler-file {scheduler_file} --workers {workers} --out {directory}/out.json
wait
"""
    script = _batch_script(directory, nodes, WORKERS_PER_NODE + 1, body)
    submitted = time.time()
    job = jobs.sbatch(script, env=env)
    return _finish(directory, job, jobs, submitted)


def _slurm_runner(directory: Path, nodes: int, env: dict[str, str], jobs: Jobs) -> dict[str, float]:
    workers = WORKERS_PER_NODE * nodes
    per_node = -(-(workers + 2) // nodes)
    body = f"srun -n {workers + 2} {PYTHON} {SCRIPTS / 'slurmrunner_driver.py'} {directory}\n"
    script = _batch_script(directory, nodes, per_node, body)
    submitted = time.time()
    job = jobs.sbatch(script, env=env)
    return _finish(directory, job, jobs, submitted)


def _slurm_cluster(directory: Path, nodes: int, env: dict[str, str], jobs: Jobs) -> dict[str, float]:
    """The driver runs here (a login node's client); once its first task has written the sample, the driver
    and its worker jobs are ended like the other contenders' jobs, not left to close themselves."""
    workers = WORKERS_PER_NODE * nodes
    out = directory / "out.json"
    name = f"bench-{directory.name}"
    with PHASES("submit -> sample"):
        driver = _started([PYTHON, str(SCRIPTS / "peer_driver.py"), "--jobqueue", str(nodes), "--workers",
                           str(workers), "--out", str(out), "--job-start-dir", str(directory), "--job-name", name],
                          env=env, cwd=directory)
        try:
            result = read_json_when_ready(out, 240, alive=lambda: driver.poll() is None)
        except TimeoutError:
            raise RuntimeError(f"SLURMCluster driver exited {driver.poll()}: {_tail(driver, directory)[-300:]}") from None
    with PHASES("ending the job"):
        ids = _named_jobs(name)
        jobs.ids += ids
        _stop(driver)
        for job in ids:
            jobs.end(job)
    return _sample(directory, result, result["submitted"])


def _finish(directory: Path, job: str, jobs: Jobs, submitted: float) -> dict[str, float]:
    """Wait for the sample the job's first task writes, then end the job at once (nobody measures its end)."""
    with PHASES("submit -> sample"):
        result = read_json_when_ready(directory / "out.json", 180, alive=lambda: Jobs.queued(job))
    with PHASES("ending the job"):
        jobs.end(job)
    return _sample(directory, result, submitted)


def _sample(directory: Path, result: dict[str, float], submitted: float) -> dict[str, float]:
    starts = [float(x) for x in (directory / "job_start").read_text().split()]
    return {"registered": result["registered"] - min(starts), "first_task": result["first_task"] - submitted}


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End a process we started (in its own session) and everything still in that session, now."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _named_jobs(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True).stdout
    return out.split()




# --------------------------------------------------------------------------------------- login node


def login_startup(runs: int) -> list[Figure]:
    """The same trivial sweep from a login node: hpc-garage's run vs prefect-dask with no API configured.

    Each command is ended as soon as its sample is on disk (hpc-garage: the sweep's results file; plain: the
    file each task writes as it starts): the flows' and clusters' ends are not measured, so not waited for.
    """
    plain_home = BENCH_TMP / "plain-prefect-home"
    plain_home.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HPC_GARAGE_"))}
    quiet = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    ours, plain = [], []
    for i in range(runs):
        directory = scratch("login-")
        out = directory / "sweep.json"
        with PHASES("login: hpc-garage run"):
            start = time.time()
            process = _started([str(BIN / "hpc-garage"), "run", "--", PYTHON, str(ROOT / "examples" / "sweep.py"),
                                      "--seeds", "2", "--lrs", "0.1", "--duration", "0.1", "--out", str(out)],
                                     env={**base, **quiet}, cwd=directory)
            try:
                result = read_json_when_ready(out, 300, alive=lambda: process.poll() is None)
                ours.append(min(r["start"] for r in result["records"]) - start)
            except TimeoutError:
                say(f"login node: hpc-garage run failed: {_tail(process, directory)}")
            _interrupt(process)  # `run` passes it to the sweep, already done, and tears its cluster down
        prefix = directory / "plain"
        with PHASES("login: plain prefect-dask"):
            start = time.time()
            process = _started([PYTHON, str(SCRIPTS / "plain_login.py"), str(prefix)], cwd=directory,
                                     env={**base, **quiet, "PREFECT_HOME": str(plain_home)})
            try:
                starts = [read_json_when_ready(Path(f"{prefix}.{seed}.json"), 300,
                                               alive=lambda: process.poll() is None)["start"] for seed in (0, 1)]
                plain.append(min(starts) - start)
            except TimeoutError:
                say(f"login node: plain prefect-dask failed: {_tail(process, directory)}")
            _stop(process)  # the flow's end and the temporary servers' shutdown are not measured
        shutil.rmtree(directory, ignore_errors=True)
        say(f"login node run {i + 1}/{runs}: hpc-garage {ours[-1] if ours else float('nan'):.1f} s, "
            f"plain {plain[-1] if plain else float('nan'):.1f} s to the first task")
    group = "start-up, login node: command start -> first task started"
    figures = [Figure(group, LOGIN_OURS, "s", ours, ours=True),
               Figure(group, LOGIN_PLAIN, "s", plain,
                      note="each worker starts its own temporary Prefect server on one SQLite file")]
    compare(figures, "<= 0.2x plain", lambda o, peers: ratio_to_best(o, peers) <= 0.2)
    return figures


def _started(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    """Start a command in its own session (so that it and its workers can be ended together), its output to
    cwd/output.log (a file: a pipe nobody reads while it runs could stall it)."""
    with open(cwd / "output.log", "wb") as log:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _interrupt(process: subprocess.Popen[bytes], grace: float = 15) -> None:
    """SIGTERM, then (after `grace` s) SIGKILL to the whole session."""
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    _stop(process)


def _tail(process: subprocess.Popen[bytes], cwd: Path) -> str:
    _stop(process)
    return (cwd / "output.log").read_text(errors="replace")[-500:]


if __name__ == "__main__":
    sys.exit(main())
