"""The heart of hpc-garage: (site, allocation) → the Dask worker processes to start. Pure: no I/O.

Dask applies `--resources` per worker *process*, so each process must advertise exactly its own share:
one GPU per process where the site says `per: gpu`, and the CPU and memory that go with it. Getting this
wrong by hand is easy (`--nworkers 4 --resources GPU=1` over four GPUs lets every process see all four);
here it is computed once, checked, and every leftover core or byte is reported rather than lost silently.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hpc_garage.core import gpus as _gpus
from hpc_garage.core import site_values
from hpc_garage.core.allocation import Allocation, NodeAllocation
from hpc_garage.core.errors import LayoutError
from hpc_garage.core.per_node import NodeWorkers, PerNode, dumps
from hpc_garage.core.units import format_bytes
from hpc_garage.core.variable_names import CPUS_ENV
from hpc_garage.core.scheduler_limit import past_one_scheduler
from hpc_garage.core.worker_spec import WorkerSpec, number

__all__ = ["Layout", "LayoutError", "WorkerSpec", "bind_node", "describe", "layout", "pin_gpus"]

if TYPE_CHECKING:  # not imported at run time: `show` lays out a SiteView without importing pydantic
    from hpc_garage.core.site import Site


class _Workers:
    """`Layout.workers`, a list of WorkerSpec; the list layout() gives is built on first use.

    `show --json` of 4,096 nodes x 8 GPUs never needs 32,768 WorkerSpec objects (to_json works per shape of
    node), and building them is most of the cost. Anything that reads `layout_.workers` gets the real list.
    """

    def __get__(self, layout_: Layout | None, owner: type | None = None) -> list[WorkerSpec]:
        if layout_ is None:
            raise AttributeError("workers")  # to dataclasses: a required field
        workers = layout_.__dict__["workers"]
        if isinstance(workers, PerNode):
            workers = layout_.__dict__["workers"] = workers.build()
        return workers

    def __set__(self, layout_: Layout, workers: list[WorkerSpec] | PerNode) -> None:
        layout_.__dict__["workers"] = workers


@dataclass(frozen=True)
class Layout:
    """The workers, and what of each node no worker got (cores, memory, GPUs that did not divide evenly)."""

    site: Site
    allocation: Allocation
    workers: list[WorkerSpec] = _Workers()  # type: ignore[assignment]  # still a required field
    leftovers: list[str]

    @property
    def worker_count(self) -> int:
        """len(self.workers), without building them."""
        per_node = self.__dict__["workers"]
        return sum(len(n.suffixes) for n in per_node.nodes) if isinstance(per_node, PerNode) else len(per_node)

    def to_dict(self) -> dict[str, Any]:
        return {
            "site": self._site_dict(),
            "allocation": self.allocation.to_dict(),
            "workers": [w.to_dict() for w in self.workers],
            "leftovers": self.leftovers,
        }

    def to_json(self) -> str:
        """`json.dumps(self.to_dict(), separators=(",", ":"))`, byte for byte, in a fraction of the time."""
        return "".join(self.json_chunks())

    def json_chunks(self) -> Iterator[str]:
        """to_json() in pieces of about one node each, to be written as they come (no 8 MB string copies).

        Nodes laid out alike differ only in the worker names, node index and host, so each shape of node is
        encoded once and filled in per node: 4,096 nodes x 8 GPUs take tens of milliseconds, not seconds.
        """
        yield dumps({"site": self._site_dict(), "allocation": self.allocation.to_dict()})[:-1] + ',"workers":'
        per_node = self.__dict__["workers"]
        if isinstance(per_node, PerNode):
            yield from per_node.json_chunks()
        else:
            yield dumps([w.to_dict() for w in per_node])
        yield f',"leftovers":{dumps(self.leftovers)}}}'

    def _site_dict(self) -> dict[str, Any]:
        return self.site.model_dump(mode="json") | {"path": str(self.site.path) if self.site.path else None}


def layout(site: Site, allocation: Allocation) -> Layout:
    """Lay out every node; nodes of the same shape are computed once (a 4,096-node request has one shape)."""
    leftovers: list[str] = []
    shapes: dict[tuple[int, int, tuple[str, ...]], tuple[NodeWorkers, list[str]]] = {}
    per_node: list[NodeWorkers] = []
    for index, node in enumerate(allocation.nodes):
        key = (node.cores, node.memory, node.gpus)
        if (shape := shapes.get(key)) is None:
            shape = shapes[key] = _layout_node(site, index, node)
        per_node.append(shape[0])
        if shape[1]:
            here = f"node {index}" + (f" ({node.host})" if node.host else "")
            leftovers += [f"{here}: {text}" for text in shape[1]]
    return Layout(site=site, allocation=allocation, workers=PerNode(allocation, per_node), leftovers=leftovers)


def _layout_node(site: Site, index: int, node: NodeAllocation) -> tuple[NodeWorkers, list[str]]:
    """One node's workers and leftovers (without the node's label); `index` only names the node in errors."""
    per, gpus = site.workers.per, len(node.gpus)
    if per == "gpu":
        if gpus == 0:
            raise LayoutError(
                f"site {site.name} puts one worker per GPU but node {index} of the allocation has no GPUs; "
                "request GPUs (--gpus-per-node) or use a site with workers.per: node"
            )
        count = gpus
    elif per == "node":
        count = 1
    else:
        count = site.workers.processes
    usable_memory = node.memory - site.workers.reserve_memory
    if usable_memory <= 0:
        raise LayoutError(
            f"node {index} has {format_bytes(node.memory)} but site {site.name} reserves "
            f"{format_bytes(site.workers.reserve_memory)} (workers.reserve_memory); ask for more memory (--mem)"
        )
    if count > node.cores:
        raise LayoutError(
            f"node {index} has {node.cores} cores, fewer than the {count} workers site {site.name} puts there; "
            "ask for more cores (--cores-per-node, -c) or fewer workers"
        )
    cores_each, memory_each, gpus_each = node.cores // count, usable_memory // count, gpus // count
    threads = site.workers.threads or cores_each
    if threads > cores_each:
        raise LayoutError(
            f"site {site.name} gives each worker {threads} threads (workers.threads) but node {index} has only "
            f"{cores_each} cores per worker; lower workers.threads or ask for more cores"
        )
    leftovers = []
    if spare := node.cores - cores_each * count:
        leftovers.append(f"{spare} of {node.cores} cores unused ({count} workers × {cores_each})")
    if spare_gpus := gpus - gpus_each * count:
        leftovers.append(f"{spare_gpus} of {gpus} GPUs unused ({count} workers × {gpus_each})")
    if (spare_mem := usable_memory - memory_each * count) >= 2**20:
        leftovers.append(f"{format_bytes(spare_mem)} of memory unused after an even split")

    suffixes, specs = [], []
    for k in range(count):
        slots = list(range(k * gpus_each, (k + 1) * gpus_each))
        ids = [node.gpus[s] for s in slots]
        resources: dict[str, float] = {}
        if ids:
            resources["GPU"] = len(ids)
        resources |= {"CPU": cores_each, "MEMORY": memory_each, "PROCESS": 1}
        env = {"OMP_NUM_THREADS": str(cores_each)}
        if gpus:  # a GPU node: pin (as the vendor's runtime masks), and hide every GPU from a worker without
            env |= _gpus.worker_env(site.node.gpu_vendor, ids)
        suffixes.append(f"gpu{slots[0]}" if per == "gpu" else f"w{k}")
        specs.append({"local_rank": k, "nthreads": threads, "memory_limit": memory_each, "resources": resources,
                      "gpu_slots": slots, "env": env, "cpus": []})
    return NodeWorkers(suffixes, specs), leftovers


def pin_gpus(spec: WorkerSpec, node_gpus: list[str] | tuple[str, ...], vendor: str | tuple[str, ...]) -> dict[str, str]:
    """The GPU variables for a worker, from the GPU ids its own node shows (read on that node, at start-up).

    On a multi-node job the batch script sees only its own node's ids; each worker maps its slots onto the
    ids of the node it runs on. Fewer GPUs there than slots is an error, not a silent share. `vendor` is the
    site's `node.gpu_vendor` (older callers pass the site's `gpu_env_vars`, read as the vendor they name).
    """
    if not spec.gpu_slots and not node_gpus:
        return {}
    if spec.gpu_slots and max(spec.gpu_slots) >= len(node_gpus):
        raise LayoutError(
            f"worker {spec.name} needs GPU slot {max(spec.gpu_slots)} but its node shows only "
            f"{len(node_gpus)} GPUs ({','.join(node_gpus) or 'none'}); request the same GPUs on every node"
        )
    return _gpus.worker_env(_gpus.vendor_of(vendor), [node_gpus[s] for s in spec.gpu_slots])


def bind_node(workers: list[WorkerSpec], node: int, gpu_ids: dict[str, tuple[str, ...]],
              topology: _gpus.Topology) -> tuple[list[WorkerSpec], list[str]]:
    """The workers of one node bound to their CPUs (`core.gpus.bind`), every other worker unchanged.

    `gpu_ids` maps a worker's name to the GPU ids it is pinned to on that node (as the job writes them). A
    bound worker gets `cpus`, `HPC_GARAGE_CPUS` and `OMP_NUM_THREADS` of that many CPUs, and no more Dask
    threads than CPUs. Returns the workers and what was assumed, in words.
    """
    mine = [w for w in workers if w.node == node]
    if not mine:
        return workers, []
    binding = _gpus.bind([int(w.resources.get("CPU", w.nthreads)) for w in mine],
                         [gpu_ids.get(w.name, ()) for w in mine], topology)
    bound = {}
    for w, cpus in zip(mine, binding.cpus):
        if cpus:
            env = {**w.env, "OMP_NUM_THREADS": str(len(cpus)), CPUS_ENV: _gpus.format_cpulist(cpus)}
            bound[w.name] = replace(w, cpus=cpus, nthreads=min(w.nthreads, len(cpus)), env=env)
    notes = list(binding.notes)
    if binding.local and bound:
        notes.append("cores bound next to each worker's GPU (its PCI device's local_cpulist, within the job's CPUs "
                     f"{_gpus.format_cpulist(topology.allowed)})")
    elif bound and not binding.notes:
        notes.append(f"cores bound: an even split of the job's CPUs {_gpus.format_cpulist(topology.allowed)}")
    return [bound.get(w.name, w) for w in workers], notes


def describe(layout_: Layout) -> list[str]:
    """The resource math as a person reads it: one line per run of nodes laid out alike."""
    launch = ", dask-mpi ranks" if layout_.site.launcher == "mpi" and layout_.site.mpi.launch == "dask-mpi" else ""
    lines = [f"site {layout_.site.name} ({layout_.site.scheduler}, {layout_.site.launcher} launcher{launch})",
             layout_.allocation.describe()]
    by_node: dict[int, list[WorkerSpec]] = {}
    for w in layout_.workers:
        by_node.setdefault(w.node, []).append(w)
    runs: list[tuple[list[int], str]] = []
    for index in range(len(layout_.allocation.nodes)):
        text = _node_line(layout_.allocation.nodes[index], by_node[index], layout_.site.node.gpu_vendor)
        if runs and runs[-1][1] == text and runs[-1][0][-1] == index - 1:
            runs[-1][0].append(index)
        else:
            runs.append(([index], text))
    for indices, text in runs:
        hosts = [layout_.allocation.nodes[i].host for i in indices]
        label = f"node {indices[0]}" if len(indices) == 1 else f"nodes {indices[0]}-{indices[-1]}"
        if hosts[0]:
            label += f" ({hosts[0]})" if len(hosts) == 1 else f" ({hosts[0]}..{hosts[-1]})"
        lines.append(f"{label}: {text}")
    lines += [f"note: {n}" for n in layout_.allocation.notes]
    lines += [f"unused: {x}" for x in layout_.leftovers]
    site = layout_.site
    if site.workers.bind_cpus and site.scheduler in site_values.TAKES_JOBS and not any(w.cpus for w in layout_.workers):
        near = ", next to its GPUs where the node says where they are" if site.node.gpus else ""
        lines.append(f"cores: in a job, each worker binds to its CPU share of its node as it starts{near} "
                     "(workers.bind_cpus)")
    total_gpu = sum(w.resources.get("GPU", 0) for w in layout_.workers)
    lines.append(f"total: {len(layout_.workers)} workers, {number(total_gpu)} GPUs, "
                 f"{number(sum(w.resources['CPU'] for w in layout_.workers))} CPUs")
    if past := past_one_scheduler(layout_.worker_count):
        lines.append(f"note: {past}")
    return lines


def _node_line(node: NodeAllocation, ws: list[WorkerSpec], vendor: str) -> str:
    w = ws[0]
    res = ", ".join(f"{k}={format_bytes(v)}" if k == "MEMORY" else f"{k}={number(v)}" for k, v in w.resources.items())
    devices = [_gpus.pinned(vendor, x.env) or "" for x in ws]
    pinned = f", {_gpus.PRIMARY[vendor]} {_span(devices)}" if any(devices) else ""
    if pinned and vendor == "amd":  # ROCm's later stage: positions within what ROCR_VISIBLE_DEVICES left
        later = sorted({x.env.get(_gpus.HIP, "") for x in ws if _gpus.pinned(vendor, x.env)})
        pinned += f" (then HIP_VISIBLE_DEVICES, CUDA_VISIBLE_DEVICES, GPU_DEVICE_ORDINAL {' | '.join(later)})"
    cores = ""
    if any(x.cpus for x in ws):
        cores = ", cores " + " ".join(_gpus.format_cpulist(x.cpus) if x.cpus else "unbound" for x in ws)
    gpus = f"{len(node.gpus)} GPUs, " if node.gpus else ""
    return (f"{gpus}{node.cores} cores, {format_bytes(node.memory)} → {len(ws)} workers × {{{res}}}, "
            f"threads {w.nthreads}, OMP_NUM_THREADS {w.env['OMP_NUM_THREADS']}{pinned}{cores}")


def _span(ids: list[str]) -> str:
    """`0..3` for consecutive integers, else the list; each entry is one worker's devices."""
    if all(i.isdigit() for i in ids) and len(ids) > 2:
        nums = [int(i) for i in ids]
        if nums == list(range(nums[0], nums[0] + len(nums))):
            return f"{nums[0]}..{nums[-1]}"
    return " ".join(ids)
