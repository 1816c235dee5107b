"""Allocation from requests and from job environments: real dumps from the local SLURM, and hand-written
ones modelled on documented variables of larger machines."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_garage.core.allocation import Allocation
from hpc_garage.core.request import Request
from hpc_garage.core.errors import AllocationError
from hpc_garage.schedulers import allocation_from_env, detect
from hpc_garage.schedulers.pbs import Pbs, parse_qstat_f
from hpc_garage.schedulers.hostlist import expand_counts, expand_hostlist
from hpc_garage.sites import load_site
from tests.conftest import DATA, read_env_dump

MIB, GIB = 2**20, 2**30


def dump(name: str) -> dict[str, str]:
    return read_env_dump(DATA / "env" / name)


# ------------------------------------------------------------------------------------------ hostlists


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-2]", ["node1", "node2"]),
        ("nid[001234-001237,001300]", ["nid001234", "nid001235", "nid001236", "nid001237", "nid001300"]),
        ("gpu-a100-[01-04]", ["gpu-a100-01", "gpu-a100-02", "gpu-a100-03", "gpu-a100-04"]),
        ("a[8-11],b1", ["a8", "a9", "a10", "a11", "b1"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("login1,c[09-10]", ["login1", "c09", "c10"]),
    ],
)
def test_hostlist_expands_like_scontrol(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["node[1-2", "node]1", "node[2-1]", "node[a-b]", ""])
def test_bad_hostlist(bad: str) -> None:
    with pytest.raises(AllocationError):
        expand_hostlist(bad)


def test_cpus_per_node_counts() -> None:
    assert expand_counts("72(x2),36") == [72, 72, 36]
    with pytest.raises(AllocationError, match="72x2"):
        expand_counts("72x2")


# ------------------------------------------------------------------------------------- real SLURM dumps


def test_slurm_one_node_two_gpus() -> None:
    a = allocation_from_env(load_site("lab-gpu"), dump("slurm-1node-2gpu.env"))
    assert a.job_id == "6" and a.source == "slurm"
    assert [n.host for n in a.nodes] == ["node1"]
    assert a.nodes[0].cores == 4 and a.nodes[0].memory == 4096 * MIB
    assert a.nodes[0].gpus == ("0", "1")
    assert a.walltime is None  # Slurm 22.05 exports no SLURM_JOB_END_TIME


def test_slurm_two_nodes() -> None:
    a = allocation_from_env(load_site("lab-gpu"), dump("slurm-2node-2gpu.env"))
    assert [n.host for n in a.nodes] == ["node1", "node2"]
    assert [n.cores for n in a.nodes] == [1, 1]
    assert all(n.memory == 2048 * MIB and n.gpus == ("0", "1") for n in a.nodes)


def test_slurm_second_concurrent_job_sees_its_own_gpus() -> None:
    a = allocation_from_env(load_site("lab-gpu"), dump("slurm-1node-2gpu-concurrent-second.env"))
    first = allocation_from_env(load_site("lab-gpu"), dump("slurm-1node-2gpu-concurrent-first.env"))
    assert set(a.nodes[0].gpus).isdisjoint(first.nodes[0].gpus)


def test_slurm_srun_task_uses_cgroup_relative_ids_not_job_gpus() -> None:
    env = dump("slurm-2node-2gpu-uneven-srun-node2.env")
    a = allocation_from_env(load_site("lab-gpu"), env)
    assert a.nodes[0].gpus == tuple(env["CUDA_VISIBLE_DEVICES"].split(","))


def test_slurm_mem_per_cpu_and_per_gpu() -> None:
    cpu = allocation_from_env(load_site("lab-cpu"), dump("slurm-cpu-mempercpu.env"))
    assert cpu.nodes[0].cores == 2 and cpu.nodes[0].memory == 2 * 1000 * MIB and cpu.nodes[0].gpus == ()
    gpu = allocation_from_env(load_site("lab-gpu"), dump("slurm-mempergpu.env"))
    assert gpu.nodes[0].memory == 3000 * MIB * len(gpu.nodes[0].gpus) == 3000 * MIB


# ------------------------------------------------------------------------------ hand-written SLURM envs


def big_machine_env(**extra: str) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "5",
        "SLURM_JOB_NODELIST": "nid[001234-001237,001300]",
        "SLURM_JOB_CPUS_PER_NODE": "72(x4),36",
        "SLURM_MEM_PER_NODE": "240000",
        "SLURM_GPUS_ON_NODE": "4",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "SLURM_JOB_GPUS": "4,5,6,7",
        "SLURM_JOB_START_TIME": "1700000000",
        "SLURM_JOB_END_TIME": "1700003600",
    }
    return env | extra


def test_slurm_heterogeneous_cpus_and_global_gpu_ids() -> None:
    a = allocation_from_env(load_site("slurm-gpu"), big_machine_env())
    assert [n.cores for n in a.nodes] == [72, 72, 72, 72, 36]
    assert a.nodes[-1].host == "nid001300"
    assert a.nodes[0].gpus == ("0", "1", "2", "3")  # as the job sees them, not SLURM_JOB_GPUS
    assert a.walltime == 3600 and a.end_time == 1700003600


@pytest.mark.parametrize(
    "devices",
    [
        "GPU-8f3a1c2e-1111-2222-3333-444455556666,GPU-9e2b0d1f-aaaa-bbbb-cccc-ddddeeeeffff,GPU-1,GPU-2",
        "MIG-4b1a2c3d-0000-1111-2222-333344445555,MIG-5c2b3d4e-0000-1111-2222-333344445555,MIG-a,MIG-b",
    ],
)
def test_gpu_uuids_are_kept_verbatim(devices: str) -> None:
    a = allocation_from_env(load_site("slurm-gpu"), big_machine_env(CUDA_VISIBLE_DEVICES=devices))
    assert a.nodes[0].gpus == tuple(devices.split(","))


@pytest.mark.parametrize(
    "change, variable",
    [
        ({"SLURM_JOB_NUM_NODES": "3"}, "SLURM_JOB_NUM_NODES"),
        ({"SLURM_GPUS_ON_NODE": "2"}, "SLURM_GPUS_ON_NODE"),
        ({"SLURM_JOB_GPUS": "4,5"}, "SLURM_JOB_GPUS"),
        ({"SLURM_JOB_CPUS_PER_NODE": "72(x2)"}, "SLURM_JOB_CPUS_PER_NODE"),
        ({"SLURM_JOB_NODELIST": "", "SLURM_NODELIST": ""}, "SLURM_NODELIST"),
        ({"SLURM_MEM_PER_NODE": "lots"}, "SLURM_MEM_PER_NODE"),
    ],
)
def test_contradictory_or_missing_slurm_variables_are_named(change: dict[str, str], variable: str) -> None:
    with pytest.raises(AllocationError, match=variable):
        allocation_from_env(load_site("slurm-gpu"), big_machine_env(**change))


def test_missing_cores_is_an_error_not_a_guess() -> None:
    env = big_machine_env()
    del env["SLURM_JOB_CPUS_PER_NODE"]
    with pytest.raises(AllocationError, match="SLURM_CPUS_ON_NODE"):
        allocation_from_env(load_site("slurm-gpu"), env)


def test_missing_memory_falls_back_to_the_enforced_limit_then_the_site(monkeypatch: pytest.MonkeyPatch) -> None:
    import hpc_garage.schedulers.base as base

    env = big_machine_env()
    del env["SLURM_MEM_PER_NODE"]
    monkeypatch.setattr(base, "process_memory_limit", lambda: None)
    a = allocation_from_env(load_site("slurm-gpu"), env)
    assert a.nodes[0].memory == load_site("slurm-gpu").node.memory
    assert any("SLURM_MEM_PER_NODE" in n and "node.memory" in n for n in a.notes)
    monkeypatch.setattr(base, "process_memory_limit", lambda: 100 * GIB)
    b = allocation_from_env(load_site("slurm-gpu"), env)
    assert b.nodes[0].memory == 100 * GIB and any("enforced" in n for n in b.notes)


def test_outside_a_job_is_an_error() -> None:
    with pytest.raises(AllocationError, match="SLURM_JOB_ID"):
        allocation_from_env(load_site("slurm-gpu"), {"HOME": "/root"})


# ----------------------------------------------------------------------------------------------- PBS

PBS_PRO_QSTAT = """Job Id: 1234.pbs01
    Job_Name = sweep
    job_state = R
    Resource_List.mem = 360gb
    Resource_List.ncpus = 72
    Resource_List.ngpus = 8
    Resource_List.nodect = 2
    Resource_List.select = 2:ncpus=36:mem=180gb:ngpus=4:mpiprocs=4
    Resource_List.walltime = 02:00:00
    Variable_List = PBS_O_HOME=/home/u,PBS_O_LANG=en_US.UTF-8,
\tPBS_O_LOGNAME=u,PBS_O_WORKDIR=/home/u/sweeps
"""


def pbs_env(tmp_path: Path, lines: list[str], **extra: str) -> dict[str, str]:
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("\n".join(lines) + "\n")
    return {"PBS_JOBID": "1234.pbs01", "PBS_NODEFILE": str(nodefile)} | extra


def test_pbs_pro_job_with_uuid_gpus(tmp_path: Path) -> None:
    uuids = "GPU-0a,GPU-0b,GPU-0c,GPU-0d"
    env = pbs_env(tmp_path, ["x1001"] * 4 + ["x1002"] * 4, NCPUS="36", CUDA_VISIBLE_DEVICES=uuids)
    a = Pbs().allocation_from_env(env, load_site("pbs-gpu"), qstat_f=lambda job: PBS_PRO_QSTAT)
    assert [n.host for n in a.nodes] == ["x1001", "x1002"]  # one line per rank, unique hosts
    assert all(n.cores == 36 and n.memory == 180 * GIB for n in a.nodes)
    assert a.nodes[0].gpus == tuple(uuids.split(","))
    assert a.walltime == 7200 and a.job_id == "1234.pbs01"


def test_pbs_torque_gpufile_and_ppn(tmp_path: Path) -> None:
    gpufile = tmp_path / "gpufile"
    gpufile.write_text("t01-gpu0\nt01-gpu1\nt02-gpu0\nt02-gpu1\n")
    env = pbs_env(tmp_path, ["t01"] * 16 + ["t02"] * 16, PBS_NUM_NODES="2", PBS_NUM_PPN="16",
                  PBS_GPUFILE=str(gpufile))
    a = Pbs().allocation_from_env(env, load_site("pbs-gpu"), qstat_f=lambda job: "")
    assert [n.cores for n in a.nodes] == [16, 16]
    assert a.nodes[0].gpus == ("0", "1")
    assert any("qstat -f" in n for n in a.notes)  # no memory in qstat: assumed, and said out loud


def test_pbs_from_the_local_torque_wrapper(tmp_path: Path) -> None:
    env = {k: v for k, v in dump("pbs-qsub.env").items() if not k.startswith("SLURM")}
    env |= pbs_env(tmp_path, ["node1", "node1"], NCPUS="2", CUDA_VISIBLE_DEVICES="0,1")  # naccelerators=2
    assert isinstance(detect(env, prefer="pbs"), Pbs)
    # the job has ended: `qstat -f` knows it no more (asked for real, it answers so at once, or after 9 s
    # where no controller answers)
    a = Pbs().allocation_from_env(env | {"PBS_JOBID": env["PBS_JOBID"]}, load_site("lab-pbs"), qstat_f=lambda job: "")
    assert a.source == "pbs" and a.nodes[0].cores == 2 and a.nodes[0].host == "node1"
    assert a.nodes[0].gpus == ("0", "1")


def test_qstat_f_of_the_torque_wrapper_is_read() -> None:
    info = parse_qstat_f((DATA / "qstat-f.txt").read_text())
    assert info["Resource_List.walltime"] == "00:10:00" and info["Resource_List.ncpus"] == "2"
    assert parse_qstat_f(PBS_PRO_QSTAT)["Variable_List"].endswith("PBS_O_WORKDIR=/home/u/sweeps")


@pytest.mark.parametrize(
    "change, variable",
    [
        ({"PBS_NODEFILE": ""}, "PBS_NODEFILE"),
        ({"PBS_NUM_NODES": "3"}, "PBS_NUM_NODES"),
        ({"NCPUS": ""}, "NCPUS"),
    ],
)
def test_pbs_missing_or_contradictory(tmp_path: Path, change: dict[str, str], variable: str) -> None:
    env = pbs_env(tmp_path, ["a", "b"], NCPUS="8") | change
    with pytest.raises(AllocationError, match=variable):
        Pbs().allocation_from_env(env, load_site("pbs-cpu"), qstat_f=lambda job: "")


def test_slurm_wins_inside_slurm_for_a_slurm_site_even_with_torque_variables() -> None:
    env = dump("pbs-qsub.env")  # Slurm's spank_pbs plugin sets PBS_JOBID inside Slurm jobs too (a job without GPUs)
    assert allocation_from_env(load_site("lab-cpu"), env).source == "slurm"


# ------------------------------------------------------------------------------------------- requests


def test_request_defaults_to_whole_nodes() -> None:
    a = Allocation.from_request(load_site("slurm-gpu"), Request(nodes=2))
    assert len(a.nodes) == 2 and a.nodes[0].gpus == ("0", "1", "2", "3") and a.nodes[0].cores == 32


def test_part_of_a_gpu_node_brings_the_same_part_of_cores_and_memory() -> None:
    a = Allocation.from_request(load_site("slurm-gpu"), Request(gpus_per_node=1))
    assert a.nodes[0].cores == 8 and a.nodes[0].memory == 64 * GIB and a.nodes[0].gpus == ("0",)
    b = Allocation.from_request(load_site("slurm-gpu"), Request(gpus_per_node=2, cores_per_node=32))
    assert b.nodes[0].cores == 32 and b.nodes[0].memory == 128 * GIB


@pytest.mark.parametrize(
    "request_, message",
    [
        ({"gpus_per_node": 5}, "--gpus-per-node 5"),
        ({"nodes": 17}, "limits.max_nodes"),
        ({"nodes": 0}, "at least 1"),
        ({"cores_per_node": 33}, "--cores-per-node 33"),
        ({"memory": 300 * GIB}, "--mem"),
        ({"walltime": 2 * 86400}, "limits.max_walltime"),
    ],
)
def test_impossible_requests_are_refused(request_: dict, message: str) -> None:
    with pytest.raises(AllocationError, match=message):
        Allocation.from_request(load_site("slurm-gpu"), Request(**request_))
