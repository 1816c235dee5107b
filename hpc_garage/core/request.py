"""What a user asks the batch system for, before it meets a site: one value that travels from the CLI (or
`hpc-garage sbatch`'s options) to the job script, instead of a dozen loose keywords."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Request:
    """Every field None (or empty) means "the site's default"."""

    nodes: int | None = None
    gpus_per_node: int | None = None
    cores_per_node: int | None = None
    cores_per_worker: int | None = None  # sbatch's -c: a task is a Dask worker
    memory: int | None = None  # bytes per node
    walltime: int | None = None  # seconds
    gpu_type: str | None = None
    queue: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str | None = None
    container: str | None = None  # the image, over the site's container.image
    extra_directives: tuple[str, ...] = ()  # batch-system options passed through, without their prefix

    SHAPE = ("nodes", "gpus_per_node", "cores_per_node", "cores_per_worker", "memory", "gpu_type")

    def asked(self) -> dict[str, Any]:
        """The fields that were given, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, ())}

    def shapes_allocation(self) -> bool:
        """Whether it asks for anything that changes the allocation's shape (not just where it is charged)."""
        return any(getattr(self, name) is not None for name in (*self.SHAPE, "walltime"))
