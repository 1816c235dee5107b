"""The local launcher: a Dask cluster on this machine shaped like one node of a site.

A login-node run must exercise the same scheduling as the real job: the same workers, each advertising the
same resources (GPU=1, CPU=8, MEMORY=…) and carrying the same environment. Only what the machine cannot
give is scaled down: threads and memory limits to its cores and memory, and GPUs it lacks are still
advertised, with CUDA_VISIBLE_DEVICES empty, so tasks tagged GPU=1 are placed as they would be there. Workers
here are not bound to cores (a login node or a laptop is shared; the kernel places them better there).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core.allocation import Allocation
from hpc_garage.core.gpus import HIDDEN, PRIMARY, VARIABLES, worker_env
from hpc_garage.core.request import Request
from hpc_garage.launchers.common import (Launcher, forkserver_env, local_directory, security_from,
                                        start_worker_forkserver, worker_options, worker_preload)
from hpc_garage.core.layout import Layout, WorkerSpec, layout
from hpc_garage.core.site import Site

if TYPE_CHECKING:
    from hpc_garage.rundir import RunDir


def machine_gpus(vendor: str = "nvidia") -> list[str]:
    """GPU ids usable here: the inherited list (CUDA_VISIBLE_DEVICES; ROCR_VISIBLE_DEVICES then HIP's;
    ZE_AFFINITY_MASK, checked as a job's is), else NVIDIA device files, else the GPUs sysfs shows."""
    from hpc_garage.core.gpus import job_gpus

    listed = job_gpus(vendor, os.environ)
    if listed.given:
        return list(listed.ids)
    if vendor == "nvidia":
        return sorted((p.name[6:] for p in Path("/dev").glob("nvidia[0-9]*")), key=int)
    from hpc_garage.launchers.topology import gpu_devices

    return [str(i) for i in range(len(gpu_devices(vendor, os.environ)[0]))]


def machine_shape() -> tuple[int, int]:
    """Cores this process may use, and physical memory, in bytes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def local_layout(site: Site, cores: int | None = None, memory: int | None = None,
               gpus: list[str] | None = None) -> tuple[Layout, list[str]]:
    """One node of the site, fitted to this machine. Returns the layout and what was scaled, in words."""
    have_cores, have_memory = machine_shape()
    cores = have_cores if cores is None else cores
    memory = have_memory if memory is None else memory
    vendor = site.node.gpu_vendor
    gpus = machine_gpus(vendor) if gpus is None else gpus
    shaped = layout(site, Allocation.from_request(site, Request(nodes=1)))
    workers = shaped.workers
    notes = []
    share_threads = max(1, cores // len(workers))
    share_memory = max(2**28, int(memory * 0.9) // len(workers))
    fitted: list[WorkerSpec] = []
    gpu_workers = [w for w in workers if w.gpu_slots]
    real = len(gpus) >= sum(len(w.gpu_slots) for w in gpu_workers) and gpu_workers
    for w in workers:
        env = dict(w.env) | {"OMP_NUM_THREADS": str(min(int(w.env["OMP_NUM_THREADS"]), share_threads))}
        if w.gpu_slots or any(var in env for var in VARIABLES[vendor]):  # a GPU node's worker: pinned or hidden
            env |= worker_env(vendor, [gpus[s] for s in w.gpu_slots] if real else [])
        fitted.append(replace(w, nthreads=min(w.nthreads, share_threads),
                              memory_limit=min(w.memory_limit, share_memory), env=env, host="localhost"))
    if any(f.nthreads < w.nthreads for f, w in zip(fitted, workers)):
        notes.append(f"threads scaled to this machine's {cores} cores")
    if any(f.memory_limit < w.memory_limit for f, w in zip(fitted, workers)):
        notes.append("memory limits scaled to this machine's memory")
    if gpu_workers and not real:
        count = sum(len(w.gpu_slots) for w in gpu_workers)
        hidden = "CUDA_VISIBLE_DEVICES empty" if vendor == "nvidia" else f"{PRIMARY[vendor]}={HIDDEN} (no GPU)"
        notes.append(f"this machine has {len(gpus)} GPUs: the {count} GPU workers advertise GPU resources "
                     f"but run with {hidden}")
    return replace(shaped, workers=fitted), notes


def worker_specs(workers: list[WorkerSpec], *, security: Any = None, env: dict[str, str] | None = None,
                 local_directory: str | None = None) -> dict[str, Any]:
    """SpecCluster's `workers` spec: one Nanny per WorkerSpec, on loopback, TLS when a Security is given."""
    from distributed import Nanny

    protocol = "tls" if security is not None else "tcp"
    extra: dict[str, Any] = {"host": "127.0.0.1", "security": security, "protocol": protocol}
    if local_directory:
        extra["local_directory"] = local_directory
    return {w.name: {"cls": Nanny, "options": worker_options(w, env=env, **extra)} for w in workers}


class LocalLauncher(Launcher):
    """Workers as Nannies of this process, on loopback: `hpc-garage run` outside a batch job."""

    def __init__(self, layout_: Layout) -> None:
        self.layout = layout_
        self.nannies: list[Any] = []

    async def prepare(self, tls: dict[str, str] | None, worker_env: dict[str, str], rundir: RunDir,
                      timeout: float) -> None:
        start_worker_forkserver(forkserver_env(worker_env, self.layout.workers), worker_preload(worker_env))

    async def start(self, address: str, tls: dict[str, str] | None, worker_env: dict[str, str],
                    rundir: RunDir) -> None:
        from distributed import Nanny

        specs = worker_specs(self.layout.workers, security=security_from(tls), env=worker_env,
                             local_directory=local_directory(self.layout.site.local_directory))
        self.nannies = [Nanny(address, **spec["options"]) for spec in specs.values()]
        await asyncio.gather(*(n.start() for n in self.nannies))

    async def stop_workers(self) -> None:
        """The nannies are this process's: closed before the scheduler, each ends its worker first."""
        await asyncio.gather(*(n.close(timeout=10) for n in self.nannies), return_exceptions=True)

    async def stop(self) -> None:
        await self.stop_workers()
