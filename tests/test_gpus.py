"""GPUs on every vendor: each worker sees exactly its own GPUs after the vendor runtime's own masking, the
job's GPU list is checked (never guessed), and workers are bound to cores next to their GPU.

The vendors' masking rules are modelled here, independently of hpc_garage.core.gpus, from their documentation:
CUDA (CUDA_VISIBLE_DEVICES: positions, UUIDs or unique prefixes, MIG instances; an invalid entry ends the
list), ROCm (ROCR_VISIBLE_DEVICES first; then HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES / GPU_DEVICE_ORDINAL
index into what is left, in an order that differs between runtimes, so every plausible order is checked),
Level Zero (ZE_AFFINITY_MASK: devices and tiles; entries past the node's devices are ignored). Real GPUs are
checked at the end of this file where the machine has one (skipped elsewhere).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_garage.core import gpus
from hpc_garage.core.allocation import Allocation, NodeAllocation
from hpc_garage.core.errors import AllocationError, LayoutError, UserError
from hpc_garage.core.layout import WorkerSpec, bind_node, describe, layout
from hpc_garage.core.request import Request
from hpc_garage.core.site import Site, parse_site_dict
from hpc_garage.launchers import topology
from hpc_garage.launchers.common import node_gpus, worker_options
from hpc_garage.schedulers.pbs import Pbs
from hpc_garage.schedulers.slurm import Slurm
from tests.conftest import DATA

GIB = 2**30
SYSFS = DATA / "sysfs"
PY = sys.executable


# ------------------------------------------------------------------------------------ the vendors' masking


@dataclass(frozen=True)
class Phys:
    """One physical GPU of a modelled node."""

    name: str
    uuid: str
    migs: tuple[str, ...] = ()


def node_gpus_model(n: int) -> list[Phys]:
    return [Phys(f"P{k}", f"GPU-{k:02d}c0ffee-{k:04x}", (f"MIG-{k:02d}a", f"MIG-{k:02d}b")) for k in range(n)]


def cuda_sees(phys: list[Phys], env: dict[str, str]) -> list[str]:
    """What a CUDA process sees: positions, UUIDs (or a unique prefix), MIG instances; the first invalid or
    repeated entry ends the list; an empty value shows nothing; one MIG instance per process."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return [p.name for p in phys]
    seen: list[str] = []
    for tok in (t.strip() for t in value.split(",")):
        if tok.isdigit():
            if int(tok) >= len(phys):
                break
            device = phys[int(tok)].name
        elif tok.startswith("MIG-"):
            found = [f"{p.name}/{m}" for p in phys for m in p.migs if m == tok]
            if not found:
                break
            device = found[0]
        elif tok.startswith("GPU-"):
            found = [p.name for p in phys if p.uuid.startswith(tok)]
            if len(found) != 1:
                break
            device = found[0]
        else:
            break
        if device in seen:
            break
        seen.append(device)
    migs = [d for d in seen if "/" in d]
    return [d for d in seen if "/" not in d or d == migs[0]]


def _rocm_stage(devices: list[Phys], value: str) -> list[Phys]:
    out: list[Phys] = []
    for tok in (t.strip() for t in value.split(",")):
        if tok.isdigit() and int(tok) < len(devices):
            device = devices[int(tok)]
        elif tok.startswith("GPU-") and [d for d in devices if d.uuid == tok]:
            device = next(d for d in devices if d.uuid == tok)
        else:
            break  # an invalid entry ends the list
        if device in out:
            break
        out.append(device)
    return out


ROCM_ORDERS = ("HIP, then CUDA, then GPU_DEVICE_ORDINAL", "GPU_DEVICE_ORDINAL, then HIP or CUDA",
               "CUDA, then HIP, then GPU_DEVICE_ORDINAL")


def rocm_sees(phys: list[Phys], env: dict[str, str], order: str) -> list[str]:
    """ROCr applies ROCR_VISIBLE_DEVICES (an empty value is read as unset by some ROCm versions: modelled so,
    the worse case); then the later stage indexes into what is left, in one of the plausible `order`s."""
    devices = list(phys)
    if env.get("ROCR_VISIBLE_DEVICES"):
        devices = _rocm_stage(devices, env["ROCR_VISIBLE_DEVICES"])
    hip, cuda, ordinal = (env.get(v) or None for v in ("HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
                                                       "GPU_DEVICE_ORDINAL"))
    if order == ROCM_ORDERS[1]:
        if ordinal:
            devices = _rocm_stage(devices, ordinal)
        chosen = hip or cuda
    else:
        chosen = (hip or cuda or ordinal) if order == ROCM_ORDERS[0] else (cuda or hip or ordinal)
    if chosen:
        devices = _rocm_stage(devices, chosen)
    return [d.name for d in devices]


def ze_sees(devices: int, tiles: int, env: dict[str, str]) -> set[tuple[int, int | None]]:
    """Level Zero: ZE_AFFINITY_MASK lists devices `d` and tiles `d.t`; entries past the node are ignored;
    an empty or unset mask shows every device."""
    mask = env.get("ZE_AFFINITY_MASK", "")
    if not mask:
        return {(d, None) for d in range(devices)}
    seen: set[tuple[int, int | None]] = set()
    for tok in mask.split(","):
        m = re.fullmatch(r"(\d+)(?:\.(\d+))?", tok.strip())
        if m and int(m.group(1)) < devices and (m.group(2) is None or int(m.group(2)) < tiles):
            seen.add((int(m.group(1)), None if m.group(2) is None else int(m.group(2))))
    return seen


def ze_id(entry: str) -> tuple[int, int | None]:
    d, _, t = entry.partition(".")
    return int(d), int(t) if t else None


def test_the_models_reproduce_the_failures_of_the_issue() -> None:
    """The old AMD rule (ROCR_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES both = the physical id) leaves every
    worker but the first without a GPU, whatever order the runtime reads the later stage in."""
    phys = node_gpus_model(8)
    for order in ROCM_ORDERS:
        assert rocm_sees(phys, {"ROCR_VISIBLE_DEVICES": "5", "CUDA_VISIBLE_DEVICES": "5"}, order) == []
        assert rocm_sees(phys, {"ROCR_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "0"}, order) == ["P0"]
        assert rocm_sees(phys, gpus.worker_env("amd", ["5"]), order) == ["P5"]
        assert rocm_sees(phys, gpus.worker_env("amd", []), order) == []  # -1: an id no node has
    assert cuda_sees(phys, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert ze_sees(8, 2, {"ZE_AFFINITY_MASK": "-1"}) == set()


# ---------------------------------------------------------------------------- every worker, every vendor


@st.composite
def jobs(draw: st.DrawFn) -> dict[str, Any]:
    """A node of `n` GPUs, the job's own GPU variables as its batch system (or a user) writes them, and how
    its workers are cut."""
    vendor = draw(st.sampled_from(gpus.VENDORS))
    n = draw(st.integers(1, 8))
    phys = node_gpus_model(n)
    mine = draw(st.permutations(range(n)).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: p[:k])))
    env: dict[str, str] = {}
    shape = ""
    if vendor == "nvidia":
        shape = draw(st.sampled_from(["ints", "uuids", "prefixes", "mig"]))
        spell = {"ints": lambda k: str(k), "uuids": lambda k: phys[k].uuid, "prefixes": lambda k: phys[k].uuid[:6],
                 "mig": lambda k: phys[k].migs[0]}[shape]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spell(k) for k in mine)
    elif vendor == "amd":
        shape = draw(st.sampled_from(["rocr", "rocr uuids", "slurm default", "hip only", "rocr then hip"]))
        listed = ",".join(str(k) for k in mine)
        if shape == "rocr":
            env["ROCR_VISIBLE_DEVICES"] = listed
        elif shape == "rocr uuids":
            env["ROCR_VISIBLE_DEVICES"] = ",".join(phys[k].uuid for k in mine)
        elif shape == "slurm default":  # Slurm without gres flags writes the same list everywhere
            env |= {v: listed for v in ("ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")}
        elif shape == "hip only":
            env["HIP_VISIBLE_DEVICES"] = listed
        else:  # the job keeps some of the GPUs ROCr shows it: positions within ROCR_VISIBLE_DEVICES
            env["ROCR_VISIBLE_DEVICES"] = ",".join(str(k) for k in range(n))
            env["HIP_VISIBLE_DEVICES"] = listed
    else:
        shape = draw(st.sampled_from(["devices", "tiles"]))
        if shape == "devices":
            env["ZE_AFFINITY_MASK"] = ",".join(str(k) for k in mine)
        else:
            env["ZE_AFFINITY_MASK"] = ",".join(f"{k}.{t}" for k in mine for t in (0, 1))
    per = draw(st.sampled_from(["gpu", "process"]))
    processes = draw(st.integers(1, 4))
    return {"vendor": vendor, "n": n, "env": env, "shape": shape, "per": per, "processes": processes,
            "mine": mine}


def sees(vendor: str, n: int, env: dict[str, str], order: str = ROCM_ORDERS[0]) -> list[Any]:
    if vendor == "nvidia":
        return cuda_sees(node_gpus_model(n), env)
    if vendor == "amd":
        return rocm_sees(node_gpus_model(n), env, order)
    return sorted(ze_sees(n, 2, env), key=str)


@settings(max_examples=400, deadline=None)
@given(jobs())
def test_every_worker_sees_exactly_its_own_gpus_after_the_vendors_masking(job: dict[str, Any]) -> None:
    vendor, n, env = job["vendor"], job["n"], job["env"]
    listed = gpus.job_gpus(vendor, env)
    ids = listed.ids
    # the job's own list, read as the runtime reads it
    if vendor == "intel":
        assert {ze_id(i) for i in ids} == ze_sees(n, 2, env)
    elif job["shape"] not in ("slurm default", "mig"):  # there the job itself sees less: HIP reads 4,5 in a
        # 2-GPU list; CUDA shows a process one MIG instance (its workers, each its own, see theirs)
        assert len(ids) == len(sees(vendor, n, env)) == len(set(ids))
    per, processes = job["per"], job["processes"]
    if vendor == "nvidia" and job["shape"] == "mig" and per == "process" and len(ids) // processes > 1:
        with pytest.raises(LayoutError, match="MIG"):
            layout_for(vendor, ids, per, processes).workers
        return
    workers = layout_for(vendor, ids, per, processes).workers
    expected_union: list[Any] = []
    for w in workers:
        worker_env = {**env, **w.env}  # a worker inherits the job's environment; its own variables win
        own = [ids[s] for s in w.gpu_slots]
        for order in ROCM_ORDERS if vendor == "amd" else ROCM_ORDERS[:1]:
            got = sees(vendor, n, worker_env, order)
            if vendor == "intel":
                assert set(got) == {ze_id(i) for i in own}, (w.env, own)
            elif vendor == "amd":
                assert got == [physical_amd(i, n) for i in own], (env, w.env, own, order)
            else:
                assert got == [physical_nvidia(i, n) for i in own], (env, w.env, own)
        expected_union += own
    assert len(expected_union) == len(set(expected_union))  # no GPU given to two workers


def physical_nvidia(gpu_id: str, n: int) -> str:
    phys = node_gpus_model(n)
    if gpu_id.isdigit():
        return phys[int(gpu_id)].name
    if gpu_id.startswith("MIG-"):
        return next(f"{p.name}/{m}" for p in phys for m in p.migs if m == gpu_id)
    return next(p.name for p in phys if p.uuid.startswith(gpu_id))


def physical_amd(gpu_id: str, n: int) -> str:
    phys = node_gpus_model(n)
    return phys[int(gpu_id)].name if gpu_id.isdigit() else next(p.name for p in phys if p.uuid == gpu_id)


def vendor_site(vendor: str, gpus_: int = 8, per: str = "gpu", processes: int = 1, **workers: Any) -> Site:
    return parse_site_dict({"name": f"{vendor}{gpus_}", "scheduler": "slurm",
                            "node": {"cores": 64, "memory": "512GiB", "gpus": gpus_, "gpu_vendor": vendor},
                            "workers": {"per": per, **({"processes": processes} if per == "process" else {}),
                                        **workers}})


def layout_for(vendor: str, ids: tuple[str, ...], per: str, processes: int) -> Any:
    s = vendor_site(vendor, max(1, len(ids)), per, processes)
    return layout(s, Allocation(nodes=(NodeAllocation(64, 512 * GIB, ids, "n1"),)))


# ------------------------------------------------------------------------------------- the job's GPU list


def slurm_env(**extra: str) -> dict[str, str]:
    return {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "nid000001", "SLURM_JOB_NUM_NODES": "1",
            "SLURM_JOB_CPUS_PER_NODE": "64", "SLURM_MEM_PER_NODE": "500000"} | extra


@pytest.mark.parametrize("vendor, env, fragment", [
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "", "SLURM_GPUS_ON_NODE": "4"}, "CUDA_VISIBLE_DEVICES= lists none"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "NoDevFiles", "SLURM_GPUS_ON_NODE": "4"},
     "CUDA_VISIBLE_DEVICES=NoDevFiles lists none"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "0,,1", "SLURM_GPUS_ON_NODE": "3"}, "CUDA_VISIBLE_DEVICES=0,,1 has an empty"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "0,1,1,2", "SLURM_GPUS_ON_NODE": "4"},
     "CUDA_VISIBLE_DEVICES=0,1,1,2 lists GPU 1 twice"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "1,01"}, "CUDA_VISIBLE_DEVICES=1,01 lists GPU 1 twice"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "gpu0,gpu1"}, "CUDA_VISIBLE_DEVICES=gpu0,gpu1: 'gpu0' is not a GPU id"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "-1"}, "CUDA_VISIBLE_DEVICES=-1: '-1' is not a GPU id"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "0,1,2", "SLURM_GPUS_ON_NODE": "4"},
     "CUDA_VISIBLE_DEVICES=0,1,2 lists 3 GPUs but SLURM_GPUS_ON_NODE=4"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "0,1", "SLURM_STEP_GPUS": "4,5,6"},
     "CUDA_VISIBLE_DEVICES=0,1 lists 2 GPUs but SLURM_STEP_GPUS=4,5,6 lists 3"),
    ("nvidia", {"SLURM_GPUS_ON_NODE": "4"}, "the job has GPUs \\(SLURM_GPUS_ON_NODE=4\\) but no CUDA_VISIBLE_DEVICES"),
    ("nvidia", {"SLURM_GPUS_ON_NODE": "8", "ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
     "ROCR_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 is set: is the site's node.gpu_vendor amd"),
    ("nvidia", {}, "site nvidia8 says its nodes have 8 GPUs \\(node.gpus\\) but this job has no GPUs"),
    ("nvidia", {"CUDA_VISIBLE_DEVICES": "", "SLURM_GPUS_ON_NODE": "0"}, "this job has no GPUs \\(CUDA_VISIBLE_DEVICES=\\)"),
    ("amd", {"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "2"},
     "HIP_VISIBLE_DEVICES=2 asks for GPU 2 of the 2 that ROCR_VISIBLE_DEVICES=0,1 leaves"),
    ("amd", {"HIP_VISIBLE_DEVICES": "0", "CUDA_VISIBLE_DEVICES": "1"},
     "HIP_VISIBLE_DEVICES=0 and CUDA_VISIBLE_DEVICES=1 disagree"),
    ("amd", {"ROCR_VISIBLE_DEVICES": "0,1", "HIP_VISIBLE_DEVICES": "1,1"}, "HIP_VISIBLE_DEVICES=1,1 lists GPU 1 twice"),
    ("amd", {"ROCR_VISIBLE_DEVICES": "GPU-aa,GPU-bb", "HIP_VISIBLE_DEVICES": "GPU-cc"},
     "HIP_VISIBLE_DEVICES=GPU-cc names GPU-cc, which ROCR_VISIBLE_DEVICES=GPU-aa,GPU-bb hides"),
    ("amd", {"ROCR_VISIBLE_DEVICES": "0,x"}, "ROCR_VISIBLE_DEVICES=0,x: 'x' is not a GPU id"),
    ("amd", {"ROCR_VISIBLE_DEVICES": "4,5", "SLURM_GPUS_ON_NODE": "4"},
     "ROCR_VISIBLE_DEVICES=4,5 lists 2 GPUs but SLURM_GPUS_ON_NODE=4"),
    ("intel", {"ZE_AFFINITY_MASK": "0,0.1"}, "ZE_AFFINITY_MASK=0,0.1 lists tile 0.1 and its whole device 0"),
    ("intel", {"ZE_AFFINITY_MASK": "0.1,0.1"}, "ZE_AFFINITY_MASK=0.1,0.1 lists GPU 0.1 twice"),
    ("intel", {"ZE_AFFINITY_MASK": "0,1", "ONEAPI_DEVICE_SELECTOR": "level_zero:1"},
     "ONEAPI_DEVICE_SELECTOR=level_zero:1 selects GPUs by number"),
])
def test_a_malformed_gpu_list_is_refused_in_one_line_naming_the_variable(vendor: str, env: dict[str, str],
                                                                          fragment: str) -> None:
    with pytest.raises(AllocationError, match=fragment) as caught:
        Slurm().allocation_from_env(slurm_env(**env), vendor_site(vendor))
    assert "\n" not in str(caught.value)


def test_the_right_lists_are_read_per_vendor() -> None:
    def read(vendor: str, **env: str) -> tuple[str, ...]:
        return Slurm().allocation_from_env(slurm_env(**env), vendor_site(vendor)).nodes[0].gpus

    eight = ",".join(map(str, range(8)))
    assert read("amd", ROCR_VISIBLE_DEVICES=eight, SLURM_GPUS_ON_NODE="8") == tuple(eight.split(","))  # Frontier, LUMI
    assert read("amd", ROCR_VISIBLE_DEVICES="4,5,6,7", CUDA_VISIBLE_DEVICES="4,5,6,7",
                GPU_DEVICE_ORDINAL="4,5,6,7") == ("4", "5", "6", "7")  # Slurm's default: one list, written thrice
    assert read("amd", ROCR_VISIBLE_DEVICES="2,3,6,7", HIP_VISIBLE_DEVICES="1,3") == ("3", "7")
    assert read("amd", HIP_VISIBLE_DEVICES="1,3") == ("1", "3")
    assert read("intel", ZE_AFFINITY_MASK="0.0,0.1,3", SLURM_GPUS_ON_NODE="3") == ("0.0", "0.1", "3")
    assert read("intel", ZE_AFFINITY_MASK="2", ONEAPI_DEVICE_SELECTOR="level_zero:gpu") == ("2",)
    uuids = "GPU-8f3a1c2e-1111-2222-3333-444455556666,MIG-4b1a2c3d-0000-1111-2222-333344445555"
    assert read("nvidia", CUDA_VISIBLE_DEVICES=uuids) == tuple(uuids.split(","))
    # the local SLURM writes every vendor's variable; an NVIDIA site reads only its own
    assert read("nvidia", CUDA_VISIBLE_DEVICES="2,3", ROCR_VISIBLE_DEVICES="2,3", SLURM_JOB_GPUS="2,3") == ("2", "3")


def test_a_cpu_job_on_a_cpu_site_may_inherit_an_empty_list() -> None:
    site = parse_site_dict({"name": "c", "scheduler": "slurm", "node": {"cores": 64, "memory": "512GiB"}})
    a = Slurm().allocation_from_env(slurm_env(CUDA_VISIBLE_DEVICES="", SLURM_GPUS_ON_NODE="0"), site)
    assert a.nodes[0].gpus == ()


def test_a_jobqueue_pool_without_gpus_on_a_gpu_node_expects_none() -> None:
    site = parse_site_dict({"name": "q", "scheduler": "slurm", "launcher": "jobqueue", "queue": "q",
                            "node": {"cores": 8, "memory": "15GiB", "gpus": 4}, "workers": {"per": "node"},
                            "jobqueue": {"gpus_per_job": 0}})
    assert Slurm().allocation_from_env(slurm_env(SLURM_JOB_CPUS_PER_NODE="8"), site).nodes[0].gpus == ()


def test_pbs_gpu_lists_are_checked_against_qstat_and_the_gpu_file(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x1\n")
    env = {"PBS_JOBID": "1.pbs", "PBS_NODEFILE": str(nodefile), "NCPUS": "64"}
    qstat = "Job Id: 1.pbs\n    Resource_List.select = 1:ncpus=64:mem=500gb:ngpus=4\n"
    site = vendor_site("nvidia", 4)
    with pytest.raises(AllocationError, match="CUDA_VISIBLE_DEVICES=0,1 lists 2 GPUs but qstat -f Resource_List.select"):
        Pbs().allocation_from_env(env | {"CUDA_VISIBLE_DEVICES": "0,1"}, site, qstat_f=lambda job: qstat)
    assert Pbs().allocation_from_env(env | {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, site,
                                     qstat_f=lambda job: qstat).nodes[0].gpus == ("0", "1", "2", "3")
    gpufile = tmp_path / "gpus"
    gpufile.write_text("x1-gpu0\nx1-gpu1\nx1-gpu1\n")
    with pytest.raises(AllocationError, match="PBS_GPUFILE=.* lists x1-gpu1 twice"):
        Pbs().allocation_from_env(env | {"PBS_GPUFILE": str(gpufile)}, site, qstat_f=lambda job: "")
    gpufile.write_text("x1-gpu0\nx1-gpu1\nx1-gpu2\nx1-gpu3\n")
    assert Pbs().allocation_from_env(env | {"PBS_GPUFILE": str(gpufile)}, site,
                                     qstat_f=lambda job: qstat).nodes[0].gpus == ("0", "1", "2", "3")


def test_each_node_reads_and_checks_its_own_list() -> None:
    assert node_gpus({"ROCR_VISIBLE_DEVICES": "4,5"}, "amd") == ["4", "5"]
    assert node_gpus({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}) == []
    with pytest.raises(UserError, match="CUDA_VISIBLE_DEVICES=3,3 lists GPU 3 twice"):
        node_gpus({"CUDA_VISIBLE_DEVICES": "3,3"})


# --------------------------------------------------------------------------- `show --json`, as users run it


def write_site(site_dir: Path, vendor: str, gpus_: int = 8) -> str:
    name = f"{vendor}{gpus_}"
    (site_dir / f"{name}.yaml").write_text(textwrap.dedent(f"""\
        scheduler: slurm
        queue: gpu
        node: {{cores: 64, memory: 512GiB, gpus: {gpus_}, gpu_vendor: {vendor}}}
        workers: {{per: gpu}}
        """))
    return name


def show(args: list[str], env: dict[str, str], site_dir: Path) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM", "PBS_", "HPC_GARAGE")) and k not in gpus.VARIABLES["amd"] + (gpus.ZE,)}
    return subprocess.run([PY, "-m", "hpc_garage", "show", *args], capture_output=True, text=True, timeout=60,
                          env=base | {"HPC_GARAGE_SITES_PATH": str(site_dir)} | env)


def shown_workers(done: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["workers"]


@pytest.mark.parametrize("job_env", [
    {},  # a request
    {"ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "SLURM_GPUS_ON_NODE": "8"},  # Frontier and LUMI
    {v: "0,1,2,3,4,5,6,7" for v in ("ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")},
], ids=["request", "ROCR_VISIBLE_DEVICES", "slurm-default"])
def test_show_json_on_an_8_gpu_amd_node_gives_each_worker_exactly_its_gpu(site_dir: Path,
                                                                          job_env: dict[str, str]) -> None:
    name = write_site(site_dir, "amd")
    env = slurm_env(**job_env) if job_env else {}
    workers = shown_workers(show(["--site", name, "--json"], env, site_dir))
    assert len(workers) == 8
    for k, w in enumerate(workers):
        for order in ROCM_ORDERS:
            assert rocm_sees(node_gpus_model(8), {**job_env, **w["env"]}, order) == [f"P{k}"], (w["env"], order)


def test_show_json_amd_job_given_half_a_node_by_slurm_default_env(site_dir: Path) -> None:
    """Slurm writes 4,5,6,7 into ROCR_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES: HIP then asks for position 4
    of four, and the job itself sees no GPU; its workers each see their own."""
    half = {v: "4,5,6,7" for v in ("ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "GPU_DEVICE_ORDINAL")}
    assert rocm_sees(node_gpus_model(8), half, ROCM_ORDERS[0]) == []
    workers = shown_workers(show(["--site", write_site(site_dir, "amd"), "--json"],
                                 slurm_env(SLURM_GPUS_ON_NODE="4", **half), site_dir))
    assert [rocm_sees(node_gpus_model(8), {**half, **w["env"]}, o) for w in workers for o in ROCM_ORDERS] == \
        [[f"P{k}"] for k in (4, 5, 6, 7) for _ in ROCM_ORDERS]


@pytest.mark.parametrize("job_env", [{}, {"ZE_AFFINITY_MASK": "0,1,2,3,4,5,6,7", "SLURM_GPUS_ON_NODE": "8"},
                                     {"ZE_AFFINITY_MASK": "0.0,0.1,1.0,1.1,2.0,2.1,3.0,3.1"}],
                         ids=["request", "devices", "tiles"])
def test_show_json_on_an_8_gpu_intel_node(site_dir: Path, job_env: dict[str, str]) -> None:
    workers = shown_workers(show(["--site", write_site(site_dir, "intel"), "--json"],
                                 slurm_env(**job_env) if job_env else {}, site_dir))
    expected = job_env.get("ZE_AFFINITY_MASK", "0,1,2,3,4,5,6,7").split(",")
    assert [ze_sees(8, 2, {**job_env, **w["env"]}) for w in workers] == [{ze_id(e)} for e in expected]


@pytest.mark.parametrize("kind", ["uuids", "mig"])
def test_show_json_nvidia_uuids_and_mig_instances(site_dir: Path, kind: str) -> None:
    phys = node_gpus_model(8)
    ids = [p.uuid for p in phys] if kind == "uuids" else [m for p in phys[:4] for m in p.migs]
    job_env = {"CUDA_VISIBLE_DEVICES": ",".join(ids), "SLURM_GPUS_ON_NODE": "8"}
    workers = shown_workers(show(["--site", write_site(site_dir, "nvidia"), "--json"], slurm_env(**job_env),
                                 site_dir))
    assert len(workers) == 8  # one worker per MIG instance when the job's list names instances
    assert [cuda_sees(phys, {**job_env, **w["env"]}) for w in workers] == [[physical_nvidia(i, 8)] for i in ids]


@pytest.mark.parametrize("value", ["0,0,1,2", "", "NoDevFiles", "0,,1,2", "a,b,c,d"])
def test_show_refuses_a_malformed_list_in_one_line_before_anything_starts(site_dir: Path, value: str) -> None:
    done = show(["--site", write_site(site_dir, "nvidia", 4)],
                slurm_env(CUDA_VISIBLE_DEVICES=value, SLURM_GPUS_ON_NODE="4"), site_dir)
    assert done.returncode == 2 and done.stdout == ""
    line = done.stderr.strip()
    assert "\n" not in line and line.startswith("hpc-garage: error: ") and f"CUDA_VISIBLE_DEVICES={value}" in line


# ---------------------------------------------------------------------------------------------- CPU binding


def test_cpulists() -> None:
    assert gpus.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert gpus.format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    with pytest.raises(ValueError):
        gpus.parse_cpulist("3-1")


@st.composite
def machines(draw: st.DrawFn) -> tuple[list[int], list[tuple[str, ...]], gpus.Topology, dict[str, int]]:
    """A node of 1-4 sockets, each with some GPUs; hyperthreads numbered as Linux does (sibling of CPU c is
    c + all cores); the job allowed all CPUs, one socket, or some; workers of one GPU each, or some without."""
    sockets, cores, smt = draw(st.integers(1, 4)), draw(st.integers(1, 12)), draw(st.sampled_from([1, 2]))
    total_cores = sockets * cores
    socket_of = {t * total_cores + s * cores + c: s for s in range(sockets) for c in range(cores) for t in range(smt)}
    siblings = {cpu: frozenset(cpu % total_cores + t * total_cores for t in range(smt)) for cpu in socket_of}
    per_socket = [draw(st.integers(0, 3)) for _ in range(sockets)]
    gpu_socket = [s for s in range(sockets) for _ in range(per_socket[s])]
    ids = [str(k) for k in range(len(gpu_socket))]
    local = {g: frozenset(c for c, s in socket_of.items() if s == gpu_socket[int(g)]) for g in ids}
    allowed_kind = draw(st.sampled_from(["all", "socket", "some"]))
    if allowed_kind == "all":
        allowed = frozenset(socket_of)
    elif allowed_kind == "socket":
        allowed = frozenset(c for c, s in socket_of.items() if s == 0)
    else:
        allowed = frozenset(draw(st.sets(st.sampled_from(sorted(socket_of)), min_size=1)))
    known = draw(st.booleans()) or not ids
    workers = [(g,) for g in ids] + [()] * draw(st.integers(0 if ids else 1, 2))
    share = draw(st.integers(1, max(1, 2 * len(allowed) // len(workers))))
    topo = gpus.Topology(allowed=allowed, local=local if known else {}, siblings=siblings,
                         unknown="" if known else "no sysfs here")
    return [share] * len(workers), workers, topo, {g: gpu_socket[int(g)] for g in ids}


@settings(max_examples=500, deadline=None)
@given(machines())
def test_binding_properties(case: tuple[list[int], list[tuple[str, ...]], gpus.Topology, dict[str, int]]) -> None:
    shares, workers, topo, _ = case
    b = gpus.bind(shares, workers, topo)
    bound = [c for c in b.cpus if c]
    if len(topo.allowed) < sum(shares):
        assert not bound and any("workers not bound" in n for n in b.notes)
        return
    assert len(bound) == len(workers)
    flat = [c for cpus in b.cpus for c in cpus]
    assert len(flat) == len(set(flat))  # no core given to two workers
    assert set(flat) <= topo.allowed
    assert [len(c) for c in b.cpus] == shares
    if not topo.local and any(workers):
        assert any("cores split evenly" in n for n in b.notes)
    # where a NUMA domain holds enough allowed CPUs for the workers of its GPUs, they get only its CPUs
    if topo.local:
        for g in {g for w in workers for g in w}:
            here = [k for k, w in enumerate(workers) if w and topo.local[w[0]] == topo.local[g]]
            room = len(topo.local[g] & topo.allowed)
            if room >= sum(shares[k] for k in here) + (sum(shares[k] for k in here) if topo.siblings else 0) // 2:
                assert all(set(b.cpus[k]) <= topo.local[g] for k in here), (g, b)


def test_whole_cores_stay_together_and_numa_domains_are_split_evenly() -> None:
    # 2 sockets x 4 cores x 2 threads: socket 0 = CPUs 0-3 and 8-11, socket 1 = 4-7 and 12-15
    siblings = {c: frozenset({c % 8, c % 8 + 8}) for c in range(16)}
    local = {"0": frozenset({0, 1, 2, 3, 8, 9, 10, 11}), "1": frozenset({0, 1, 2, 3, 8, 9, 10, 11}),
             "2": frozenset({4, 5, 6, 7, 12, 13, 14, 15})}
    topo = gpus.Topology(allowed=frozenset(range(16)), local=local, siblings=siblings)
    b = gpus.bind([4, 4, 4], [("0",), ("1",), ("2",)], topo)
    assert b.cpus == ((0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13)) and b.local


def test_locality_not_position_decides() -> None:
    far, near = frozenset(range(4)), frozenset(range(4, 8))  # GPUs 0 and 2 sit next to CPUs 4-7
    topo = gpus.Topology(allowed=frozenset(range(8)), local={"0": near, "1": far, "2": near, "3": far})
    b = gpus.bind([2, 2, 2, 2], [("0",), ("1",), ("2",), ("3",)], topo)
    assert b.cpus == ((4, 5), (0, 1), (6, 7), (2, 3)) and not b.notes


def test_without_a_gpu_to_core_mapping_cores_are_split_evenly_and_it_says_so() -> None:
    topo = gpus.Topology(allowed=frozenset(range(8)), unknown="no nvidia-smi")
    b = gpus.bind([2, 2, 2, 2], [("0",), ("1",), ("2",), ("3",)], topo)
    assert b.cpus == ((0, 1), (2, 3), (4, 5), (6, 7)) and not b.local
    assert b.notes == ("no GPU-to-core mapping for GPU 0, 1, 2, 3 (no nvidia-smi); cores split evenly",)


def test_gpus_on_one_socket_take_far_cores_only_to_fill_their_share() -> None:
    local = {g: frozenset(range(4)) for g in "01"}
    b = gpus.bind([4, 4], [("0",), ("1",)], gpus.Topology(allowed=frozenset(range(8)), local=local))
    assert b.cpus == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert any("cores away from their GPU" in n for n in b.notes)


def test_fewer_cpus_than_the_shares_binds_nothing_and_says_why() -> None:
    b = gpus.bind([2, 2], [("0",), ("1",)], gpus.Topology(allowed=frozenset({0, 1})))
    assert b.cpus == ((), ()) and "may run on 2 CPUs (0-1" in b.notes[0]


def test_bound_workers_get_their_cores_threads_and_omp_num_threads() -> None:
    s = vendor_site("nvidia", 2, threads=8)
    a = Allocation(nodes=(NodeAllocation(16, 64 * GIB, ("0", "1"), "a"), NodeAllocation(16, 64 * GIB, ("0", "1"), "b")))
    workers = layout(s, a).workers
    local = {"0": frozenset(range(8, 16)), "1": frozenset(range(8))}
    bound, notes = bind_node(workers, 1, {w.name: (w.env["CUDA_VISIBLE_DEVICES"],) for w in workers},
                             gpus.Topology(allowed=frozenset(range(16)), local=local))
    assert [w.cpus for w in bound[:2]] == [(), ()]  # node 0 is another node's business
    assert [w.cpus for w in bound[2:]] == [tuple(range(8, 16)), tuple(range(8))]
    assert [w.env["HPC_GARAGE_CPUS"] for w in bound[2:]] == ["8-15", "0-7"]
    assert all(w.env["OMP_NUM_THREADS"] == "8" and w.nthreads == 8 for w in bound[2:])
    assert notes == ["cores bound next to each worker's GPU (its PCI device's local_cpulist, within the job's CPUs 0-15)"]


# ------------------------------------------------------------------------------------- fake sysfs trees


def tree(name: str) -> dict[str, str]:
    return {topology.SYSFS_ROOT_ENV: str(SYSFS / name)}


@pytest.mark.parametrize("vendor", gpus.VENDORS)
def test_the_two_socket_node_binds_gpus_0_to_3_to_numa_0(vendor: str) -> None:
    """The issue's node: GPUs 0-3 on NUMA 0, 4-7 on NUMA 1, 64 cores; `show` of it says so."""
    s = vendor_site(vendor)
    shaped = topology.bound_layout(layout(s, Allocation.from_request(s, Request(nodes=1))), tree(f"{vendor}-2socket"))
    numa0, numa1 = set(range(32)), set(range(32, 64))
    assert [set(w.cpus) <= numa0 for w in shaped.workers] == [True] * 4 + [False] * 4
    assert all(set(w.cpus) <= numa1 for w in shaped.workers[4:])
    assert [w.env["HPC_GARAGE_CPUS"] for w in shaped.workers] == [f"{8 * k}-{8 * k + 7}" for k in range(8)]
    text = "\n".join(describe(shaped))
    assert "cores 0-7 8-15 16-23 24-31 32-39 40-47 48-55 56-63" in text
    assert "note: node 0: cores bound next to each worker's GPU" in text and "split evenly" not in text
    as_json = json.loads(shaped.to_json())
    assert as_json["workers"][0]["cpus"] == list(range(8))


def test_the_node_reads_bus_ids_in_each_runtimes_order_and_skips_what_is_not_a_gpu() -> None:
    nvidia, source = topology.gpu_devices("nvidia", tree("nvidia-2socket"))
    assert source == "/proc/driver/nvidia/gpus" and len(nvidia) == 8
    assert nvidia[0].bus == "0000:18:00.0" and nvidia[0].uuids == ("GPU-00000000-1111-2222-3333-444455556660",)
    amd, source = topology.gpu_devices("amd", tree("amd-2socket"))
    assert source == "/sys/class/kfd topology"
    assert [d.bus for d in amd[:2]] == ["0000:2a:00.0", "0000:18:00.0"]  # ROCr's order, not the bus order
    assert amd[0].uuids == (f"GPU-{0xA5A5000000000000:016x}",)
    intel, source = topology.gpu_devices("intel", tree("intel-2socket"))
    assert source == "/sys/bus/pci" and len(intel) == 8  # the NIC and the BMC's VGA are not GPUs
    none, why = topology.gpu_devices("amd", tree("nvidia-2socket"))
    assert none == [] and why.startswith("no amd GPU found")


def test_job_ids_map_to_devices_by_position_uuid_prefix_mig_and_tile() -> None:
    devices = [topology.GpuDevice("0000:18:00.0", ("GPU-aaaa", "MIG-x1")), topology.GpuDevice("0000:2a:00.0",
                                                                                                ("GPU-bbbb",))]
    assert topology.device_for("nvidia", "1", devices) is devices[1]
    assert topology.device_for("nvidia", "GPU-bb", devices) is devices[1]
    assert topology.device_for("nvidia", "MIG-x1", devices) is devices[0]
    assert topology.device_for("nvidia", "MIG-GPU-aaaa/1/0", devices) is devices[0]
    assert topology.device_for("nvidia", "GPU-", devices) is None  # not unique
    assert topology.device_for("nvidia", "2", devices) is None
    assert topology.device_for("intel", "1.1", devices) is devices[1]
    assert topology.normal_bus("00000000:3B:00.0") == "0000:3b:00.0"


def test_unknown_locality_falls_back_to_an_even_split_and_show_says_why(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    shutil.copytree(SYSFS / "nvidia-2socket", root)
    for f in root.glob("sys/bus/pci/devices/*/local_cpulist"):
        f.unlink()
    s = vendor_site("nvidia", 4)
    shaped = topology.bound_layout(layout(s, Allocation.from_request(s, Request())),
                                   {topology.SYSFS_ROOT_ENV: str(root)})
    text = "\n".join(describe(shaped))
    assert "no GPU-to-core mapping for GPU 0, 1, 2, 3 (no local_cpulist for 0000:18:00.0" in text
    assert "cores split evenly" in text and "cores 0-15 16-31 32-47 48-63" in text


def test_a_gpu_the_job_may_not_open_is_not_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topology, "_may_open", lambda path: not str(path).endswith("nvidia0"))
    devices, _ = topology.gpu_devices("nvidia", tree("nvidia-2socket"))
    assert [d.bus for d in devices][:1] == ["0000:2a:00.0"] and len(devices) == 7


def test_a_display_device_of_another_driver_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "tree"
    shutil.copytree(SYSFS / "intel-2socket", root)
    (root / "sys/bus/pci/drivers/vfio-pci").mkdir(parents=True)
    (root / "sys/bus/pci/devices/0000:18:00.0/driver").symlink_to(root / "sys/bus/pci/drivers/vfio-pci")
    devices, _ = topology.gpu_devices("intel", {topology.SYSFS_ROOT_ENV: str(root)})
    assert len(devices) == 7 and devices[0].bus == "0000:2a:00.0"


def test_binding_off_leaves_workers_unbound() -> None:
    s = vendor_site("nvidia", bind_cpus=False)
    plain = layout(s, Allocation.from_request(s, Request()))
    assert topology.bound_layout(plain, tree("nvidia-2socket")) is plain


# ---------------------------------------------------------------------------- a worker binds itself


def test_bind_self_binds_every_thread_of_the_process() -> None:
    cpu = max(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""\
        import os, threading, time
        from hpc_garage.launchers.affinity import bind_self
        ready = threading.Event()
        t = threading.Thread(target=lambda: (ready.set(), time.sleep(2)), daemon=True)
        t.start(); ready.wait()
        print(sorted(bind_self({{"HPC_GARAGE_CPUS": "{cpu}"}})))
        print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(t.native_id)))
        print(bind_self({{}}))
        """)
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:3] == [f"[{cpu}]", f"[{cpu}] [{cpu}]", "None"], done.stderr


def _status() -> dict[str, Any]:
    def allowed(path: str) -> str:
        text = open(path).read()
        return re.search(r"Cpus_allowed_list:\s*(\S+)", text).group(1)  # type: ignore[union-attr]

    return {"process": allowed("/proc/self/status"), "thread": allowed("/proc/thread-self/status"),
            "pid": os.getpid(), "omp": os.environ.get("OMP_NUM_THREADS")}


@pytest.mark.slow
def test_a_nanny_started_from_a_bound_spec_runs_its_tasks_on_its_cores() -> None:
    from distributed import Client, Nanny, Scheduler

    cpu = max(os.sched_getaffinity(0))
    spec = WorkerSpec(name="w", node=0, host=None, local_rank=0, nthreads=1, memory_limit=2**30,
                      resources={"CPU": 1}, env={"OMP_NUM_THREADS": "1", "HPC_GARAGE_CPUS": str(cpu)}, cpus=(cpu,))

    async def main() -> tuple[dict[str, Any], str]:
        async with Scheduler(host="127.0.0.1", dashboard_address=":0") as s:
            async with Nanny(s.address, **worker_options(spec, host="127.0.0.1")) as nanny:
                async with Client(s.address, asynchronous=True) as c:
                    status = await c.submit(_status, pure=False)
                    worker_pid = nanny.process.process.pid
                    with open(f"/proc/{worker_pid}/status") as f:
                        text = f.read()
                    return status, re.search(r"Cpus_allowed_list:\s*(\S+)", text).group(1)  # type: ignore

    saved = dict(os.environ)
    try:
        status, seen_from_outside = asyncio.run(main())
    finally:  # a Nanny puts distributed's pre-spawn variables into this process's environment
        os.environ.clear()
        os.environ.update(saved)
    assert status["process"] == status["thread"] == seen_from_outside == str(cpu)
    assert status["omp"] == "1"


# ------------------------------------------------------------------------------------- in a real job


@pytest.mark.slurm
@pytest.mark.slow
def test_in_a_real_job_each_worker_is_bound_next_to_its_gpu(tmp_path: Path) -> None:
    """The local SLURM (2 real CPUs) with the `lab` tree: GPUs 0 and 2 next to CPU 1, 1 and 3 next to CPU 0.
    Whichever two GPUs the job gets, the worker of the first is bound to CPU 1 and the other to CPU 0: seen in
    each worker's /proc/<pid>/status from outside, and from inside a task (process and thread)."""
    from tests.slurm_jobs import exit_code, submit, wait_gone

    sites = tmp_path / "sites"
    sites.mkdir()
    (sites / "bound.yaml").write_text(textwrap.dedent(f"""\
        scheduler: slurm
        queue: gpu
        walltime: "00:10:00"
        node: {{cores: 8, memory: 15GiB, gpus: 4}}
        workers: {{per: gpu, reserve_memory: 512MiB}}
        interface: lo
        env: {{{topology.SYSFS_ROOT_ENV}: {SYSFS / 'lab'}}}
        """))
    out = tmp_path / "out.json"
    check = tmp_path / "check.py"
    check.write_text(textwrap.dedent("""\
        import json, os, re, sys
        from distributed import Client
        from hpc_garage.cluster.handoff import handoff_from_env, workers_now

        def status():
            def allowed(path):
                return re.search(r"Cpus_allowed_list:\\s*(\\S+)", open(path).read()).group(1)
            return {"pid": os.getpid(), "process": allowed("/proc/self/status"),
                    "thread": allowed("/proc/thread-self/status"), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                    "cpus": os.environ.get("HPC_GARAGE_CPUS"), "omp": os.environ.get("OMP_NUM_THREADS")}

        h = handoff_from_env()
        with Client(h.address, security=h.security(), timeout=30) as c:
            seen = {}
            for name in [w["name"] for w in workers_now(c).values()]:
                seen[name] = c.submit(status, workers=[name], pure=False, key=f"status-{name}").result()
        for s in seen.values():  # from outside the worker, as an admin would look
            s["outside"] = re.search(r"Cpus_allowed_list:\\s*(\\S+)", open(f"/proc/{s['pid']}/status").read()).group(1)
        json.dump(seen, open(sys.argv[1], "w"))
        """))
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -p gpu -N 1 -c 2 --gres=gpu:2 --mem=3G -t 10 -o {tmp_path}/job.out\n"
                      f"export HPC_GARAGE_SITES_PATH={sites}\n"
                      f"{PY} -m hpc_garage run --site bound -- {PY} {check} {out}\n")
    job = submit(["sbatch", "--parsable"], script)
    log = tmp_path / "job.out"
    assert exit_code(wait_gone(job, 240)) == 0, log.read_text()
    seen = json.loads(out.read_text())
    assert len(seen) == 2
    first, second = sorted(seen.values(), key=lambda s: int(s["cuda"]))
    assert int(first["cuda"]) % 2 == 0 and int(second["cuda"]) % 2 == 1
    assert first["process"] == first["thread"] == first["outside"] == first["cpus"] == "1"
    assert second["process"] == second["thread"] == second["outside"] == second["cpus"] == "0"
    assert first["omp"] == second["omp"] == "1"
    text = log.read_text()
    assert "cores bound next to each worker's GPU" in text and "cores 1, OMP_NUM_THREADS 1" in text


# ----------------------------------------------------------------------------------- on a real GPU machine


def real_gpus() -> list[tuple[str, str]]:
    """(index, UUID) of each GPU nvidia-smi shows here; [] without one."""
    if not shutil.which("nvidia-smi"):
        return []
    done = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader"], capture_output=True,
                          text=True, timeout=60)
    return [tuple(x.strip() for x in line.split(",")) for line in done.stdout.splitlines() if "," in line]  # type: ignore


needs_gpu = pytest.mark.skipif(not real_gpus(), reason="no NVIDIA GPU here (nvidia-smi shows none)")

CUDA_PROBE = textwrap.dedent("""\
    import ctypes, json, os
    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0, "cuInit failed"
    count = ctypes.c_int()
    assert cuda.cuDeviceGetCount(ctypes.byref(count)) == 0
    uuids = []
    for i in range(count.value):
        dev, raw = ctypes.c_int(), (ctypes.c_ubyte * 16)()
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        cuda.cuDeviceGetUuid(raw, dev)
        h = bytes(raw).hex()
        uuids.append(f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}")
    print(json.dumps({"count": count.value, "uuids": uuids}))
    """)


def cuda_probe(env: dict[str, str]) -> dict[str, Any]:
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    done = subprocess.run([PY, "-c", CUDA_PROBE], capture_output=True, text=True, timeout=120, env=base | env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_gpu
@pytest.mark.parametrize("spelling", ["index", "uuid"])
def test_real_gpu_each_worker_env_shows_the_cuda_driver_exactly_its_gpu(spelling: str) -> None:
    for index, uuid in real_gpus():
        env = gpus.worker_env("nvidia", [index if spelling == "index" else uuid])
        seen = cuda_probe(env)
        assert seen["count"] == 1 and seen["uuids"] == [uuid], (env, seen)
    assert cuda_probe(gpus.worker_env("nvidia", []))["count"] == 0  # a worker without a GPU sees none


def nvidia_smi_affinity() -> dict[str, frozenset[int]]:
    """GPU index → `nvidia-smi topo -m`'s CPU Affinity."""
    text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60).stdout
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = re.split(r"\t+", lines[0].strip())
    column = header.index("CPU Affinity")
    found = {}
    for line in lines[1:]:
        cells = re.split(r"\t+", line.strip())
        if re.fullmatch(r"GPU\d+", cells[0]) and len(cells) > column + 1:
            found[cells[0][3:]] = gpus.parse_cpulist(cells[column + 1])  # +1: the row name has no header
    return found


@needs_gpu
def test_real_gpu_local_cores_match_nvidia_smi_topo_and_workers_are_bound_within_them() -> None:
    ids = [index for index, _ in real_gpus()]
    topo = topology.node_topology("nvidia", ids, {})
    affinity = nvidia_smi_affinity()
    assert topo.buses and not topo.unknown, topo
    for gpu_id in ids:
        if gpu_id in affinity:
            assert topo.local[gpu_id] == affinity[gpu_id], (gpu_id, topo.local[gpu_id], affinity[gpu_id])
    cores = len(topo.allowed)
    s = parse_site_dict({"name": "here", "scheduler": "slurm", "workers": {"per": "gpu"},
                         "node": {"cores": cores, "memory": "16GiB", "gpus": len(ids)}})
    a = Allocation(nodes=(NodeAllocation(cores, 16 * GIB, tuple(ids), "here"),))
    bound = topology.bound_layout(layout(s, a), {})
    for w in bound.workers:
        gpu_id = w.env["CUDA_VISIBLE_DEVICES"]
        room = len(topo.local[gpu_id] & topo.allowed)
        sharing = sum(1 for x in ids if topo.local[x] == topo.local[gpu_id])
        if room >= sharing * int(w.resources["CPU"]):
            assert set(w.cpus) <= topo.local[gpu_id], (gpu_id, w.cpus)


@needs_gpu
@pytest.mark.slow
def test_real_gpu_bound_workers_see_one_gpu_through_the_cuda_driver_and_run_on_their_cores() -> None:
    """The launchers' whole path on this machine: layout, pinning by index and by UUID, binding, Nannies
    forked with BoundWorker; each worker's task counts its GPUs through the CUDA driver."""
    from distributed import Client, Nanny, Scheduler

    real = real_gpus()
    for spelling in ("index", "uuid"):
        ids = tuple(index if spelling == "index" else uuid for index, uuid in real)
        cores = len(os.sched_getaffinity(0))
        s = parse_site_dict({"name": "here", "scheduler": "slurm", "workers": {"per": "gpu"},
                             "node": {"cores": cores, "memory": "16GiB", "gpus": len(ids)}})
        a = Allocation(nodes=(NodeAllocation(cores, 16 * GIB, ids, "here"),))
        bound = topology.bound_layout(layout(s, a), {})

        def probe() -> dict[str, Any]:
            import ctypes

            cuda = ctypes.CDLL("libcuda.so.1")
            count = ctypes.c_int()
            cuda.cuInit(0)
            cuda.cuDeviceGetCount(ctypes.byref(count))
            return {"count": count.value, **_status(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}

        async def main() -> list[dict[str, Any]]:
            async with Scheduler(host="127.0.0.1", dashboard_address=":0") as sched:
                nannies = [Nanny(sched.address, **worker_options(w, host="127.0.0.1")) for w in bound.workers]
                await asyncio.gather(*nannies)
                try:
                    async with Client(sched.address, asynchronous=True) as c:
                        return [await c.submit(probe, workers=[w.name], pure=False, key=f"probe-{w.name}")
                                for w in bound.workers]
                finally:
                    await asyncio.gather(*(n.close() for n in nannies))

        saved = dict(os.environ)
        try:
            results = asyncio.run(main())
        finally:  # a Nanny puts distributed's pre-spawn variables into this process's environment
            os.environ.clear()
            os.environ.update(saved)
        for w, r in zip(bound.workers, results):
            assert r["count"] == 1 and r["visible"] == w.env["CUDA_VISIBLE_DEVICES"], r
            if w.cpus:
                assert gpus.parse_cpulist(r["process"]) == set(w.cpus) == gpus.parse_cpulist(r["thread"])
