"""PBS Pro / OpenPBS / Torque: read a job's allocation from its environment and `qstat -f`."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_garage.allocation import Allocation, NodeAllocation
from hpc_garage.errors import AllocationError
from hpc_garage.schedulers.base import BatchSystem, _int, require, visible_gpus
from hpc_garage.units import parse_memory, parse_walltime

if TYPE_CHECKING:
    from hpc_garage.site import Site


def _qstat_f(job_id: str) -> str:
    """`qstat -f JOBID`, or "" where it cannot be had (memory and walltime then come from the site)."""
    try:
        done = subprocess.run(["qstat", "-f", job_id], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


class Pbs(BatchSystem):
    name = "pbs"

    def allocation_from_env(
        self,
        env: Mapping[str, str],
        site: Site,
        *,
        read_text: Callable[[str], str] = lambda p: Path(p).read_text(),
        qstat_f: Callable[[str], str] = _qstat_f,
    ) -> Allocation:
        job_id = require(env, "PBS_JOBID", "this is not a PBS job")
        nodefile = require(env, "PBS_NODEFILE", "the job's hosts are unknown")
        try:
            lines = [ln.strip() for ln in read_text(nodefile).splitlines() if ln.strip()]
        except OSError as exc:
            raise AllocationError(f"PBS_NODEFILE={nodefile}: cannot read it ({exc.strerror})") from None
        hosts = list(dict.fromkeys(lines))  # one line per rank; unique hosts in order
        if not hosts:
            raise AllocationError(f"PBS_NODEFILE={nodefile} is empty; the job's hosts are unknown")
        if env.get("PBS_NUM_NODES") and _int(env, "PBS_NUM_NODES") != len(hosts):
            raise AllocationError(
                f"PBS_NUM_NODES={env['PBS_NUM_NODES']} but PBS_NODEFILE lists {len(hosts)} hosts; inconsistent job"
            )
        cores = _cores(env)
        gpus, notes = visible_gpus(env, None)
        if not gpus and env.get("PBS_GPUFILE"):
            gpus = _gpus_from_gpufile(read_text(env["PBS_GPUFILE"]), hosts[0])
        info = parse_qstat_f(qstat_f(job_id))
        memory = _memory_per_node(info, len(hosts))
        if memory is None:
            memory = site.node.memory
            notes.append(f"no memory in the job's environment or qstat -f; assuming site {site.name}'s node.memory")
        walltime = parse_walltime(info["Resource_List.walltime"]) if info.get("Resource_List.walltime") else None
        if len(hosts) > 1 and gpus:
            notes.append("GPU ids of nodes after the first are read by each worker on its own node")
        node_list = tuple(NodeAllocation(host=h, cores=cores, memory=memory, gpus=gpus) for h in hosts)
        return Allocation(nodes=node_list, source="pbs", job_id=job_id, walltime=walltime, notes=tuple(notes))


def _cores(env: Mapping[str, str]) -> int:
    for var in ("NCPUS", "PBS_NUM_PPN"):
        if env.get(var):
            return _int(env, var)
    raise AllocationError("neither NCPUS (PBS Pro) nor PBS_NUM_PPN (Torque) is set; the job's cores are unknown")


def _gpus_from_gpufile(text: str, host: str) -> tuple[str, ...]:
    """Torque's PBS_GPUFILE: one `host-gpuN` line per GPU."""
    ids = []
    for line in text.split():
        name, _, gpu = line.rpartition("-gpu")
        if name == host and gpu.isdigit():
            ids.append(gpu)
    return tuple(ids)


def parse_qstat_f(text: str) -> dict[str, str]:
    """`qstat -f` as a dict; continuation lines (tab-indented) are joined to their key."""
    info: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if m := re.match(r"^\s{4}([\w.]+) = (.*)$", line):
            key = m.group(1)
            info[key] = m.group(2).strip()
        elif key and line.startswith("\t"):
            info[key] += line.strip()
    return info


def _memory_per_node(info: Mapping[str, str], nhosts: int) -> int | None:
    """PBS Pro gives the job's total `Resource_List.mem`, and the chunk's `mem=` in `select`."""
    select = info.get("Resource_List.select", "")
    if m := re.search(r"mem=([\w.]+)", select):
        chunks = [int(c.split(":")[0]) if c.split(":")[0].isdigit() else 1 for c in select.split("+")]
        per_chunk = parse_memory(m.group(1))
        return per_chunk * sum(chunks) // nhosts
    if total := info.get("Resource_List.mem"):
        return parse_memory(total) // nhosts
    return None
