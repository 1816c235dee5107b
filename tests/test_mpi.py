"""The mpi launcher's pure parts: the launch command per launcher, which node a process is on, and what
each node process starts (the end-to-end runs are in test_run.py, on the real SLURM)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from hpc_garage.core.allocation import Allocation
from hpc_garage.core.request import Request
from hpc_garage.core.errors import UserError
from hpc_garage.launchers import common
from hpc_garage.launchers.common import forkserver_env, listening_host
from hpc_garage.prefect.preload import scheduler_preload, worker_preload
from hpc_garage.launchers.mpi import launcher_rank, node_index, node_workers, rank_command, rank_commands
from hpc_garage.core.layout import LayoutError, layout
from hpc_garage.sites import load_site

ARGV = ["python", "-m", "hpc_garage.launchers.mpi", "ranks.json"]


def two_node_plan(name: str, flavor: str | None = None, **request: int):  # noqa: ANN201
    site = load_site(name)
    if flavor:
        site = site.model_copy(update={"mpi": site.mpi.model_copy(update={"flavor": flavor})})
    return layout(site, Allocation.from_request(site, Request(nodes=2, **request)))


def test_srun_starts_one_process_per_node_with_every_core_its_workers_use() -> None:
    p = two_node_plan("lab-gpu")
    launch = rank_command(p, ARGV, in_slurm=True, nodefile=None)
    per_node = sum(w.resources["CPU"] for w in p.workers if w.node == 0)
    assert launch.argv[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1",
                               f"--cpus-per-task={int(per_node)}", "--kill-on-bad-exit=0"]
    assert launch.argv[-4:] == ARGV and launch.nodes == (0, 1)
    assert len([w for w in p.workers if w.node == 0]) == 4  # four workers behind that one process


def test_srun_gives_each_known_node_a_step_of_its_own_that_dies_alone() -> None:
    from dataclasses import replace

    p = two_node_plan("lab-gpu")
    hosts = tuple(replace(n, host=f"node{i + 1}") for i, n in enumerate(p.allocation.nodes))
    p = replace(p, allocation=replace(p.allocation, nodes=hosts), site=p.site.model_copy(
        update={"mpi": p.site.mpi.model_copy(update={"srun_args": ["--kill-on-bad-exit=1", "--exact"]})}))
    launches = rank_commands(p, ARGV, in_slurm=True, nodefile=None)
    assert [launch.nodes for launch in launches] == [(0,), (1,)]
    second = launches[1].argv
    assert second[:5] == ["srun", "--nodes=1", "--ntasks=1", "--nodelist=node2", "--cpus-per-task=8"]
    assert second[-5:] == [*ARGV, "1"]  # the node process is told its node
    assert second.index("--kill-on-bad-exit=0") > second.index("--kill-on-bad-exit=1")  # the site cannot undo it
    # hosts unknown: one launch for all nodes, as before
    assert len(rank_commands(two_node_plan("lab-gpu"), ARGV, in_slurm=True, nodefile=None)) == 1


def test_mpiexec_spellings_one_rank_per_node() -> None:
    openmpi = rank_command(two_node_plan("pbs-gpu", "openmpi"), ARGV, in_slurm=False, nodefile="/var/spool/nodes")
    assert openmpi.argv[:6] == ["mpiexec", "-n", "2", "--map-by", "ppr:1:node", "--bind-to"]
    assert openmpi.argv[openmpi.argv.index("--hostfile") + 1] == "/var/spool/nodes"
    assert "--enable-recovery" in openmpi.argv  # a rank that dies does not abort the others
    mpich = rank_command(two_node_plan("pbs-gpu", "mpich"), ARGV, in_slurm=False, nodefile="/var/spool/nodes")
    assert mpich.argv[:8] == ["mpiexec", "-n", "2", "-ppn", "1", "-disable-auto-cleanup", "-f", "/var/spool/nodes"]
    assert mpich.argv[-4:] == ARGV


@pytest.mark.parametrize(
    "name, hosts, rank, expected",
    [
        ("node2", ["node1", "node2"], None, 1),                       # by name
        ("nid001237.cluster", ["nid001236", "nid001237"], None, 1),   # short name matches the FQDN
        ("vm", ["vm", "vm"], 1, 1),                                   # one host, several batch nodes: by rank
        ("elsewhere", [None, None], 1, 1),                            # no names at all: by rank
        ("vm", ["vm", "other"], 1, 0),                                # a name match beats a stray rank
    ],
)
def test_a_node_process_finds_its_node(name: str, hosts: list, rank: int | None, expected: int) -> None:
    assert node_index(name, hosts, rank) == expected


def test_a_process_on_no_known_node_is_told_how_to_fix_it() -> None:
    with pytest.raises(UserError, match="'stranger' is not one of this job's nodes.*mpi.launch"):
        node_index("stranger", ["node1", "node2"], None)


def test_launcher_rank_variables() -> None:
    assert launcher_rank({"SLURM_NODEID": "3"}) == 3
    assert launcher_rank({"OMPI_COMM_WORLD_RANK": "1"}) == 1
    assert launcher_rank({"PMI_RANK": "0"}) == 0
    assert launcher_rank({"SLURM_NODEID": ""}) is None and launcher_rank({}) is None


def test_each_node_pins_its_own_gpu_ids_and_keeps_the_shared_environment() -> None:
    p = two_node_plan("lab-gpu", gpus_per_node=2)
    shared = {"PREFECT_API_URL": "http://x/api", "CUDA_VISIBLE_DEVICES": "should-be-overridden"}
    mine = node_workers(p.workers, 1, ["5", "7"], ("CUDA_VISIBLE_DEVICES",), shared)
    assert [w.node for w, _ in mine] == [1, 1]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in mine] == ["5", "7"]
    assert all(env["PREFECT_API_URL"] == "http://x/api" and env["OMP_NUM_THREADS"] for _, env in mine)
    with pytest.raises(LayoutError, match="shows only 1 GPUs"):
        node_workers(p.workers, 0, ["0"], ("CUDA_VISIBLE_DEVICES",), shared)


def test_the_forkserver_gets_the_shared_environment_and_the_smallest_thread_cap() -> None:
    p = two_node_plan("lab-gpu")
    env = forkserver_env({"A": "1"}, p.workers)
    assert env["A"] == "1"
    assert env["OMP_NUM_THREADS"] == str(min(int(w.env["OMP_NUM_THREADS"]) for w in p.workers))


def test_forked_workers_get_what_a_spawning_nanny_would_set_before_python_starts() -> None:
    import dask
    import distributed  # noqa: F401 - loads distributed's config defaults

    from hpc_garage.launchers.common import PRE_SPAWN_ENV

    dask_env = {k: str(v) for k, v in dask.config.get("distributed.nanny.pre-spawn-environ").items()}
    assert dask_env["MALLOC_TRIM_THRESHOLD_"] == PRE_SPAWN_ENV["MALLOC_TRIM_THRESHOLD_"]
    assert PRE_SPAWN_ENV["PYTHONHASHSEED"] == "6640"  # distributed.nanny's fixed seed
    env = forkserver_env({}, two_node_plan("lab-gpu").workers)
    assert env["PYTHONHASHSEED"] == "6640" and env["MALLOC_TRIM_THRESHOLD_"] == "65536"


def test_worker_preload_default_and_override() -> None:
    default = worker_preload({})
    assert default == ["distributed", "hpc_garage.prefect.worker"]  # prefect is installed here
    for module in default:  # each importable: the forkserver skips a failing one silently
        __import__(module)
    assert worker_preload({"HPC_GARAGE_WORKER_PRELOAD": "distributed, numpy"}) == ["distributed", "numpy"]
    assert worker_preload({"HPC_GARAGE_WORKER_PRELOAD": ""}) == []


def test_the_scheduler_preloads_prefect_only_when_the_workers_do() -> None:
    assert scheduler_preload({}) == ["prefect.flows", "hpc_garage.prefect.task_runner"]
    assert scheduler_preload({"HPC_GARAGE_WORKER_PRELOAD": "distributed"}) == []


def test_launchers_preload_what_run_names_and_know_no_prefect() -> None:
    """The node processes and worker jobs take their preload from the workers' environment, which `run` fills
    from what the CLI names (prefect/preload.py); without it, distributed alone."""
    assert common.worker_preload({}) == ["distributed"]
    assert common.worker_preload({"HPC_GARAGE_WORKER_PRELOAD": "distributed,hpc_garage.prefect.worker"}) == [
        "distributed", "hpc_garage.prefect.worker"]
    assert common.Preload().workers == ("distributed",) and common.Preload().scheduler == ()


def test_listening_host_agrees_with_distributed() -> None:
    from distributed.utils import get_ip, get_ip_interface

    assert listening_host({"interface": "lo"}) == get_ip_interface("lo") == "127.0.0.1"
    assert listening_host({"host": None}) == get_ip()
    assert listening_host({"host": "127.0.0.1"}) == "127.0.0.1"
    with pytest.raises(UserError, match="'nosuch0' does not exist on .*fix the site's interface"):
        listening_host({"interface": "nosuch0"})
    assert socket.gethostname()  # the message names this host


def test_large_clusters_get_longer_connect_timeouts_and_a_ttl_of_several_heartbeats() -> None:
    import dask

    from hpc_garage.launchers.common import CONNECT_SECONDS_MAX, LARGE_CLUSTER, cluster_settings, dask_environment

    defaults = {"distributed.comm.timeouts.connect": "30s", "distributed.scheduler.worker-ttl": "5 minutes"}
    assert cluster_settings(LARGE_CLUSTER, defaults.get) == {}  # Dask's own held there
    assert cluster_settings(1024, defaults.get) == {"distributed.comm.timeouts.connect": "102s"}
    huge = cluster_settings(32768, defaults.get)  # heartbeats every 32768/200 + 1 = 164.84 s
    assert huge == {"distributed.comm.timeouts.connect": f"{CONNECT_SECONDS_MAX:.0f}s",
                    "distributed.scheduler.worker-ttl": "824s"}
    users = {"distributed.comm.timeouts.connect": "20 minutes", "distributed.scheduler.worker-ttl": None}
    assert cluster_settings(32768, users.get) == {}  # a larger timeout, or no TTL at all, is the user's to keep
    variables = dask_environment(huge)
    assert variables == {"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "600s",
                         "DASK_DISTRIBUTED__SCHEDULER__WORKER_TTL": "824s"}
    read = dask.config.collect_env(variables)  # what a worker's dask reads from them
    assert read["distributed"]["comm"]["timeouts"]["connect"] == "600s"
    assert dask.config.get("distributed.scheduler.worker-ttl", config=read) == "824s"


def test_the_workers_profiler_is_off_unless_the_users_dask_config_sets_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import dask

    from hpc_garage.launchers.common import PROFILER_SETTING, dask_environment, profiler_settings

    monkeypatch.setattr(dask.config, "paths", [str(tmp_path)])  # the user's Dask YAML files: none yet
    assert profiler_settings({}) == {PROFILER_SETTING: False}
    read = dask.config.collect_env(dask_environment(profiler_settings({})))  # as a worker's dask reads it
    assert dask.config.get(PROFILER_SETTING, config=read) is False
    for value in ("True", "False"):  # set either way in a variable: left to it
        assert profiler_settings({"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": value}) == {}
    (tmp_path / "dask.yaml").write_text("distributed:\n  worker:\n    profile:\n      enabled: true\n")
    assert profiler_settings({}) == {}  # and in a file
    (tmp_path / "dask.yaml").write_text("distributed:\n  worker:\n    profile:\n      interval: 20ms\n")
    assert profiler_settings({}) == {PROFILER_SETTING: False}  # another profiler setting is not this one
