"""What a job was granted: hosts, and per host the cores, memory and GPU ids the job itself sees.

An Allocation comes from one of three places: a request (flags plus site defaults, checked against the
site's limits before anything is submitted), a SLURM job's environment, or a PBS job's environment. The
environment readers live in `hpc_garage.schedulers` (`allocation_from_env`); this module holds the shape
and the request path, and reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpc_garage.core.errors import AllocationError
from hpc_garage.core.request import Request
from hpc_garage.core.units import format_bytes, format_walltime

if TYPE_CHECKING:
    from hpc_garage.core.site import Site


@dataclass(frozen=True)
class NodeAllocation:
    """One node's share of the job. `gpus` are device ids as the job sees them (`0`, `GPU-…`, `MIG-…`)."""

    cores: int
    memory: int
    gpus: tuple[str, ...] = ()
    host: str | None = None  # unknown for a request not yet submitted

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "memory": self.memory, "gpus": list(self.gpus), "host": self.host}


@dataclass(frozen=True)
class Allocation:
    nodes: tuple[NodeAllocation, ...]
    source: str = "request"  # request | slurm | pbs | local
    job_id: str | None = None
    walltime: int | None = None  # seconds granted
    end_time: float | None = None  # epoch seconds, when the batch system will end the job
    notes: tuple[str, ...] = field(default=())  # assumptions made, said out loud

    def __post_init__(self) -> None:
        if not self.nodes:
            raise AllocationError("an allocation needs at least one node")

    @property
    def hosts(self) -> list[str | None]:
        return [n.host for n in self.nodes]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON types, in field order (built by hand: `asdict` takes ~20 ms on 4,096 nodes)."""
        return {"nodes": [n.to_dict() for n in self.nodes], "source": self.source, "job_id": self.job_id,
                "walltime": self.walltime, "end_time": self.end_time, "notes": list(self.notes)}

    @classmethod
    def from_request(cls, site: Site, request: Request = Request()) -> Allocation:
        """The allocation a request would get, refused here (with the reason) if the site cannot grant it.

        `request.cores_per_worker` is not read here: it becomes cores per node once the layout is known.
        """
        nodes, cores_per_node, memory = request.nodes, request.cores_per_node, request.memory
        gpus_per_node, walltime = request.gpus_per_node, request.walltime
        gpus = site.node.gpus if gpus_per_node is None else gpus_per_node
        # part of a GPU node comes with the same part of its cores and memory, so jobs can share the node
        share = gpus / site.node.gpus if site.node.gpus and 0 < gpus < site.node.gpus else 1
        checked = _Resolved(
            nodes=1 if nodes is None else nodes,
            gpus=gpus,
            cores=max(1, int(site.node.cores * share)) if cores_per_node is None else cores_per_node,
            memory=int(site.node.memory * share) if memory is None else memory,
            walltime=site.walltime if walltime is None else walltime,
        )
        check_request(site, checked)
        node = NodeAllocation(
            cores=checked.cores, memory=checked.memory, gpus=tuple(str(i) for i in range(checked.gpus))
        )
        return cls(nodes=(node,) * checked.nodes, source="request", walltime=checked.walltime)

    def describe(self) -> str:
        where = f"{self.source} job {self.job_id}" if self.job_id else f"{self.source}"
        time = f", walltime {format_walltime(self.walltime)}" if self.walltime else ""
        return f"{where}: {len(self.nodes)} node(s){time}"


@dataclass(frozen=True)
class _Resolved:
    nodes: int
    gpus: int
    cores: int
    memory: int
    walltime: int


def check_request(site: Site, r: _Resolved) -> None:
    """Refuse what the site cannot grant, naming the flag to change."""
    name, node, limits = site.name, site.node, site.limits
    if r.nodes < 1:
        raise AllocationError(f"--nodes {r.nodes}: ask for at least 1 node")
    if limits.max_nodes is not None and r.nodes > limits.max_nodes:
        raise AllocationError(
            f"--nodes {r.nodes}: site {name} allows at most {limits.max_nodes} nodes (limits.max_nodes); ask for fewer"
        )
    if r.gpus < 0 or r.gpus > node.gpus:
        raise AllocationError(
            f"--gpus-per-node {r.gpus}: a {name} node has {node.gpus} GPUs; ask for 0 to {node.gpus}"
        )
    if limits.max_gpus_per_node is not None and r.gpus > limits.max_gpus_per_node:
        raise AllocationError(
            f"--gpus-per-node {r.gpus}: site {name} allows at most {limits.max_gpus_per_node} "
            "(limits.max_gpus_per_node); ask for fewer"
        )
    if r.cores < 1 or r.cores > node.cores:
        raise AllocationError(
            f"--cores-per-node {r.cores}: a {name} node has {node.cores} cores; ask for 1 to {node.cores}"
        )
    if r.memory <= 0 or r.memory > node.memory:
        raise AllocationError(
            f"--mem {format_bytes(r.memory)}: a {name} node has {format_bytes(node.memory)}; ask for at most that"
        )
    if limits.max_walltime is not None and r.walltime > limits.max_walltime:
        raise AllocationError(
            f"--time {format_walltime(r.walltime)}: site {name} allows at most "
            f"{format_walltime(limits.max_walltime)} (limits.max_walltime); ask for less"
        )
