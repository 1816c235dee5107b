"""`hpc-garage run`: on a login node (local cluster) and inside real SLURM / PBS-style jobs (MPI ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DATA, outside_job_env
from tests.slurm_jobs import exit_code, submit, wait_gone

CHECK = DATA / "check_cluster.py"
PY = sys.executable


def login_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = outside_job_env()
    return env | extra


def run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_garage", "run", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


@pytest.mark.slow
def test_login_node_cluster_is_shaped_like_the_site(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = run(["--site", "lab-gpu", "--", PY, str(CHECK), str(out)], login_env(tmp_path, CHECK_EXIT="7"), tmp_path)
    assert done.returncode == 7, done.stderr  # COMMAND's exit code
    assert "advertise GPU resources but run with CUDA_VISIBLE_DEVICES empty" in done.stderr
    r = json.loads(out.read_text())
    assert len(r["workers"]) == 4
    for w in r["workers"].values():
        assert w["resources"]["GPU"] == 1 and w["resources"]["CPU"] == 2
        assert w["env"]["CUDA_VISIBLE_DEVICES"] == "" and w["env"]["HPC_GARAGE_SITE"] == "lab-gpu"
        assert w["env"]["PREFECT_API_URL"]  # one Prefect API for every worker
    assert r["address"].startswith("tls://") and r["plain_client_refused"] is True
    assert r["worker_preloaded"] == [[True, True]]  # every worker forked with Prefect imported and set up
    assert r["scheduler_has_prefect"] is True  # it unpickles Prefect tasks: imported before the first one
    assert r["worker_profilers"] == [[False, False]]  # Dask's statistical profiler off (launchers/common.py)
    assert r["scheduler_file_mode"] == 0o600 and r["run_dir_mode"] == 0o700 and set(r["tls_modes"]) == {0o600}
    assert not Path(r["scheduler_file"]).exists()  # torn down with the cluster
    state = json.loads((Path(r["scheduler_file"]).parent / "state.json").read_text())
    assert state["phase"] == "done" and state["exit_code"] == 7
    # README "Security": every file of the run directory is private, Dask's own scheduler file included
    assert {"scheduler.json", "dask-scheduler.json", "state.json"} <= set(r["run_dir_file_modes"])
    assert set(r["run_dir_file_modes"].values()) == {0o600}, r["run_dir_file_modes"]


@pytest.mark.slow
def test_insecure_says_so_and_speaks_tcp(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    user = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "True"}  # the user's Dask setting: theirs to keep
    done = run(["--site", "local", "--insecure", "--", PY, str(CHECK), str(out)], login_env(tmp_path, **user),
               tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--insecure" in done.stderr and json.loads(out.read_text())["address"].startswith("tcp://")
    assert json.loads(out.read_text())["worker_profilers"] == [[True, True]]


# as if the workers had not yet obeyed the scheduler's terminate (a loaded machine): `run` ends them itself,
# before the scheduler closes; a worker left heartbeating into a closed scheduler logs a traceback (seen in CI)
SLOW_RETIRE = """
import sys
from distributed import Scheduler
from hpc_garage.cluster import dask_scheduler
from hpc_garage.cli import main

async def ignored(scheduler):
    pass

dask_scheduler.retire = ignored
close = Scheduler.close

async def recorded(self, *args, **kwargs):
    print(f"workers left as the scheduler closes: {len(self.workers)}", file=sys.stderr, flush=True)
    return await close(self, *args, **kwargs)

Scheduler.close = recorded
main()
"""


@pytest.mark.slow
def test_workers_that_ignore_the_terminate_end_before_the_scheduler_closes(tmp_path: Path) -> None:
    done = subprocess.run([PY, "-c", SLOW_RETIRE, "run", "--site", "local", "--", PY, "-c", "pass"],
                          capture_output=True, text=True, env=login_env(tmp_path), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "workers left as the scheduler closes: 0" in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--site", "local", "--", "no-such-program-xyz"], "no-such-program-xyz"),
        (["--site", "nosuch", "--", "true"], "unknown site"),
    ],
)
def test_bad_run_is_one_line(tmp_path: Path, args: list[str], fragment: str) -> None:
    done = run(args, login_env(tmp_path), tmp_path)
    assert done.returncode == 2 and fragment in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------------------------- inside real jobs


def job_script(tmp_path: Path, directives: str, body: str) -> Path:
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{directives}\n{body}\n")
    return script


def run_line(site: str, out: Path) -> str:
    return f"{PY} -m hpc_garage run --site {site} -- {PY} {CHECK} {out}"


@pytest.mark.slurm
@pytest.mark.slow
def test_two_node_job_pins_each_worker_to_its_own_nodes_gpu(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    script = job_script(tmp_path, f"#SBATCH -p gpu -N 2 --ntasks-per-node=2 -c 2 --gres=gpu:2 --mem=4G -t 10 "
                                  f"-o {tmp_path}/job.out", run_line("lab-gpu", out))
    job = submit(["sbatch", "--parsable"], script)
    assert exit_code(wait_gone(job, 180)) == 0, (tmp_path / "job.out").read_text()
    r = json.loads(out.read_text())
    workers = r["workers"]
    assert len(workers) == 4 and r["job_id"] == job
    by_node: dict[str, list[str]] = {}
    for w in workers.values():
        assert w["resources"]["GPU"] == 1 and w["resources"]["CPU"] == 2
        by_node.setdefault(w["env"]["SLURMD_NODENAME"], []).append(w["env"]["CUDA_VISIBLE_DEVICES"])
    assert sorted(by_node) == ["node1", "node2"]
    assert all(sorted(ids) == ["0", "1"] for ids in by_node.values())  # one GPU each, as each node shows them
    assert r["plain_client_refused"] is True
    assert len(r["string_hashes"]) == 1  # workers forked on different nodes hash strings alike


@pytest.mark.slurm
@pytest.mark.slow
def test_two_jobs_at_once_on_one_host_do_not_collide(tmp_path: Path) -> None:
    jobs = []
    for i in range(2):
        d = tmp_path / str(i)
        d.mkdir()
        script = job_script(d, f"#SBATCH -p gpu -N 1 --ntasks-per-node=2 -c 2 --gres=gpu:2 --mem=3G -t 10 "
                               f"-w node1 -o {d}/job.out", run_line("lab-gpu", d / "out.json"))
        jobs.append((d, submit(["sbatch", "--parsable"], script)))
    records = []
    for d, job in jobs:
        assert exit_code(wait_gone(job, 180)) == 0, (d / "job.out").read_text()
        records.append(json.loads((d / "out.json").read_text()))
    assert records[0]["address"] != records[1]["address"]
    gpus = [{w["env"]["CUDA_VISIBLE_DEVICES"] for w in r["workers"].values()} for r in records]
    assert all(len(g) == 2 for g in gpus)


@pytest.mark.slurm
@pytest.mark.slow
def test_pbs_style_job_launches_ranks_with_mpiexec_over_the_node_file(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    # What PBS gives a job and Slurm's Torque wrapper does not: a node file with real host names and NCPUS;
    # every SLURM variable goes, so only the PBS reader and mpiexec can do the work.
    body = f"""export PBS_NODEFILE=$(mktemp) NCPUS=4
hostname > "$PBS_NODEFILE"; hostname >> "$PBS_NODEFILE"
for v in ${{!SLURM_@}} SLURMD_NODENAME; do [ "$v" = SLURM_CONF ] || unset "$v"; done
{run_line("lab-pbs", out)}"""
    script = job_script(tmp_path, "#PBS -l select=1:ncpus=4:mem=4gb\n#PBS -l walltime=00:10:00\n#PBS -q gpu\n"
                                  "#SBATCH --gres=gpu:2", body)
    job = submit(["qsub"], script)
    wait_gone(job, 180)
    log = "".join(p.read_text() for p in tmp_path.glob("job.sh.[eo]*"))
    assert "starting ranks: mpiexec -n 1 --map-by ppr:1:node" in log and "--hostfile" in log, log
    r = json.loads(out.read_text())
    assert sorted(w["env"]["CUDA_VISIBLE_DEVICES"] for w in r["workers"].values()) == ["0", "1"]


@pytest.mark.slurm
def test_ranks_that_cannot_start_are_named_and_nothing_is_left(tmp_path: Path) -> None:
    site = tmp_path / "broken.yaml"
    site.write_text((Path(__file__).parent.parent / "site-configs" / "lab-gpu.yaml").read_text()
                    + "mpi: {launch: mpiexec, mpiexec: /bin/false}\n" + f"run_directory: {tmp_path}/runs\n")
    script = job_script(tmp_path, f"#SBATCH -p gpu -N 1 -c 2 --gres=gpu:2 --mem=2G -t 5 -o {tmp_path}/job.out",
                        f"{PY} -m hpc_garage run --site {site} -- true")
    job = submit(["sbatch", "--parsable"], script)
    assert exit_code(wait_gone(job, 120)) == 2
    log = (tmp_path / "job.out").read_text()
    assert "workers did not start" in log and "/bin/false" in log and "n0-gpu0" in log and "Traceback" not in log
    run_dir = tmp_path / "runs" / job
    assert not (run_dir / "scheduler.json").exists() and not (run_dir / "tls").exists()
