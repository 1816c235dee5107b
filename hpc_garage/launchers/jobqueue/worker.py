"""Inside one worker job of the jobqueue launcher: read the job's real allocation, start its pinned workers.

dask-jobqueue runs this as the job's command (its `worker_command`):

    python -m hpc_garage.launchers.jobqueue.worker tls://HOST:PORT --name gpu-3 ... --hpc-garage-worker-file FILE

Its `--nthreads`/`--memory-limit`/`--nworkers` would give every process the same share and the same GPUs;
here they are ignored. The job reads what it was actually given (`Allocation.from_env`: cores, memory and
the GPU ids *this job* sees), lays it out with the pool's site exactly as `show` does, and starts one Nanny
per WorkerSpec: its own CUDA_VISIBLE_DEVICES, OMP_NUM_THREADS, threads, memory limit and resources, and the
run's TLS credentials and Prefect API. The workers are named `<job>-<k>` (or `<job>` alone), as
dask-jobqueue's SpecCluster expects for its job.

The launcher retires these workers before the job's end (see `scaling`); Dask's `--lifetime` is not used (it
reschedules a task its worker still runs). What is left here is the last resort, for a launcher that could
not retire them in time (a task far longer than any before it, a lost driver): half the lifetime margin before
the job's end, or half RUN_END_MARGIN before the run's, and on scancel/qdel/walltime signals, each worker *process* is killed first and
only then its nanny closed, so the scheduler moves a task away only once nothing runs it any more.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc_garage.core.allocation import Allocation
from hpc_garage.schedulers import allocation_from_env, node_name
from hpc_garage.core.errors import UserError
from hpc_garage.launchers.common import (forkserver_env, local_directory, node_gpus, run_entry, security_from,
                                        start_worker_forkserver, worker_preload, dask_worker_preload)
from hpc_garage.core.gpus import VARIABLES
from hpc_garage.core.layout import WorkerSpec, pin_gpus, layout
from hpc_garage.variables import CPUS_ENV
from hpc_garage.core.pools import RUN_END_MARGIN, JobShape, advertised, job_shapes, lifetime, worker_names
from hpc_garage.core.site import Site, parse_site_dict
from hpc_garage.core.units import format_bytes, format_walltime

logger = logging.getLogger(__spec__.name)  # not __name__: a worker job runs this module as __main__


@dataclass(frozen=True)
class JobWorker:
    """One worker of this job, as it is started."""

    name: str
    spec: WorkerSpec
    env: dict[str, str]  # the spec's environment with its GPUs pinned as this job sees them
    resources: dict[str, float]  # the spec's, plus the UNTAGGED marker where the pool takes such tasks


def job_workers(shape: JobShape, job_name: str, allocation: Allocation, env: Mapping[str, str], *,
                bind: bool = False) -> tuple[list[JobWorker], list[str]]:
    """This job's workers, from its real allocation; and what was assumed or left unused, in words. With
    `bind` (and the site's workers.bind_cpus), each is bound to its cores on this machine, next to its GPUs."""
    specs = [w for w in layout(shape.site, allocation).workers if w.node == 0]
    want = shape.workers_per_job
    if len(specs) < want:
        raise UserError(
            f"this job was given {allocation.nodes[0].cores} cores, {format_bytes(allocation.nodes[0].memory)} "
            f"and {len(allocation.nodes[0].gpus)} GPUs: {len(specs)} workers, but pool {shape.pool}'s jobs have "
            f"{want}; check the job's directives against the site"
        )
    notes = list(allocation.notes)
    if len(specs) > want:
        notes.append(f"the allocation holds {len(specs)} workers; starting the {want} the pool's jobs have")
        specs = specs[:want]
    vendor = shape.site.node.gpu_vendor
    gpus = node_gpus(env, vendor)
    specs = [replace(spec, env={**spec.env, **pin_gpus(spec, gpus, vendor)}) for spec in specs]
    if bind and shape.site.workers.bind_cpus:
        from hpc_garage.launchers.topology import bind_here

        specs, bound_notes = bind_here(specs, 0, vendor, env)
        notes += bound_notes
    workers = [JobWorker(name=name, spec=spec, env=dict(spec.env),
                         resources=advertised(spec.resources, untagged=shape.untagged, marker=shape.marker))
               for name, spec in zip(worker_names(job_name, want), specs)]
    return workers, notes


def job_end(site: Site, allocation: Allocation) -> tuple[float | None, float | None]:
    """(when the batch system ends this job (epoch seconds), its time limit in seconds), asked once: the job's
    clock started before its workers did (seconds, or tens of seconds on a busy node); None where unknown."""
    from hpc_garage.schedulers import detect, job_id

    batch, job = detect(os.environ, prefer=site.scheduler), job_id(os.environ)
    try:
        left = batch.time_left(job) if batch is not None and job is not None else None
    except UserError:
        left = None
    if left is None:
        return allocation.end_time, allocation.walltime
    return allocation.end_time or time.time() + left[0], left[1]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpc_garage.launchers.jobqueue.worker")
    parser.add_argument("address")
    parser.add_argument("--name", required=True)
    parser.add_argument("--hpc-garage-worker-file", dest="worker_file", required=True)
    parser.add_argument("--death-timeout", type=float, default=60.0)
    args, _ = parser.parse_known_args(argv)  # dask-jobqueue's --nthreads, --memory-limit, --tls-*: see above
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        data: dict[str, Any] = json.loads(Path(args.worker_file).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read the worker file {args.worker_file} ({exc}); the run that submitted this job "
                        "has ended, or its run directory is not on a file system this node shares") from None
    site: Site = parse_site_dict(data["site"], origin=f"site of {args.worker_file}")
    shape = job_shapes(site)[data["pool"]]
    allocation = allocation_from_env(shape.site)
    workers, notes = job_workers(shape, args.name, allocation, os.environ, bind=True)
    now, (job_ends, limit), run_ends = time.time(), job_end(shape.site, allocation), data.get("end_time")
    remaining = job_ends - now if job_ends else None
    run_remaining = run_ends - now if run_ends else None
    cut = limit is not None and limit < shape.walltime  # the launcher cut it to the run's end
    life, stagger = lifetime(shape.site, remaining, run_remaining, cut=cut)
    # the last resort: half the margin before the job's end, or half RUN_END_MARGIN before the run's
    last = life + stagger + shape.site.lifetime_margin // 2
    if run_remaining is not None:
        last = min(last, int(run_remaining) - RUN_END_MARGIN // 2)
    os.environ.update(data["env"])  # the run's worker environment (Prefect API, logging) for every process here
    for note in notes:
        logger.info(note)
    start_worker_forkserver(forkserver_env(data["env"], [w.spec for w in workers]), worker_preload(os.environ))
    return asyncio.run(_serve(data, shape, workers, args, life, stagger, max(1, last)))


async def _serve(data: dict[str, Any], shape: JobShape, workers: list[JobWorker], args: argparse.Namespace,
                 life: int, stagger: int, last: int) -> int:
    from distributed import Nanny

    security = security_from(data["tls"])
    site = shape.site
    where = {"interface": site.interface} if site.interface else {}
    if any(w.spec.cpus for w in workers):
        from hpc_garage.launchers.affinity import BoundWorker

        where["worker_class"] = BoundWorker  # binds itself to the $HPC_GARAGE_CPUS in its env (unset: unbound)
    nannies = [
        Nanny(data["address"], name=w.name, nthreads=w.spec.nthreads, memory_limit=w.spec.memory_limit,
              resources=w.resources, env={**data["env"], **w.env}, security=security,
              protocol="tls" if security else "tcp", local_directory=local_directory(site.local_directory),
              death_timeout=args.death_timeout, preload=dask_worker_preload(), **where)
        for w in workers
    ]
    loop = asyncio.get_running_loop()
    stopping: list[int] = []

    def stop(sig: int) -> None:  # scancel/qdel, or the walltime
        stopping.append(sig)
        # when it arrived, to the millisecond: the batch system's own line has whole seconds, and a signal can
        # reach a job seconds after scancel on a busy node
        at = datetime.datetime.now().isoformat(timespec="milliseconds")
        logger.info(f"got {signal.Signals(sig).name} at {at}: killing this job's worker processes")
        end_workers(nannies, f"worker job got signal {sig}")

    def last_resort() -> None:
        logger.info("the end of this job (or of its run) is near and its workers were not retired: stopping "
                    "them (a task still running runs again elsewhere)")
        end_workers(nannies, "job's end")

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    loop.call_later(last, last_resort)
    node = node_name(os.environ)
    await asyncio.gather(*(n.start() for n in nannies))
    for w in workers:
        gpus = {k: w.env[k] for k in VARIABLES[site.node.gpu_vendor] if k in w.env}
        cores = f", cores {w.env[CPUS_ENV]}" if w.spec.cpus else ""
        logger.info(f"worker {w.name} on {node}: {w.spec.nthreads} threads, {format_bytes(w.spec.memory_limit)}, "
                    f"resources {w.spec.resources_arg}, {' '.join(f'{k}={v}' for k, v in gpus.items()) or 'no GPUs'}"
                    f"{cores}; retires after {format_walltime(life)} ± {stagger} s")
    await asyncio.gather(*(n.finished() for n in nannies))
    return 0 if not stopping else 128 + stopping[0]


def end_workers(nannies: list[Any], reason: str) -> None:
    """Kill each worker process, then close its nanny: the scheduler hears the worker is gone only once its
    task no longer runs (a worker that closes itself waits for its task thread while the scheduler has already
    handed the task to another worker: two runs at once)."""
    for n in nannies:
        process = getattr(n.process, "process", None)
        pid = getattr(process, "pid", None)
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        asyncio.ensure_future(n.close(timeout=10, reason=reason))


if __name__ == "__main__":
    run_entry(main)
