"""`mpi: {launch: dask-mpi}`: one MPI rank per worker running dask-mpi's worker side against `run`'s scheduler.

Pure parts first (the launch line for srun and for OpenMPI/MPICH mpiexec, a rank's place and worker, its
environment, TLS as Dask configuration, dask-mpi's arguments, the failure report); then end to end on the
local SLURM: the sweep on 2 nodes x 4 GPUs through srun and through PBS-flavoured mpiexec with a hostfile,
the cluster's resources, pinning and TLS, a rank killed during start-up and a rank that never starts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from hpc_garage.core.allocation import Allocation, NodeAllocation
from hpc_garage.core.errors import UserError
from hpc_garage.core.layout import layout
from hpc_garage.core.request import Request
from hpc_garage.launchers.dask_mpi import (DaskMpiLauncher, Records, dask_mpi_args, rank_place, rank_worker,
                                          tls_config)
from hpc_garage.schedulers import local_rank
from hpc_garage.schedulers.jobscript import dask_mpi_ranks
from hpc_garage.sites import load_site
from tests.conftest import outside_job_env

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
ARGV = ["python", "-m", "hpc_garage.launchers.dask_mpi", "ranks.json"]


def two_nodes(name: str = "lab-gpu-dask-mpi", **mpi: object):  # noqa: ANN201
    site = load_site(name)
    if mpi:
        site = site.model_copy(update={"mpi": site.mpi.model_copy(update=mpi)})
    return layout(site, Allocation.from_request(site, Request(nodes=2)))


# ------------------------------------------------------------------------------------------ the launch line


def test_srun_starts_one_rank_per_worker_with_its_cores_and_the_sites_mpi_plugin() -> None:
    argv = dask_mpi_ranks(two_nodes(), ARGV, in_slurm=True, nodefile=None)
    assert argv == ["srun", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--cpus-per-task=2",
                    "--kill-on-bad-exit=1", "--mpi=pmix", *ARGV]


def test_mpiexec_spellings_place_the_same_count_on_every_node() -> None:
    openmpi = dask_mpi_ranks(two_nodes("lab-pbs-dask-mpi"), ARGV, in_slurm=False, nodefile="/var/spool/nodes")
    assert openmpi == ["mpiexec", "-n", "8", "--map-by", "ppr:4:node", "--bind-to", "none",
                       "--hostfile", "/var/spool/nodes", *ARGV]
    mpich = dask_mpi_ranks(two_nodes("lab-pbs-dask-mpi", flavor="mpich", mpiexec="/opt/cray/pals/bin/mpiexec",
                                     mpiexec_args=["--cpu-bind", "none"]), ARGV, in_slurm=False, nodefile="/nodes")
    assert mpich == ["/opt/cray/pals/bin/mpiexec", "-n", "8", "-ppn", "4", "-f", "/nodes", "--cpu-bind", "none", *ARGV]


def test_via_mpiexec_inside_slurm_uses_the_allocation_not_a_hostfile() -> None:
    argv = dask_mpi_ranks(two_nodes(via="mpiexec"), ARGV, in_slurm=True, nodefile=None)
    assert argv[:7] == ["mpiexec", "-n", "8", "--map-by", "ppr:4:node", "--bind-to", "none"]
    assert "--hostfile" not in argv and "srun" not in argv


def test_via_srun_outside_slurm_is_refused_at_once() -> None:
    site = load_site("lab-pbs-dask-mpi")
    site = site.model_copy(update={"mpi": site.mpi.model_copy(update={"via": "srun"})})
    launcher = DaskMpiLauncher(layout(site, Allocation(nodes=(NodeAllocation(8, 2**34, ("0",), "n1"),),
                                                       source="pbs")), {})
    with pytest.raises(UserError, match="via: srun.*not a SLURM job"):
        launcher.rank_argv(Path("ranks.json"))


def test_uneven_nodes_get_the_busiest_nodes_count_and_spare_ranks_run_nothing() -> None:
    site = load_site("lab-gpu-dask-mpi")
    allocation = Allocation(nodes=(NodeAllocation(8, 2**34, ("0", "1", "2", "3"), "node1"),
                                   NodeAllocation(8, 2**34, ("0", "1"), "node2")), source="slurm")
    lay = layout(site, allocation)
    argv = dask_mpi_ranks(lay, ARGV, in_slurm=True, nodefile=None)
    assert "--ntasks=8" in argv and "--ntasks-per-node=4" in argv
    workers = list(lay.workers)
    mine = rank_worker(workers, 1, 1, ["0", "1"], "nvidia", {})
    assert mine is not None and mine[0].name.endswith("n1-gpu1") and mine[1]["CUDA_VISIBLE_DEVICES"] == "1"
    assert rank_worker(workers, 1, 2, ["0", "1"], "nvidia", {}) is None
    assert rank_worker(workers, 1, 3, ["0", "1"], "nvidia", {}) is None


def test_the_job_script_shows_the_launch_line() -> None:
    def script(site: str) -> str:
        done = subprocess.run([PY, "-m", "hpc_garage", "show", "--site", site, "--nodes", "2", "--script"],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    slurm = script("lab-gpu-dask-mpi")
    assert "#   srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --cpus-per-task=2 --kill-on-bad-exit=1 --mpi=pmix " \
           in slurm and "-m hpc_garage.launchers.dask_mpi RUN_DIR/ranks.json" in slurm
    pbs = script("lab-pbs-dask-mpi")
    assert '#   mpiexec -n 8 --map-by ppr:4:node --bind-to none --hostfile "$PBS_NODEFILE" ' in pbs
    assert "dask_mpi" not in script("lab-gpu")  # the default launcher's script is unchanged


# ------------------------------------------------------------------------------------------- a rank's place


@pytest.mark.parametrize(
    "env, expected",
    [
        # srun --mpi=pmix: SLURM's node and local rank
        ({"SLURMD_NODENAME": "node2", "SLURM_NODEID": "1", "SLURM_LOCALID": "1", "PMIX_RANK": "5"}, (1, 1)),
        # mpirun inside SLURM: SLURM_LOCALID is its daemon's (0 everywhere); OpenMPI's wins
        ({"SLURMD_NODENAME": "node2", "SLURM_NODEID": "1", "SLURM_LOCALID": "0", "OMPI_COMM_WORLD_RANK": "6",
          "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, (1, 2)),
        # PBS mpiexec where every node has this host's name: node by world rank // ranks per node
        ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, (1, 2)),
        # Cray PALS, MPICH/Hydra, Intel MPI
        ({"PALS_RANKID": "3", "PALS_LOCAL_RANKID": "3"}, (0, 3)),
        ({"PMI_RANK": "4", "MPI_LOCALRANKID": "0"}, (1, 0)),
        ({"PMI_RANK": "7", "PMI_LOCAL_RANK": "3"}, (1, 3)),
        # only a world rank: block placement
        ({"PMIX_RANK": "5"}, (1, 1)),
    ],
)
def test_a_rank_finds_its_node_and_local_rank(env: dict[str, str], expected: tuple[int, int]) -> None:
    assert rank_place(env, ["node1", "node2"], 4) == expected


def test_a_rank_found_by_name_beats_its_world_rank() -> None:
    env = {"SLURMD_NODENAME": "nid0002.cluster", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert rank_place(env, ["nid0001", "nid0002"], 4) == (1, 1)


def test_a_rank_with_no_rank_variable_says_how_to_start_it() -> None:
    with pytest.raises(UserError, match="no local-rank variable"):
        rank_place({"SLURMD_NODENAME": "node1"}, ["node1", "node2"], 4)


def test_slurms_local_rank_is_read_under_schedulers() -> None:
    assert local_rank({"SLURM_LOCALID": "3"}) == 3 and local_rank({}) is None


# ---------------------------------------------------------------------------------------- a rank's worker


def test_each_rank_is_pinned_to_its_own_gpu_as_its_node_shows_them() -> None:
    workers = list(two_nodes().workers)
    mine = rank_worker(workers, 1, 2, ["4", "5", "6", "7"], "nvidia", {"HPC_GARAGE_SITE": "x"})
    assert mine is not None
    spec, env = mine
    assert spec.name.endswith("n1-gpu2")
    assert env["CUDA_VISIBLE_DEVICES"] == "6" and env["OMP_NUM_THREADS"] == "2" and env["HPC_GARAGE_SITE"] == "x"
    amd = rank_worker(workers, 0, 1, ["0", "1", "2", "3"], "amd", {})
    assert amd is not None and amd[1]["ROCR_VISIBLE_DEVICES"] == "1"  # the vendor's own variable
    with pytest.raises(UserError, match="needs GPU slot 2 but its node shows only 2 GPUs"):
        rank_worker(workers, 1, 2, ["0", "1"], "nvidia", {})


def test_dask_mpi_takes_the_workers_options_on_its_command_line() -> None:
    from dask_mpi.cli import main as cli

    from hpc_garage.launchers.common import dask_worker_preload

    spec = next(w for w in two_nodes().workers if w.node == 0 and w.local_rank == 1)
    env = {"CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": "2"}
    data = {"scheduler_file": "/run/dask-scheduler.json", "tls": {"tls_ca_file": "/c"}, "interface": "ib0",
            "local_directory": "/scratch", "timeout": 60}
    params = cli.make_context("dask-mpi", dask_mpi_args(data, spec, env)).params
    assert params["scheduler_file"] == "/run/dask-scheduler.json" and params["scheduler"] is False
    assert params["protocol"] == "tls" and params["interface"] == "ib0" and params["local_directory"] == "/scratch"
    options = json.loads(params["worker_options"])
    assert options == {"name": spec.name, "nthreads": spec.nthreads, "memory_limit": spec.memory_limit,
                       "resources": spec.resources, "env": env, "death_timeout": 60.0,
                       "preload": dask_worker_preload()}  # each worker's own set-up (launchers/worker_setup.py)
    plain = cli.make_context("dask-mpi", dask_mpi_args({**data, "tls": None, "interface": None}, spec, env)).params
    assert plain["protocol"] == "tcp" and plain["interface"] is None


def test_the_runs_tls_files_become_the_security_a_nanny_builds_by_default(tmp_path: Path) -> None:
    import dask
    from distributed.security import Security

    from hpc_garage.rundir import RunDir

    tls = RunDir(tmp_path).credential_paths()
    with dask.config.set(tls_config(tls)):
        default = Security()
    given = Security(require_encryption=True, **tls)
    for name in ("require_encryption", "tls_ca_file", "tls_worker_cert", "tls_worker_key", "tls_client_cert",
                 "tls_client_key", "tls_scheduler_cert", "tls_scheduler_key"):
        assert getattr(default, name) == getattr(given, name), name
    assert tls_config(None) == {}


# ------------------------------------------------------------------------------------------ failure report


def test_the_report_names_the_rank_the_launcher_saw_end_first_and_the_ranks_that_never_started(tmp_path: Path) -> None:
    launcher = DaskMpiLauncher(two_nodes(), {})
    launcher.records = Records(tmp_path).create()
    for key in ("0-0", "0-1", "0-2", "1-0", "1-1", "1-2"):  # 0-3 and 1-3 never wrote a word
        launcher.records.write("started", key, {"pid": 1})
    launcher.said.extend(["srun: error: node1: task 3: Exited with exit code 137",
                          "srun: error: node2: tasks 4-7: Terminated"])
    text = launcher.report("`srun` exited with code 143")
    assert text.startswith("`srun` exited with code 143; rank 3 (node 0, worker ")
    assert "n0-gpu3) ended first: Exited with exit code 137" in text and "the launcher said: srun: error" in text
    assert "never started" not in text  # srun ended them: the rank it named is the story

    launcher.said.clear()
    launcher.said.append("mpiexec noticed that process rank 5 with PID 0 on node node2 exited on signal 9 (Killed).")
    assert "rank 5 (node 1, worker " in launcher.report("`mpiexec` exited with code 137")
    waited = launcher.report(None, "none within the 20 s start timeout")
    assert "2 of 8 ranks never started (none within the 20 s start timeout): rank 3 (node 0" in waited
    assert "; rank 7 (node 1" in waited

    launcher.records.write("failed", "1-1", {"error": "LayoutError: worker x needs GPU slot 1"})
    assert "rank 5 (node 1, worker " in launcher.report(None) and "failed: LayoutError" in launcher.report(None)


def test_the_launchers_stderr_is_passed_on_whatever_its_line_length_and_its_error_lines_kept(
        capfd: pytest.CaptureFixture[str]) -> None:
    import asyncio

    async def relay() -> DaskMpiLauncher:
        launcher = DaskMpiLauncher(two_nodes(), {})
        code = ("import sys; sys.stderr.write('x' * 300000 + '\\n'); "
                "sys.stderr.write('srun: error: node1: task 3: Exited with exit code 1\\nworker log\\n')")
        launcher.proc = await asyncio.create_subprocess_exec(PY, "-c", code, stderr=asyncio.subprocess.PIPE)
        await launcher._relay_stderr()
        await launcher.proc.wait()
        return launcher

    launcher = asyncio.run(relay())
    assert list(launcher.said) == ["srun: error: node1: task 3: Exited with exit code 1"]
    err = capfd.readouterr().err
    assert err.count("x") >= 300000 and err.endswith("worker log\n")


# -------------------------------------------------------------------------------------------- end to end

Slurm = pytest.mark.slurm
SWEEP = ROOT / "examples" / "sweep.py"
CHECK = ROOT / "tests" / "data" / "check_cluster.py"


def clean_env() -> dict[str, str]:
    return outside_job_env()


def hpcg(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(), timeout=timeout)


def one_gpu_each_no_overlap(summary: dict) -> dict[tuple[str, str], list]:
    """Right result; every experiment saw exactly one GPU; no GPU ran two at once."""
    assert summary["result"] == summary["expected"] and summary["experiments"] == len(summary["records"])
    by_gpu: dict[tuple[str, str], list] = defaultdict(list)
    for r in summary["records"]:
        device = r["cuda_visible_devices"]
        assert device is not None and device.strip() and "," not in device, r
        by_gpu[(r["worker"].rsplit("-gpu", 1)[0], device)].append((r["start"], r["end"]))
    for spans in by_gpu.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    return by_gpu


def log_of(stdout: str) -> str:
    path = next(line.split("log: ", 1)[1] for line in stdout.splitlines() if line.startswith("log: "))
    return Path(path).read_text()


def sweep_on_two_nodes(site: str, tmp_path: Path) -> str:
    out = tmp_path / "r.json"
    done = hpcg(["submit", "--site", site, "--nodes", "2", "--wait", str(SWEEP), "--gpu", "yes", "--seeds", "8",
                 "--duration", "0.3", "--out", str(out)], tmp_path)
    log = log_of(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr + log
    summary = json.loads(out.read_text())
    by_gpu = one_gpu_each_no_overlap(summary)
    assert len({node for node, _ in by_gpu}) == 2 and {g for _, g in by_gpu} <= set("0123"), sorted(by_gpu)
    seen: dict[str, set[str]] = defaultdict(set)  # worker -> the GPUs its experiments saw
    for r in summary["records"]:
        seen[r["worker"]].add(r["cuda_visible_devices"])
    assert all(len(devices) == 1 for devices in seen.values()), seen  # a worker keeps its one GPU
    pinned = [(w.rsplit("-gpu", 1)[0], next(iter(d))) for w, d in seen.items()]
    assert len(pinned) == len(set(pinned)), seen  # no two workers of a node share a GPU
    assert "8 workers registered" in log
    return log


@Slurm
def test_the_sweep_on_two_nodes_of_four_gpus_through_srun(tmp_path: Path) -> None:
    log = sweep_on_two_nodes("lab-gpu-dask-mpi", tmp_path)
    assert "starting dask-mpi ranks: srun --nodes=2 --ntasks=8 --ntasks-per-node=4" in log, log
    assert "8 workers registered" in log


@Slurm
@pytest.mark.skipif(not shutil.which("qsub"), reason="no qsub (Slurm's Torque wrapper, slurm-wlm-torque) here")
def test_the_sweep_on_two_nodes_through_pbs_mpiexec_and_a_hostfile(tmp_path: Path) -> None:
    log = sweep_on_two_nodes("lab-pbs-dask-mpi", tmp_path)
    assert "starting dask-mpi ranks: mpiexec -n 8 --map-by ppr:4:node --bind-to none --hostfile " in log, log


def job_script(tmp_path: Path, header: str, body: str) -> Path:
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n{header}\n{body}\n")
    return script


def sbatch_run(tmp_path: Path, site: Path | str, command: str, *, gpus: int, extra: str = "",
               timeout: float = 120) -> tuple[int, str, float]:
    """One 2-node job running `hpc-garage run ... -- command`; (exit code, log, seconds from start to end)."""
    from tests.slurm_jobs import exit_code, submit, wait_gone

    script = job_script(tmp_path, f"#SBATCH -p gpu -N 2 --ntasks-per-node={gpus} -c 2 --gres=gpu:{gpus} --mem=4G "
                                  f"-t 5 -o {tmp_path}/job.out",
                        f"{PY} -m hpc_garage run --site {site} {extra} -- {command}")
    job = submit(["sbatch", "--parsable"], script)
    line = wait_gone(job, timeout)
    times = {k: v for k, v in (f.split("=", 1) for f in line.split() if f.startswith(("StartTime=", "EndTime=")))}
    took = time.mktime(time.strptime(times["EndTime"], "%Y-%m-%dT%H:%M:%S")) - \
        time.mktime(time.strptime(times["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    return exit_code(line), (tmp_path / "job.out").read_text(), took


@Slurm
def test_the_cluster_has_each_workers_resources_pinning_tls_and_preload(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    code, log, _ = sbatch_run(tmp_path, "lab-gpu-dask-mpi", f"{PY} {CHECK} {out}", gpus=2)
    assert code == 0, log
    r = json.loads(out.read_text())
    by_node: dict[str, list[str]] = defaultdict(list)
    for w in r["workers"].values():
        assert w["resources"]["GPU"] == 1 and w["resources"]["CPU"] == 2 and w["nthreads"] == 2
        assert w["env"]["OMP_NUM_THREADS"] == "2" and w["env"]["PREFECT_API_URL"]
        by_node[w["env"]["SLURMD_NODENAME"]].append(w["env"]["CUDA_VISIBLE_DEVICES"])
    # each worker its own one of the 2 GPUs SLURM gave the job on its node (which 2 of the node's 4 depends on
    # what else runs there)
    assert sorted(by_node) == ["node1", "node2"], by_node
    assert all(len(set(v)) == 2 and set(v) <= {"0", "1", "2", "3"} for v in by_node.values()), by_node
    assert r["address"].startswith("tls://") and r["plain_client_refused"] is True
    assert r["worker_preloaded"] == [[True, True]] and len(r["string_hashes"]) == 1
    assert r["scheduler_file_mode"] == 0o600 and not Path(r["scheduler_file"]).exists()


def failing_site(tmp_path: Path, name: str, rank3: str) -> Path:
    """lab-gpu-dask-mpi whose interpreter, for world rank 3 only, runs `rank3` (shell) instead of as usual."""
    wrapper = tmp_path / "py.sh"
    wrapper.write_text(f'#!/bin/bash\nif [ "${{PMIX_RANK:-}}" = 3 ]; then\n{rank3}\nfi\nexec {PY} "$@"\n')
    wrapper.chmod(0o755)
    site = tmp_path / f"{name}.yaml"
    site.write_text((ROOT / "site-configs" / "lab-gpu-dask-mpi.yaml").read_text()
                    + f"python: {wrapper}\nrun_directory: {tmp_path}/runs\n")
    return site


def leftovers(marker: str, tmp_path: Path) -> list[str]:
    """Processes of this run still there: with its site name in their environment (COMMAND, ranks,
    forkservers, workers) or its files on their command line (ranks before they read the rank file)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"HPC_GARAGE_SITE={marker}".encode() in environ or str(tmp_path) in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


@Slurm
def test_a_rank_killed_during_start_up_is_named_at_once_and_nothing_is_left(tmp_path: Path) -> None:
    name = f"dmkill{os.getpid()}"
    site = failing_site(tmp_path, name, f'  {PY} "$@" & pid=$!; sleep 2; kill -9 "$pid"; wait "$pid"; exit $?')
    code, log, took = sbatch_run(tmp_path, site, "sleep 600", gpus=4)
    assert code == 2, log
    error = next(line for line in log.splitlines() if line.startswith("hpc-garage: error:"))
    assert "`srun` exited with code" in error and "rank 3 (node 0, node1, worker " in error, error
    assert "n0-gpu3) ended first: Exited with exit code 137" in error and "Traceback" not in log, error
    assert took < 60, f"{took} s"  # far inside the 180 s start timeout
    time.sleep(1)
    assert not leftovers(name, tmp_path)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").glob("*/dask-mpi-ranks"))


@Slurm
def test_a_rank_that_never_starts_is_named_when_the_start_timeout_is_up(tmp_path: Path) -> None:
    name = f"dmhang{os.getpid()}"
    site = failing_site(tmp_path, name, f"  exec {PY} -c 'import time; time.sleep(600)' {tmp_path}")
    code, log, took = sbatch_run(tmp_path, site, "sleep 600", gpus=4, extra="--timeout 15")
    assert code == 2, log
    error = next(line for line in log.splitlines() if line.startswith("hpc-garage: error:"))
    assert "1 of 8 ranks never started (none within the 15 s start timeout): rank 3 (node 0, node1, worker " in error
    assert took < 50, f"{took} s"  # the timeout, then the ranks ended at once
    time.sleep(1)
    assert not leftovers(name, tmp_path)
