"""The jobqueue launcher's pure parts: the site's jobqueue:/pools: sections, one job's shape, placement across
pools, scaling decisions, the worker job scripts, and the worker job's own layout from its environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_garage.core.allocation import Allocation
from hpc_garage.core.errors import SiteError, UserError
from hpc_garage.launchers.jobqueue.jobs import job_kwargs, submit_env, worker_scripts
from hpc_garage.launchers.jobqueue.plan import initial_workers, initial_layout
from hpc_garage.launchers.jobqueue.scaling import PoolState, choose_pool, idle_jobs, pool_loads, pool_targets, task_weight
from hpc_garage.launchers.jobqueue.worker import job_workers
from hpc_garage.core.pools import RUN_END_MARGIN, UNTAGGED, job_shapes, lifetime, untagged_restrictions, worker_names
from hpc_garage.schedulers.slurm import Slurm
from hpc_garage.core.site import parse_site_dict
from hpc_garage.sites import load_site

PY = sys.executable
GIB = 2**30


def jq_site(**jobqueue: object) -> dict:
    return {"name": "t", "scheduler": "slurm", "launcher": "jobqueue", "queue": "gpu", "walltime": "00:20:00",
            "node": {"cores": 8, "memory": "15GiB", "gpus": 4}, "workers": {"per": "gpu", "reserve_memory": "512MiB"},
            "jobqueue": {"gpus_per_job": 2, **jobqueue}}


def two_pools(**gpu_pool: object) -> dict:
    data = jq_site()
    data["pools"] = {"gpu": {"queue": "gpu", "jobqueue": {"jobs": 1}, **gpu_pool},
                     "cpu": {"queue": "cpu", "node": {"gpus": 0}, "workers": {"per": "node"},
                             "jobqueue": {"jobs": 1, "gpus_per_job": 0, "cores_per_job": 4,
                                          "memory_per_job": "8GiB"}}}
    return data


# ------------------------------------------------------------------------------------------------ the site


def test_shipped_jobqueue_sites_load_and_pools_merge_onto_the_site() -> None:
    for name in ("lab-jobqueue", "lab-pools", "slurm-jobqueue", "pbs-jobqueue"):
        assert load_site(name).launcher == "jobqueue"
    pools = load_site("lab-pools").pool_sites()
    assert list(pools) == ["gpu", "cpu"]
    gpu, cpu = pools["gpu"], pools["cpu"]
    assert (gpu.queue, gpu.node.gpus, gpu.workers.per, gpu.jobqueue.jobs) == ("gpu", 4, "gpu", 1)
    assert (cpu.queue, cpu.node.gpus, cpu.node.cores, cpu.workers.per) == ("cpu", 0, 8, "node")
    assert cpu.workers.reserve_memory == 512 * 2**20 and cpu.interface == "lo"  # inherited key by key
    assert cpu.jobqueue.max_jobs_in_queue == 4 and cpu.name == "lab-pools.cpu"
    single = load_site("lab-jobqueue")
    assert single.pool_sites() == {"lab-jobqueue": single}


def test_plain_tasks_go_to_pools_without_gpus_unless_the_site_says_otherwise() -> None:
    assert load_site("lab-pools").untagged_pools() == {"cpu"}
    assert load_site("lab-jobqueue").untagged_pools() == {"lab-jobqueue"}  # the only pool takes them
    assert parse_site_dict(two_pools(untagged=True)).untagged_pools() == {"gpu", "cpu"}


def test_a_pools_own_scaling_replaces_the_sites() -> None:
    data = jq_site(minimum_jobs=0, maximum_jobs=2)
    data["pools"] = {"a": {}, "b": {"jobqueue": {"jobs": 3}}}
    pools = parse_site_dict(data).pool_sites()
    assert pools["a"].jobqueue.adaptive and pools["a"].jobqueue.bounds == (0, 2)
    assert not pools["b"].jobqueue.adaptive and pools["b"].jobqueue.bounds == (3, 3)


@pytest.mark.parametrize("change, message", [
    ({"jobqueue": {"jobs": 2, "maximum_jobs": 3}}, "give either jobs (fixed) or minimum_jobs/maximum_jobs"),
    ({"jobqueue": {"maximum_jobs": 9}}, "jobqueue.maximum_jobs (9) exceeds max_jobs_in_queue (4)"),
    ({"jobqueue": {"minimum_jobs": 3, "maximum_jobs": 2}}, "minimum_jobs (3) exceeds maximum_jobs (2)"),
    ({"jobqueue": {"gpus_per_job": 5}}, "jobqueue.gpus_per_job (5) exceeds node.gpus (4)"),
    ({"jobqueue": {"lifetime_margin": "19min"}}, "leaves workers no time"),
    ({"scheduler": "local"}, "launcher: jobqueue submits worker jobs; use scheduler: slurm or pbs"),
    ({"launcher": "mpi", "pools": {"a": {}}}, "pools are for launcher: jobqueue"),
    ({"pools": {"a": {"queeu": "x"}}}, "unknown key 'pools.a.queeu'; did you mean 'queue'?"),
    ({"pools": {"a": {"node": {"gpuss": 1}}}}, "pools.a: unknown key 'node.gpuss'; did you mean 'gpus'?"),
    ({"pools": {"a": {"untagged": False}}}, "no pool takes tasks without resource tags"),
    ({"pools": {"bad name": {}}}, "has characters that are not allowed"),
])
def test_site_mistakes_are_one_line(change: dict, message: str) -> None:
    data = jq_site() | change
    with pytest.raises(SiteError) as err:
        parse_site_dict(data)
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------ one job's shape


def test_one_job_is_a_gpu_slice_with_its_share_of_cores_and_memory() -> None:
    shape = job_shapes(load_site("lab-jobqueue"))["lab-jobqueue"]
    assert (shape.cores, shape.memory, shape.gpus, shape.workers_per_job) == (4, 15 * GIB // 2, 2, 2)
    assert [w.resources["GPU"] for w in shape.layout.workers] == [1, 1]
    assert shape.untagged and not shape.marker  # one pool: Dask places tasks as it always does
    pools = job_shapes(load_site("lab-pools"))
    assert pools["cpu"].marker and pools["cpu"].worker_resources[0][UNTAGGED] > 1000
    assert UNTAGGED not in pools["gpu"].worker_resources[0]


def test_worker_names_are_what_speccluster_expects_for_a_job() -> None:
    assert worker_names("gpu-3", 2) == ["gpu-3-0", "gpu-3-1"]
    assert worker_names("cpu-0", 1) == ["cpu-0"]
    assert initial_workers(load_site("lab-pools")) == ["gpu-0-0", "gpu-0-1", "cpu-0"]
    layout_, _ = initial_layout(load_site("lab-pools"))
    assert [w.name for w in layout_.workers] == ["gpu-0-0", "gpu-0-1", "cpu-0"]


def test_lifetime_ends_before_the_walltime_with_room_for_the_stagger() -> None:
    site = load_site("lab-jobqueue")  # 20 min: margin 60 s, stagger 60 s
    life, stagger = lifetime(site)
    assert (life, stagger) == (1200 - 60 - 60, 60) and life + stagger <= site.walltime - site.lifetime_margin
    assert lifetime(site, remaining=600) == (600 - 120, 60)  # a job that started late: its real end time counts
    # the run that uses the job ends first (a driver job's --time): its workers retire RUN_END_MARGIN before it
    assert lifetime(site, remaining=600, run_remaining=300) == (300 - RUN_END_MARGIN - 60, 60)
    assert lifetime(site, remaining=600, run_remaining=5000) == (600 - 120, 60)
    # a worker job whose walltime was cut to a 1-minute driver's end: not the site's 60 s margin and stagger
    assert lifetime(site, remaining=55, run_remaining=50, cut=True) == (50 - RUN_END_MARGIN, 0)


# ------------------------------------------------------------------------------------------------ placement


def test_the_placement_rule() -> None:
    assert untagged_restrictions({}, UNTAGGED) == {UNTAGGED: 1}
    assert untagged_restrictions(None, UNTAGGED) == {UNTAGGED: 1}
    assert untagged_restrictions({"GPU": 1}, UNTAGGED) == {"GPU": 1}
    assert untagged_restrictions({"GPU": 0}, None) == {}  # no marker in use: Dask's default placement


def test_unplaced_tasks_are_counted_for_the_pool_that_should_take_them() -> None:
    shapes = list(job_shapes(load_site("lab-pools")).values())
    assert choose_pool({"GPU": 1}, shapes) == "gpu"
    assert choose_pool({"MEMORY": 5e9}, shapes) == "cpu"  # more than a GPU worker holds
    assert choose_pool({UNTAGGED: 1}, shapes) == "cpu" and choose_pool(None, shapes) == "cpu"
    assert choose_pool({"CPU": 2}, shapes) == "cpu"  # fits both: pools without GPUs first
    assert choose_pool({"GPU": 8}, shapes) is None
    gpu = shapes[0]
    assert task_weight({"GPU": 1}, gpu) == 1.0 and task_weight(None, gpu) == 0.5  # 2 threads per worker
    loads = pool_loads(shapes, [{"GPU": 1}] * 3 + [None] * 4, {"gpu": [{"GPU": 1}]})
    assert loads == {"gpu": 4.0, "cpu": 1.0}  # the cpu worker runs 4 plain tasks at once


def test_targets_follow_the_load_within_the_bounds_and_the_cap() -> None:
    site = parse_site_dict(jq_site(minimum_jobs=1, maximum_jobs=3, max_jobs_in_queue=3))
    shapes = list(job_shapes(site).values())
    pool = shapes[0].pool
    assert pool_targets(shapes, {pool: PoolState(jobs=0, load=0)}, cap=3) == {pool: 1}  # the minimum
    assert pool_targets(shapes, {pool: PoolState(jobs=1, load=5)}, cap=3) == {pool: 3}  # 5 workers: 3 jobs
    assert pool_targets(shapes, {pool: PoolState(jobs=1, load=40)}, cap=3) == {pool: 3}  # maximum_jobs
    assert pool_targets(shapes, {pool: PoolState(jobs=1, load=40, leaving=1)}, cap=3) == {pool: 2}  # queue cap
    fixed = list(job_shapes(load_site("lab-pools")).values())
    states = {"gpu": PoolState(jobs=0, load=9), "cpu": PoolState(jobs=0, load=0)}
    assert pool_targets(fixed, states, cap=4) == {"gpu": 1, "cpu": 1}
    assert pool_targets(fixed, states, cap=1) == {"gpu": 1, "cpu": 0}  # the run-wide cap, in the site's order


@given(st.lists(st.tuples(st.integers(0, 6), st.floats(0, 50), st.integers(0, 3)), min_size=2, max_size=2),
       st.integers(1, 8))
def test_growth_never_exceeds_the_run_wide_cap(states: list, cap: int) -> None:
    data = two_pools()
    data["pools"]["gpu"]["jobqueue"] = {"minimum_jobs": 0, "maximum_jobs": 4}
    data["pools"]["cpu"]["jobqueue"] = {"minimum_jobs": 0, "maximum_jobs": 4, "gpus_per_job": 0, "cores_per_job": 4}
    shapes = list(job_shapes(parse_site_dict(data)).values())
    given_states = {s.pool: PoolState(jobs=j, load=load, leaving=out) for s, (j, load, out) in zip(shapes, states)}
    targets = pool_targets(shapes, given_states, cap)
    growth = sum(max(0, targets[p] - s.jobs) for p, s in given_states.items())
    assert growth <= max(0, cap - sum(s.jobs + s.leaving for s in given_states.values()))
    assert all(targets[s.pool] <= max(given_states[s.pool].jobs, 4) for s in shapes)


def test_idle_jobs_to_cancel_never_started_first_then_the_longest_idle() -> None:
    busy = {"a": 10.0, "b": None, "c": 5.0, "d": 99.0}
    assert idle_jobs(busy, now=100.0, idle_timeout=30, surplus=3) == ["b", "c", "a"]
    assert idle_jobs(busy, now=100.0, idle_timeout=30, surplus=1) == ["b"]
    assert idle_jobs({"d": 99.0}, now=100.0, idle_timeout=30, surplus=1) == []  # busy a second ago


# ------------------------------------------------------------------------------------------- job scripts


def test_slurm_worker_script_asks_for_the_gpus_cores_and_exact_memory_of_one_job() -> None:
    text = worker_scripts(load_site("lab-jobqueue"), run_root=Path("/runs"))
    for line in ("#SBATCH -p gpu", "#SBATCH -n 1", "#SBATCH --cpus-per-task=4", "#SBATCH --mem=7680M",
                 "#SBATCH -t 00:20:00", "#SBATCH --gres=gpu:2", "#SBATCH -J hpcg-lab-jobqueue-RUN_ID",
                 "#SBATCH --output=/runs/RUN_ID/worker-logs/%x-%j.out"):
        assert line in text.splitlines(), line
    command = text.splitlines()[-1]
    assert f"{PY} -m hpc_garage.launchers.jobqueue.worker tls://" in command
    assert "--name lab-jobqueue-0 --nthreads 2 --memory-limit 3.50GiB" in command
    assert "--hpc-garage-worker-file /runs/RUN_ID/jobqueue-lab-jobqueue.json" in command and "--tls-key" in command
    pools = worker_scripts(load_site("lab-pools"), run_root=Path("/runs"))
    cpu = pools.split("pool cpu")[1]
    assert "#SBATCH -p cpu" in cpu and "--gres" not in cpu and "#SBATCH --mem=8192M" in cpu


def test_pbs_worker_script_selects_cpus_gpus_and_memory() -> None:
    text = worker_scripts(load_site("pbs-jobqueue"), run_root=Path("/runs"))
    lines = text.splitlines()
    assert "#PBS -l select=1:ncpus=32:ngpus=2:mem=256gb" in lines
    assert {"#PBS -q gpu", "#PBS -l walltime=02:00:00", "#PBS -j oe", "#PBS -o /runs/RUN_ID/worker-logs/",
            "module load cuda"} <= set(lines)
    assert not any(line.startswith("#SBATCH") for line in lines)
    with pytest.raises(UserError, match="PBS has no QOS"):
        job_kwargs(next(iter(job_shapes(parse_site_dict({**jq_site(), "scheduler": "pbs", "qos": "x"})).values())),
                   plan_file="/p", log_dir="/l", job_name="j")


def test_values_that_reach_a_worker_script_stay_inert() -> None:
    shape = next(iter(job_shapes(parse_site_dict({**jq_site(), "queue": "gpu;rm -rf ~"})).values()))
    with pytest.raises(UserError, match="queue"):
        job_kwargs(shape, plan_file="/p", log_dir="/l", job_name="j")
    shape = next(iter(job_shapes(parse_site_dict(jq_site())).values()))
    with pytest.raises(UserError, match="run directory"):
        job_kwargs(shape, plan_file="/p", log_dir="/my runs", job_name="j")


def test_sbatch_runs_without_the_drivers_own_job_and_gpus() -> None:
    env = submit_env({"SLURM_JOB_ID": "5", "SLURM_MEM_PER_NODE": "100", "SLURM_CONF": "/etc/slurm.conf",
                      "PBS_JOBID": "5", "CUDA_VISIBLE_DEVICES": "0", "SBATCH_PARTITION": "x", "PATH": "/bin"})
    assert env == {"SLURM_CONF": "/etc/slurm.conf", "PATH": "/bin"}


# ------------------------------------------------------------------------------------ inside a worker job


def slurm_job_env(gpus: str, cpus: int = 4, mem: int = 7680) -> dict[str, str]:
    return {"SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "node2", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_CPUS_PER_NODE": str(cpus), "SLURM_MEM_PER_NODE": str(mem), "CUDA_VISIBLE_DEVICES": gpus,
            "SLURM_GPUS_ON_NODE": str(len(gpus.split(","))) if gpus else "0", "SLURMD_NODENAME": "node2"}


def test_each_worker_of_a_job_gets_one_of_the_gpus_the_job_sees() -> None:
    shape = job_shapes(load_site("lab-jobqueue"))["lab-jobqueue"]
    env = slurm_job_env("2,3")
    workers, notes = job_workers(shape, "lab-jobqueue-4", Slurm().allocation_from_env(env, shape.site), env)
    assert [w.name for w in workers] == ["lab-jobqueue-4-0", "lab-jobqueue-4-1"]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["2", "3"]
    assert all(w.env["OMP_NUM_THREADS"] == "2" and w.spec.nthreads == 2 for w in workers)
    assert all(w.resources == {"GPU": 1, "CPU": 2, "MEMORY": w.spec.memory_limit, "PROCESS": 1} for w in workers)


def test_a_job_given_fewer_gpus_than_its_pool_asks_refuses_to_start() -> None:
    shape = job_shapes(load_site("lab-jobqueue"))["lab-jobqueue"]
    env = slurm_job_env("1")
    with pytest.raises(UserError, match="1 workers, but pool lab-jobqueue's jobs have 2"):
        job_workers(shape, "x-0", Slurm().allocation_from_env(env, shape.site), env)


def test_a_cpu_pool_worker_advertises_the_untagged_marker_and_no_gpus() -> None:
    shape = job_shapes(load_site("lab-pools"))["cpu"]
    env = slurm_job_env("", cpus=4, mem=8192)
    workers, _ = job_workers(shape, "cpu-2", Slurm().allocation_from_env(env, shape.site), env)
    assert [w.name for w in workers] == ["cpu-2"]
    assert workers[0].resources[UNTAGGED] > 0 and "GPU" not in workers[0].resources
    assert "CUDA_VISIBLE_DEVICES" not in workers[0].env


def test_request_allocation_matches_what_a_worker_job_reads() -> None:
    shape = job_shapes(load_site("lab-jobqueue"))["lab-jobqueue"]
    real = Slurm().allocation_from_env(slurm_job_env("0,1"), shape.site)
    assert (real.nodes[0].cores, real.nodes[0].memory) == (shape.cores, shape.memory)
    assert isinstance(real, Allocation)


# -------------------------------------------------------------------------------------------------- the CLI


def hpcg(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_show_describes_each_pool_without_importing_dask() -> None:
    code = ("import sys; from hpc_garage.cli import main\n"
            "try:\n    main(['show', '--site', 'lab-pools'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('distributed', 'dask_jobqueue', 'prefect') if m in sys.modules))")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "pool gpu: queue gpu, 1 job(s), tagged tasks only" in out and "takes untagged tasks" in out
    assert "2 GPUs, 4 cores, 7.5 GiB → 2 workers" in out and out.strip().endswith("[]")
    data = json.loads(hpcg("show", "--site", "lab-pools", "--json").stdout)
    assert data["pools"]["cpu"]["job"] == {"cores": 4, "memory": 8 * GIB, "gpus": 0, "walltime": 1200}
    assert data["pools"]["gpu"]["untagged"] is False


def test_show_refuses_request_flags_and_prints_worker_scripts() -> None:
    done = hpcg("show", "--site", "lab-jobqueue", "--nodes", "2")
    assert done.returncode == 2 and "--nodes: site lab-jobqueue runs worker jobs shaped by its jobqueue" in done.stderr
    done = hpcg("show", "--site", "lab-pools", "--worker-script")
    assert done.returncode == 0 and done.stdout.count("#!/usr/bin/env bash") == 2 and "pool cpu" in done.stdout
    done = hpcg("show", "--site", "lab-gpu", "--worker-script")
    assert done.returncode == 2 and "submits no worker jobs" in done.stderr


def test_submit_dry_run_prints_the_driver_job_then_the_worker_jobs(tmp_path: Path) -> None:
    (tmp_path / "flow.py").write_text("print('hi')\n")
    done = hpcg("submit", "--site", "lab-pools", "--dry-run", "flow.py", "--x", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    driver, workers = done.stdout.split("# ---- worker job of pool gpu", 1)
    assert "#SBATCH --cpus-per-task=1" in driver and "#SBATCH --mem=2048M" in driver and "--gres" not in driver
    assert "-m hpc_garage run --site" in driver and "flow.py --x 1" in driver
    assert "#SBATCH --gres=gpu:2" in workers and "# ---- worker job of pool cpu" in workers


@pytest.mark.slow
def test_the_scheduler_keeps_plain_tasks_off_workers_of_pools_that_refuse_them() -> None:
    """The rule as the scheduler applies it to any client's tasks (plain Dask here, not Prefect)."""
    import asyncio

    import dask
    from distributed import Client, Scheduler, Worker, get_worker

    from hpc_garage.launchers.jobqueue.launcher import _untagged_plugin

    def where(_: int) -> str:
        return str(get_worker().name)

    async def main() -> tuple[set[str], set[str], set[str]]:
        async with Scheduler(port=0, dashboard_address=":0") as s:
            s.add_plugin(_untagged_plugin(), name="hpc-garage-untagged")
            async with Worker(s.address, name="gpu-0-0", nthreads=2, resources={"GPU": 1, "CPU": 2}), \
                    Worker(s.address, name="cpu-0", nthreads=2, resources={"CPU": 2, UNTAGGED: 1e6}), \
                    Client(s.address, asynchronous=True) as client:
                plain = await client.gather(client.map(where, range(12), pure=False))
                with dask.annotate(resources={"GPU": 1}):
                    gpu = await client.gather(client.map(where, range(4), pure=False))
                pinned = await client.gather(client.map(where, range(4), workers=["gpu-0-0"], pure=False))
                return set(plain), set(gpu), set(pinned)

    plain, gpu, pinned = asyncio.run(main())
    assert plain == {"cpu-0"} and gpu == {"gpu-0-0"} and pinned == {"gpu-0-0"}


def test_command_learns_what_workers_the_pools_can_start() -> None:
    from hpc_garage.core.pools import pool_offers

    offers = pool_offers(job_shapes(load_site("lab-pools")))
    assert offers == [{"GPU": 1, "CPU": 2, "MEMORY": 3758096384, "PROCESS": 1},
                      {"CPU": 4, "MEMORY": 7.5 * GIB, "PROCESS": 1, UNTAGGED: 1_000_000}]


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_a_failed_worker_job_points_at_its_log_where_the_batch_system_names_it(scheduler: str,
                                                                                tmp_path: Path) -> None:
    """Slurm writes a worker job's log under the name the run directory gives it (`%x-%j.out`); PBS names its
    own, so the message points at the folder."""
    from hpc_garage.launchers.jobqueue.records import JobBook
    from hpc_garage.launchers.jobqueue.scaling import JobRecord
    from hpc_garage.rundir import RunDir

    site = parse_site_dict({**jq_site(), "scheduler": scheduler})
    book = JobBook(site, "r1", job_shapes(site))
    book.rundir = RunDir(tmp_path / "7")
    text = book.failure_text(JobRecord(pool="default", name="default-0", job_id="12"))
    logs = tmp_path / "7" / "worker-logs"
    assert text.endswith(f"; see {logs}/hpcg-default-r1-12.out" if scheduler == "slurm" else
                         f"; see its log in {logs}")
