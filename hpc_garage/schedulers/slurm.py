"""SLURM: read a job's allocation from its environment (and, later, request/submit/query/cancel)."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hpc_garage.allocation import Allocation, NodeAllocation
from hpc_garage.errors import AllocationError
from hpc_garage.schedulers.base import BatchSystem, _int, require, visible_gpus

if TYPE_CHECKING:
    from hpc_garage.site import Site

MIB = 2**20


class Slurm(BatchSystem):
    name = "slurm"

    def allocation_from_env(self, env: Mapping[str, str], site: Site) -> Allocation:
        job_id = require(env, "SLURM_JOB_ID", "this is not a SLURM job")
        nodelist = env.get("SLURM_JOB_NODELIST") or require(env, "SLURM_NODELIST", "the job's nodes are unknown")
        hosts = expand_hostlist(nodelist)
        count_var = "SLURM_JOB_NUM_NODES" if env.get("SLURM_JOB_NUM_NODES") else "SLURM_NNODES"
        if env.get(count_var) and _int(env, count_var) != len(hosts):
            raise AllocationError(
                f"{count_var}={env[count_var]} but SLURM_JOB_NODELIST={nodelist} names {len(hosts)} nodes; "
                "the job's environment is inconsistent (was it copied from another job?)"
            )
        cores = _cores_per_node(env, len(hosts))
        gpus, notes = visible_gpus(env, "SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS")
        if len(hosts) > 1 and gpus:
            notes.append("GPU ids of nodes after the first are read by each worker on its own node")
        nodes = []
        for host, ncores in zip(hosts, cores):
            memory, note = _memory_per_node(env, ncores, len(gpus), site)
            nodes.append(NodeAllocation(host=host, cores=ncores, memory=memory, gpus=gpus))
        notes += [note] if note else []
        start, end = env.get("SLURM_JOB_START_TIME"), env.get("SLURM_JOB_END_TIME")
        walltime = int(end) - int(start) if start and end and start.isdigit() and end.isdigit() else None
        return Allocation(
            nodes=tuple(nodes),
            source="slurm",
            job_id=job_id,
            walltime=walltime,
            end_time=float(end) if end and end.isdigit() else None,
            notes=tuple(notes),
        )


def _cores_per_node(env: Mapping[str, str], nhosts: int) -> list[int]:
    if spec := env.get("SLURM_JOB_CPUS_PER_NODE"):
        cores = expand_counts(spec, "SLURM_JOB_CPUS_PER_NODE")
        if len(cores) != nhosts:
            raise AllocationError(
                f"SLURM_JOB_CPUS_PER_NODE={spec} describes {len(cores)} nodes but the job has {nhosts}; "
                "the job's environment is inconsistent"
            )
        return cores
    if env.get("SLURM_CPUS_ON_NODE"):
        return [_int(env, "SLURM_CPUS_ON_NODE")] * nhosts
    raise AllocationError("neither SLURM_JOB_CPUS_PER_NODE nor SLURM_CPUS_ON_NODE is set; the job's cores are unknown")


def _memory_per_node(env: Mapping[str, str], cores: int, gpus: int, site: Site) -> tuple[int, str | None]:
    """Slurm exports exactly one of these (in MB), by how the job asked for memory."""
    if env.get("SLURM_MEM_PER_NODE"):
        return _int(env, "SLURM_MEM_PER_NODE") * MIB, None
    if env.get("SLURM_MEM_PER_CPU"):
        return _int(env, "SLURM_MEM_PER_CPU") * MIB * cores, None
    if env.get("SLURM_MEM_PER_GPU"):
        if not gpus:
            raise AllocationError("SLURM_MEM_PER_GPU is set but the job has no GPUs; the job's environment is inconsistent")
        return _int(env, "SLURM_MEM_PER_GPU") * MIB * gpus, None
    return site.node.memory, (
        "no SLURM_MEM_PER_NODE/_CPU/_GPU in the job's environment (no --mem given); "
        f"assuming site {site.name}'s node.memory"
    )


_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_counts(spec: str, var: str = "count list") -> list[int]:
    """`72(x2),36` → [72, 72, 36] (Slurm's compressed per-node counts)."""
    out: list[int] = []
    for part in spec.split(","):
        m = _COUNT.match(part.strip())
        if not m:
            raise AllocationError(f"{var}={spec}: cannot read {part!r}; expected forms like 72(x2),36")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist as `scontrol show hostnames` does: `nid[001234-001237,001300]`, `a[1-2]-b[1-2]`."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append(_expand_ranges(piece[1:-1], hostlist))
            elif "[" in piece or "]" in piece:
                raise AllocationError(f"hostlist {hostlist!r} has unbalanced brackets")
            else:
                choices.append([piece])
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    if not hosts or any(not h for h in hosts):
        raise AllocationError(f"hostlist {hostlist!r} names no hosts")
    return hosts


def _split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise AllocationError(f"hostlist {text!r} has unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise AllocationError(f"hostlist {text!r} has unbalanced brackets")
    return [i for i in items + [current] if i]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out = []
    for r in ranges.split(","):
        lo, _, hi = r.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise AllocationError(f"hostlist {hostlist!r}: cannot read range {r!r}")
        if not hi:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise AllocationError(f"hostlist {hostlist!r}: range {r!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out
