"""One Dask worker process as the layout gives it: what it is started with, wherever it runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerSpec:
    """One Dask worker process and everything it must be started with."""

    name: str
    node: int  # index into the allocation's nodes
    host: str | None
    local_rank: int  # position among the workers of its node
    nthreads: int
    memory_limit: int  # bytes
    resources: dict[str, float]
    gpu_slots: tuple[int, ...] = ()  # indices into the node's GPU list (re-read on the node itself)
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] = ()  # the CPUs it is bound to (chosen on its node, next to its GPUs); () = unbound

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerSpec:
        """The spec `to_dict` wrote (the lists back as tuples)."""
        return cls(**{**data, "gpu_slots": tuple(data.get("gpu_slots", ())), "cpus": tuple(data.get("cpus", ()))})

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON types (copies), in field order: what `WorkerSpec(**d)` rebuilds it from."""
        return {"name": self.name, "node": self.node, "host": self.host, "local_rank": self.local_rank,
                "nthreads": self.nthreads, "memory_limit": self.memory_limit, "resources": dict(self.resources),
                "gpu_slots": list(self.gpu_slots), "env": dict(self.env), "cpus": list(self.cpus)}

    @property
    def resources_arg(self) -> str:
        """The `--resources` value: `GPU=1,CPU=8,MEMORY=64000000000,PROCESS=1`."""
        return ",".join(f"{k}={number(v)}" for k, v in self.resources.items())


def number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)
