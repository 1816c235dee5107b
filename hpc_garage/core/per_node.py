"""A layout's workers kept per shape of node, built on demand and written as JSON per shape.

`show --json` of 4,096 nodes x 8 GPUs never needs 32,768 WorkerSpec objects: nodes laid out alike differ
only in the worker names, node index and host, so each shape of node is encoded once and filled in per
node (tens of milliseconds, not seconds). Anything that reads `Layout.workers` gets the real list.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from hpc_garage.core.allocation import Allocation
from hpc_garage.core.worker_spec import WorkerSpec


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


class NodeWorkers:
    """The workers of one shape of node, without what differs per node (index, host, name prefix)."""

    def __init__(self, suffixes: list[str], specs: list[dict[str, Any]]) -> None:
        self.suffixes = suffixes  # the worker names after `n{index}-`
        self.specs = specs  # the other WorkerSpec fields, in field order

    def json_template(self, prefix: str) -> str:
        """The node's workers as JSON, with NUL for the node index and SOH for its host (never in JSON text).

        `prefix` is the JSON-escaped name prefix (the job id and a dash).
        """
        return ",".join(f'{{"name":"{prefix}n\x00-{suffix}","node":\x00,"host":\x01,' + dumps(spec)[1:]
                        for suffix, spec in zip(self.suffixes, self.specs))


class PerNode:
    """The workers layout() laid out, as one NodeWorkers per node (nodes of one shape share it)."""

    def __init__(self, allocation: Allocation, nodes: list[NodeWorkers]) -> None:
        self.allocation, self.nodes = allocation, nodes

    def build(self) -> list[WorkerSpec]:
        prefix = f"{self.allocation.job_id}-" if self.allocation.job_id else ""
        workers = []
        for index, (node, shape) in enumerate(zip(self.allocation.nodes, self.nodes)):
            name, host = f"{prefix}n{index}-", node.host
            workers += [WorkerSpec(name=name + suffix, node=index, host=host, local_rank=spec["local_rank"],
                                   nthreads=spec["nthreads"], memory_limit=spec["memory_limit"],
                                   resources=dict(spec["resources"]), gpu_slots=tuple(spec["gpu_slots"]),
                                   env=dict(spec["env"]), cpus=tuple(spec["cpus"]))
                        for suffix, spec in zip(shape.suffixes, shape.specs)]
        return workers

    def json_chunks(self) -> Iterator[str]:
        """The workers' JSON list: `[`, then each node's workers (`,` before all but the first), then `]`."""
        job_id = self.allocation.job_id
        prefix = dumps(f"{job_id}-" if job_id else "")[1:-1]
        pieces: dict[tuple[int, str | None], list[str]] = {}  # per shape and host: the JSON around the index
        separator = "["
        for index, (node, shape) in enumerate(zip(self.allocation.nodes, self.nodes)):
            if (parts := pieces.get((id(shape), node.host))) is None:
                template = shape.json_template(prefix).replace("\x01", dumps(node.host))
                parts = pieces[(id(shape), node.host)] = template.split("\x00")
            if text := str(index).join(parts):
                yield separator + text
                separator = ","
        yield "[]" if separator == "[" else "]"
