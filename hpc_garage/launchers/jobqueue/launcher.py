"""The jobqueue launcher: workers in batch jobs of their own, submitted and cancelled as work comes and goes.

`hpc-garage run` keeps its one scheduler, in its own process, with TLS: every pool of worker jobs attaches
to it. Per pool, a dask-jobqueue `SLURMCluster`/`PBSCluster` (so its own job classes, `job_script()`,
`sbatch`/`qsub`, `scancel`/`qdel`, and SpecCluster's `<job>-<k>` worker naming) is pointed at that scheduler
instead of starting one. What dask-jobqueue leaves out is added around it, not rewritten:
- the job's command is `python -m hpc_garage.launchers.jobqueue.worker`, which reads the job's *real*
  allocation and starts one Nanny per WorkerSpec of the layout, each pinned to its own GPU (see that module);
- the job header gets the GPUs (`--gres=gpu:N`, `select=…:ngpus=N`), the exact memory, and its log file;
- one loop here scales every pool: `pools.pool_targets` from the scheduler's own state (it lives in this
  process), new jobs as work arrives, idle ones cancelled, retired ones replaced, never more than
  `max_jobs_in_queue`, and a pool whose jobs keep failing is stopped rather than resubmitted forever;
- tasks without resource tags get the UNTAGGED marker on the scheduler (a scheduler plugin), so they run
  only on pools that take them, whichever client submitted them.
Teardown cancels every job this run submitted; `abandon()` does it once more, synchronously, if the event
loop was cut short. Worker jobs of a run that was killed outright exit after `death_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hpc_garage.compat import correct_state, scheduler_at
from hpc_garage.core.errors import UserError
from hpc_garage.launchers.common import Launcher, security_from
from hpc_garage.core.layout import Layout, WorkerSpec
from hpc_garage.core.pools import (
    POOL_RESOURCES_ENV,
    UNTAGGED,
    JobShape,
    PoolState,
    idle_jobs,
    job_shapes,
    lifetime,
    pool_loads,
    pool_offers,
    pool_targets,
    untagged_restrictions,
    worker_names,
)
from hpc_garage.core.site import Site
from hpc_garage.core.units import format_walltime

WORKER_MODULE = "hpc_garage.launchers.jobqueue.worker"
WORKER_FILE_PREFIX = "jobqueue-"  # <run dir>/jobqueue-<pool>.json: what a worker job reads (0600)
JOBS_FILE = "worker-jobs.json"  # <run dir>/worker-jobs.json: every worker job of the run, and the events
LOG_DIR = "worker-logs"
INTERVAL = 1.0  # seconds between scaling decisions
GONE_AFTER = 5.0  # a started job whose workers have all been gone this long has ended
RETIRE_GRACE = 3.0  # seconds a retired job gets to end by itself before it is cancelled
REPLACE_AHEAD = 60.0  # a job is replaced this long (or twice its queue wait) before its workers' lifetime ends
POLL_EVERY = 5.0  # seconds between asking the batch system about jobs whose workers have not arrived
FAILURES_BEFORE_GIVING_UP = 3  # worker jobs of a pool that end without a worker, in a row

log = logging.getLogger("hpc_garage.jobqueue")


def say(message: str) -> None:
    print(f"hpc-garage: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------- the worker job script


def submit_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment `sbatch`/`qsub` run in: the driver's, without its own job's variables and GPUs."""
    from hpc_garage.schedulers.base import submit_env as scrubbed

    return scrubbed(os.environ if env is None else env)


def job_kwargs(shape: JobShape, *, plan_file: str, log_dir: str, job_name: str,
               python: str | None = None) -> dict[str, Any]:
    """dask-jobqueue's keyword arguments for one pool's worker jobs. Every value that reaches the job
    script is checked as the submit path checks it (dask-jobqueue writes its values unquoted)."""
    from hpc_garage.schedulers.jobscript import directive, plain

    site, jq = shape.site, shape.site.jobqueue
    python = python or (os.path.expanduser(site.python) if site.python else sys.executable)
    common: dict[str, Any] = {
        "cores": shape.cores,
        "memory": shape.memory,
        "processes": shape.workers_per_job,
        "worker_threads": shape.layout.workers[0].nthreads,
        "worker_memory_limit": shape.layout.workers[0].memory_limit,
        "job_name": plain(job_name, "worker job name"),
        "walltime": format_walltime(shape.walltime),
        "python": shlex.quote(python),
        "worker_command": WORKER_MODULE,
        "worker_extra_args": ["--hpc-garage-worker-file", shlex.quote(plan_file)],
        "death_timeout": jq.death_timeout,
        "job_script_prologue": list(site.setup),
        "job_directives_skip": [],
        "shebang": "#!/usr/bin/env bash",
        "log_directory": None,  # dask-jobqueue would create it while rendering; the log directive is ours
        "interface": None,  # the worker reads the site's interface itself
        "local_directory": None,  # expanded inside the job, where $TMPDIR means something
    }
    from hpc_garage.schedulers import get
    from hpc_garage.schedulers.base import WorkerJob

    job = WorkerJob(
        pool=shape.pool, cores=shape.cores, memory=shape.memory, gpus=shape.gpus, gpu_type=site.node.gpu_type,
        queue=plain(site.queue, "queue") if site.queue else None,
        account=plain(site.account, "account") if site.account else None, qos=site.qos,
        log_dir=plain(log_dir, "the run directory (worker job logs go there)"),
        directives=tuple(directive(d, "a directive of the site") for d in site.directives),
    )
    return common | get(site.scheduler).worker_job_options(job)


def _classes(scheduler: str) -> tuple[type, type]:
    """dask-jobqueue's job and cluster classes for this batch system, with the few changes the launcher needs."""
    from hpc_garage.compat import attached_spec_cluster, hooked_job

    previous = signal.getsignal(signal.SIGINT)
    from dask_jobqueue import PBSCluster, SLURMCluster
    from dask_jobqueue.pbs import PBSJob
    from dask_jobqueue.slurm import SLURMJob

    if threading.current_thread() is threading.main_thread() and previous is not None:
        # dask_jobqueue.runner sets SIGINT to `sys.exit()` when imported (0.9.0): Ctrl-C would then skip
        # `run`'s teardown, leaving worker jobs in the queue. Put back whatever handled it before.
        signal.signal(signal.SIGINT, previous)

    base_cluster, base_job = (SLURMCluster, SLURMJob) if scheduler == "slurm" else (PBSCluster, PBSJob)

    class PoolJob(hooked_job(base_job)):  # type: ignore[misc]
        submissions: Submissions | None = None  # set by the launcher: every job id this run was given

        def __init__(self, *args: Any, worker_threads: int | None = None, worker_memory_limit: int | None = None,
                     **kwargs: Any) -> None:
            # the command line then shows each worker's threads and memory limit as the layout gives them
            self._layout = (worker_threads, worker_memory_limit)
            super().__init__(*args, **kwargs)

        @property
        def worker_process_threads(self) -> int:
            return self._layout[0] or super().worker_process_threads

        @property
        def worker_process_memory(self) -> str:
            from dask.utils import format_bytes

            limit = self._layout[1]
            return format_bytes(limit).replace(" ", "") if limit else super().worker_process_memory

        @staticmethod
        def call_options() -> dict[str, Any]:
            # a clean environment (see submit_env), and out of the terminal's process group: a Ctrl-C meant
            # for `run` must not kill the sbatch or scancel under way
            return {"env": submit_env(), "start_new_session": True}

        def submitted(self, submission: asyncio.Future[str], parse: Any) -> None:
            # its job id is recorded even if whoever awaits it is cancelled: a job submitted by an
            # interrupted start-up is still one to cancel
            if self.submissions is not None:
                self.submissions.track(submission, parse)

    class PoolCluster(attached_spec_cluster(base_cluster)):  # type: ignore[misc]
        """One pool's jobs, attached to `run`'s scheduler; the launcher (not SpecCluster) replaces ended jobs."""

        job_cls = PoolJob

    return PoolJob, PoolCluster


class Submissions:
    """Every job id sbatch/qsub gave this run, and the submissions still under way."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.inflight: set[asyncio.Future[str]] = set()

    def track(self, submission: asyncio.Future[str], parse: Any) -> None:
        self.inflight.add(submission)

        def done(f: asyncio.Future[str]) -> None:
            self.inflight.discard(f)
            if not f.cancelled() and f.exception() is None:
                with contextlib.suppress(ValueError):
                    self.ids.append(str(parse(f.result())))

        submission.add_done_callback(done)

    async def settle(self, timeout: float = 60) -> None:
        """Wait for submissions under way, so their ids are known before cancelling."""
        if self.inflight:
            await asyncio.wait(list(self.inflight), timeout=timeout)


def worker_job_name(pool: str, run_id: str) -> str:
    return f"hpcg-{pool}-{run_id}"[:64]


def worker_scripts(site: Site, *, run_root: Path | None = None) -> str:
    """The worker job script of every pool, as it will be submitted (run-specific values as placeholders)."""
    from distributed.security import Security

    from hpc_garage.schedulers.submission import run_root as site_run_root

    run_dir = (run_root or site_run_root(site)) / "RUN_ID"
    cert, key = str(run_dir / "tls" / "cert.pem"), str(run_dir / "tls" / "key.pem")
    security = Security(require_encryption=True, tls_ca_file=cert, tls_worker_cert=cert, tls_worker_key=key)
    parts = []
    for pool, shape in job_shapes(site).items():
        job_cls, _ = _classes(shape.site.scheduler)
        kwargs = job_kwargs(shape, plan_file=str(run_dir / f"{WORKER_FILE_PREFIX}{pool}.json"),
                            log_dir=str(run_dir / LOG_DIR), job_name=worker_job_name(pool, "RUN_ID"))
        job = job_cls(scheduler="tls://SCHEDULER:PORT", name=f"{pool}-0", security=security,
                      protocol="tls://", **kwargs)
        fewest, most = shape.site.jobqueue.bounds
        scaling = f"{fewest}..{most} jobs, adaptive" if shape.site.jobqueue.adaptive else f"{fewest} job(s)"
        parts.append(f"# ---- worker job of pool {pool} ({scaling}; {shape.workers_per_job} workers per job) ----\n"
                     + job.job_script())
    return "\n".join(parts)


def worker_job_file(site: Site, pool: str, *, address: str, tls: dict[str, str] | None,
                worker_env: dict[str, str]) -> dict[str, Any]:
    """What a worker job of `pool` reads at start-up: the site as written, the scheduler, TLS, environment."""
    pool_site = site.pool_sites()[pool]
    return {"site": site.raw, "pool": pool, "address": address, "tls": tls,
            "env": {**worker_env, **pool_site.env}}


# --------------------------------------------------------------------------------------------- the launcher


@dataclass
class JobRecord:
    """One worker job as the launcher follows it."""

    pool: str
    name: str  # the SpecCluster's name for it; its workers are <name>-<k>
    job_id: str | None = None
    state: str = "submitting"  # submitting pending running expiring retiring | ended retired cancelled failed
    nodes: str | None = None
    submitted: float | None = None  # epoch seconds
    started: float | None = None  # first worker registered
    finished: float | None = None
    last_seen: float = 0.0  # monotonic: a worker of it was registered
    busy: float | None = None  # monotonic: a worker of it last had tasks (idle since start counts from start)
    retiring: float | None = None  # monotonic: its workers were retired (idle), the job is ending
    started_at: float | None = None  # monotonic twin of `started`
    workers: int = 0  # registered now


def initial_layout(site: Site) -> tuple[Layout, list[str]]:
    """What `run` waits for before COMMAND: the workers of each pool's first jobs (its fixed count, or its
    minimum), named as their jobs will name them; and what to say about the pools."""
    from hpc_garage.core.allocation import Allocation

    shapes = job_shapes(site)
    workers: list[WorkerSpec] = []
    nodes = []
    for pool, shape in shapes.items():
        for i in range(shape.site.jobqueue.bounds[0]):
            for spec, name in zip(shape.layout.workers, worker_names(f"{pool}-{i}", shape.workers_per_job)):
                workers.append(replace(spec, name=name, node=len(nodes)))
            nodes.append(shape.node)
    first = next(iter(shapes.values()))
    allocation = Allocation(nodes=tuple(nodes) or (first.node,), source="request", walltime=first.walltime)
    notes = [f"unused in each worker job of pool {pool}: {x}" for pool, shape in shapes.items()
             for x in shape.layout.leftovers]
    return Layout(site=site, allocation=allocation, workers=workers, leftovers=[]), notes


def initial_workers(site: Site) -> list[str]:
    """The workers `run` waits for before COMMAND: those of each pool's first jobs (fixed count, or minimum)."""
    names = []
    for pool, shape in job_shapes(site).items():
        for i in range(shape.site.jobqueue.bounds[0]):
            names += worker_names(f"{pool}-{i}", shape.workers_per_job)
    return names


class JobqueueLauncher(Launcher):
    """Worker jobs for every pool of a jobqueue site, attached to `run`'s scheduler, scaled by one loop."""

    def __init__(self, site: Site, run_id: str) -> None:
        self.site = site
        self.initial = set(initial_workers(site))  # failure() asks every 0.1 s while workers start
        self.run_id = run_id
        self.shapes = job_shapes(site)
        self.scheduler_host = {"interface": site.interface} if site.interface else {"host": None}
        self.command_env = {POOL_RESOURCES_ENV: json.dumps(pool_offers(self.shapes))}
        self.scheduler: Any = None
        self.clusters: dict[str, Any] = {}
        self.jobs: dict[str, JobRecord] = {}
        self.events: list[dict[str, Any]] = []
        self.failed_in_row: dict[str, int] = dict.fromkeys(self.shapes, 0)
        self.queue_wait: dict[str, float] = {}  # seconds from submission to the first worker, last seen
        self.stopped_pools: dict[str, str] = {}  # pool → why it no longer submits
        self.rundir: Any = None
        self.loop_task: asyncio.Task[None] | None = None
        self.draining_now = False
        self.last_poll = 0.0
        self.submissions = Submissions()
        self.stopped = False  # stop() ran to its end

    # ---- Launcher

    async def start(self, address: str, tls: dict[str, str] | None, worker_env: dict[str, str],
                    rundir: Any) -> None:
        from hpc_garage.files import write_private

        self.rundir = rundir
        self.scheduler = scheduler_at(address)
        if self.scheduler is None:
            raise UserError(f"the jobqueue launcher runs inside `hpc-garage run`, next to its scheduler ({address})")
        if any(shape.marker for shape in self.shapes.values()):
            self.scheduler.add_plugin(_untagged_plugin(), name="hpc-garage-untagged", idempotent=True)
        logs = rundir.path / LOG_DIR
        logs.mkdir(mode=0o700, exist_ok=True)
        security = security_from(tls)
        job_cls, cluster_cls = _classes(self.site.scheduler)
        job_cls.submissions = self.submissions
        for pool, shape in self.shapes.items():
            plan_file = rundir.path / f"{WORKER_FILE_PREFIX}{pool}.json"
            write_private(plan_file, json.dumps(worker_job_file(self.site, pool, address=address, tls=tls,
                                                            worker_env=worker_env)))
            kwargs = job_kwargs(shape, plan_file=str(plan_file), log_dir=str(logs),
                                job_name=worker_job_name(pool, self.run_id))
            cluster = cluster_cls(asynchronous=True, name=pool, security=security, silence_logs=False, **kwargs)
            cluster.shutdown_scheduler = False  # the scheduler is run's: closing a pool must not close it
            cluster.scheduler = self.scheduler  # attach instead of starting one (SpecCluster._start checks)
            with warnings.catch_warnings():  # each pool subscribes to worker status; the last one is kept
                warnings.filterwarnings("ignore", "Scheduler already contains a plugin with name worker-status")
                await cluster
            self.clusters[pool] = cluster
        say(f"worker jobs: {', '.join(self._describe(p) for p in self.shapes)}; logs in {logs}")
        await self._step()
        self.loop_task = asyncio.create_task(self._loop())

    def failure(self) -> str | None:
        if self.stopped_pools:
            return "; ".join(self.stopped_pools.values())
        for rec in self.jobs.values():
            if rec.state == "failed" and any(n in self.initial for n in worker_names(rec.name, self._per_job(rec.pool))):
                return self._failure_text(rec)
        return None

    def draining(self) -> None:
        self.draining_now = True
        if self.loop_task is not None:
            self.loop_task.cancel()

    async def stop(self) -> None:
        self.draining()
        if self.loop_task is not None:
            with contextlib.suppress(BaseException):
                await self.loop_task
        await self._let_jobs_end(RETIRE_GRACE)
        for pool, cluster in self.clusters.items():
            try:
                await asyncio.wait_for(cluster.close(), 60)
            except Exception as exc:  # noqa: BLE001 - the sweep below cancels what is left
                log.debug("closing pool %s: %r", pool, exc)
        for rec in self.jobs.values():
            if rec.state == "retiring" and rec.workers == 0:
                rec.state, rec.finished = "retired", time.time()
                self._event("retired", rec)
            elif rec.state in ("submitting", "pending", "running", "expiring", "retiring"):
                rec.state, rec.finished = "cancelled", time.time()
                self._event("cancel", rec)
        await self.submissions.settle()
        await asyncio.to_thread(self._cancel_leftovers)
        for plan_file in self.rundir.path.glob(f"{WORKER_FILE_PREFIX}*.json") if self.rundir else []:
            plan_file.unlink(missing_ok=True)  # holds the Prefect API's credentials
        self._write_jobs()
        self.stopped = True

    async def _let_jobs_end(self, grace: float) -> None:
        """Jobs whose workers were told to leave (`run` retires them first) end by themselves in a moment;
        wait that moment, so they end COMPLETED rather than CANCELLED. What is left is cancelled after."""
        from hpc_garage.schedulers import get

        waiting = {r.job_id: r for r in self.jobs.values()
                   if r.job_id and r.state in ("running", "expiring", "retiring")}
        deadline = time.monotonic() + grace
        batch = get(self.site.scheduler)
        while waiting and time.monotonic() < deadline:
            try:
                statuses = await asyncio.to_thread(batch.statuses, list(waiting))
            except UserError:
                return
            for job_id in [i for i in waiting if i not in statuses or statuses[i].phase == "finished"]:
                rec = waiting.pop(job_id)
                rec.state, rec.finished = ("retired" if rec.state == "retiring" else "ended"), time.time()
                self._event(rec.state, rec)
            if waiting:
                await asyncio.sleep(0.5)

    def abandon(self) -> None:
        """Cancel every job this run submitted, once more and synchronously (an interrupted teardown)."""
        if not self.stopped:
            self._cancel_leftovers(every=True)

    # ---- scaling

    async def _loop(self) -> None:
        while not self.draining_now:
            await asyncio.sleep(INTERVAL)
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one bad step must not stop scaling for the whole run
                log.warning("scaling step failed: %s", exc, exc_info=True)

    async def _step(self) -> None:
        """Observe the jobs, decide how many each pool needs, submit or cancel to get there."""
        if self.draining_now or self.scheduler is None or self.scheduler.status.name != "running":
            return
        now = time.monotonic()
        self._observe(now)
        if now - self.last_poll >= POLL_EVERY:
            self.last_poll = now
            await self._poll_batch_system()
        for rec in [r for r in self.jobs.values() if r.state in ("ended", "failed") and r.name in
                    self.clusters[r.pool].worker_spec]:
            await self.clusters[rec.pool].scale_down([rec.name])  # gone: out of the cluster's spec, so it is replaced
        await self._finish_retired(now)
        targets = pool_targets(list(self.shapes.values()), self._pool_states(), self.site.jobqueue.max_jobs_in_queue)
        for pool, cluster in self.clusters.items():
            live = self._live(pool)
            if pool in self.stopped_pools or self.draining_now:
                continue
            if targets[pool] > len(live):
                await self._grow(pool, cluster, targets[pool] - len(live))
            elif targets[pool] < len(live) and self.shapes[pool].site.jobqueue.adaptive:
                await self._shrink(pool, cluster, len(live) - targets[pool], now)
        self._write_jobs()

    def _observe(self, now: float) -> None:
        registered = {ws.name: ws for ws in self.scheduler.workers.values()}
        for pool, cluster in self.clusters.items():
            for name in list(cluster.worker_spec):
                rec = self.jobs.get(name)
                if rec is None or rec.state in ("ended", "failed", "cancelled", "retired"):
                    continue
                job = cluster.workers.get(name)
                if rec.job_id is None and job is not None and getattr(job, "job_id", None):
                    rec.job_id, rec.state = str(job.job_id), "pending"
                    self._event("submitted", rec)
                present = [registered[n] for n in worker_names(name, self._per_job(pool)) if n in registered]
                rec.workers = len(present)
                if rec.state == "retiring":
                    continue
                if present:
                    if rec.started is None:
                        rec.started, rec.started_at, rec.state, rec.busy = time.time(), now, "running", now
                        self._event("running", rec)
                        self.failed_in_row[pool] = 0
                        self.queue_wait[pool] = rec.started - (rec.submitted or rec.started)
                    rec.last_seen = now
                    if rec.state == "running" and now >= self._retires_at(rec) - self._ahead(pool):
                        rec.state = "expiring"  # its replacement is submitted now, so no gap opens
                        self._event("expiring", rec)
                    if any(ws.processing for ws in present):
                        rec.busy = now
                elif rec.started is not None and now - rec.last_seen > GONE_AFTER:
                    rec.state, rec.finished = "ended", time.time()  # retired (lifetime) or killed: replace it
                    self._event("ended", rec)

    async def _poll_batch_system(self) -> None:
        """Ask once for every job whose workers are not (yet) there: a job that left the queue without
        them failed; record where running jobs run."""
        from hpc_garage.schedulers import get

        waiting = {r.job_id: r for r in self.jobs.values()
                   if r.job_id and r.state in ("pending", "running", "expiring")}
        if not waiting:
            return
        batch = get(self.site.scheduler)
        try:
            statuses = await asyncio.to_thread(batch.statuses, list(waiting))
        except UserError as exc:
            log.warning("asking the batch system failed: %s", exc)
            return
        for job_id, rec in waiting.items():
            status = statuses.get(job_id)
            if status is not None and status.nodes:
                rec.nodes = status.nodes
            gone = status is None or status.phase == "finished"
            if gone and rec.started is None:
                rec.state, rec.finished = "failed", time.time()
                self._event("failed", rec)
                self.failed_in_row[rec.pool] += 1
                say(f"warning: {self._failure_text(rec)}")
                if self.failed_in_row[rec.pool] >= FAILURES_BEFORE_GIVING_UP:
                    self.stopped_pools[rec.pool] = (
                        f"{self.failed_in_row[rec.pool]} worker jobs of pool {rec.pool} in a row ended before their "
                        f"workers registered; no more are submitted for it (last: {self._failure_text(rec)})")
                    say(f"error: {self.stopped_pools[rec.pool]}")
            elif gone and rec.state in ("running", "expiring") and rec.workers == 0:
                rec.state, rec.finished = "ended", time.time()
                self._event("ended", rec)

    def _pool_states(self) -> dict[str, PoolState]:
        """Each pool's jobs and load, read from the scheduler's own state (it lives in this process)."""
        owner = {n: rec.pool for rec in self.jobs.values() if rec.state in ("pending", "running", "expiring")
                 for n in worker_names(rec.name, self._per_job(rec.pool))}
        assigned: dict[str, list[Any]] = {pool: [] for pool in self.shapes}
        for ws in self.scheduler.workers.values():
            if (pool := owner.get(ws.name)) is not None:
                assigned[pool] += [ts.resource_restrictions for ts in ws.processing]
        unplaced = [ts.resource_restrictions for ts in self.scheduler.unrunnable]
        unplaced += [None] * len(self.scheduler.queued)
        loads = pool_loads(list(self.shapes.values()), unplaced, assigned)
        leaving = {pool: sum(1 for r in self.jobs.values() if r.pool == pool and r.state in ("retiring", "expiring"))
                   for pool in self.shapes}
        return {pool: PoolState(jobs=len(self._live(pool)), load=loads[pool], leaving=leaving[pool])
                for pool in self.shapes}

    async def _grow(self, pool: str, cluster: Any, count: int) -> None:
        """Add job specs as SpecCluster.scale does, and submit them now, so a refusal is seen here."""
        from distributed.core import Status

        new = []
        for _ in range(count):
            spec = cluster.new_worker_spec()
            cluster.worker_spec.update(spec)
            new += list(spec)
        for name in new:
            self.jobs[name] = JobRecord(pool=pool, name=name, submitted=time.time())
        try:
            await correct_state(cluster)
        except Exception as exc:  # noqa: BLE001 - sbatch refused: say why, stop the pool, do not retry blindly
            for name in new:
                job = cluster.workers.get(name)
                if job is None or not getattr(job, "job_id", None):
                    if job is not None:
                        job.status = Status.failed  # never started: nothing for SpecCluster to close
                    rec = self.jobs[name]
                    rec.state, rec.finished = "failed", time.time()
                    self._event("failed", rec)
                    del cluster.worker_spec[name]
                    cluster.workers.pop(name, None)
            self.stopped_pools[pool] = f"submitting a worker job of pool {pool} failed: {_said(exc)}"
            say(f"error: {self.stopped_pools[pool]}")
        self._observe(time.monotonic())

    async def _shrink(self, pool: str, cluster: Any, surplus: int, now: float) -> None:
        """Cancel jobs not started yet; retire the workers of jobs idle for idle_timeout (their data moves
        to other workers, then their processes exit and the job ends by itself: see `_finish_retired`)."""
        live = {r.name: r for r in self._live(pool)}
        timeout = self.shapes[pool].site.jobqueue.idle_timeout
        chosen = idle_jobs({n: (r.busy if r.started else None) for n, r in live.items()}, now, timeout, surplus)
        for name in chosen:
            rec = live[name]
            if rec.started is None:
                await cluster.scale_down([name])  # scancel: still queued (or just starting)
                rec.state, rec.finished = "cancelled", time.time()
                self._event("cancel", rec)
                continue
            names = worker_names(name, self._per_job(pool))
            try:
                retired = await asyncio.wait_for(self.scheduler.retire_workers(
                    names=names, close_workers=True, remove=True, stimulus_id=f"hpc-garage-idle-{time.time()}"), 30)
            except (asyncio.TimeoutError, OSError):
                continue
            if len(retired) < rec.workers:
                continue  # data that no other worker can take: keep the job for now
            rec.state, rec.retiring = "retiring", now
            self._event("retire", rec)

    async def _finish_retired(self, now: float) -> None:
        """A retired job whose workers have left is out of the cluster's spec; scancel only if it lingers."""
        for rec in [r for r in self.jobs.values() if r.state == "retiring"]:
            if rec.workers == 0 and now - (rec.retiring or now) >= RETIRE_GRACE:
                await self.clusters[rec.pool].scale_down([rec.name])  # scancel: harmless once it has ended
                rec.state, rec.finished = "retired", time.time()
                self._event("retired", rec)

    # ---- bookkeeping

    def _retires_at(self, rec: JobRecord) -> float:
        """When the first worker of a job may retire (monotonic), from its pool's lifetime."""
        life, stagger = lifetime(self.shapes[rec.pool].site)
        return (rec.started_at or time.monotonic()) + life - stagger

    def _ahead(self, pool: str) -> float:
        life, _ = lifetime(self.shapes[pool].site)
        return min(max(REPLACE_AHEAD, 2 * self.queue_wait.get(pool, 0.0)), life / 2)

    def _live(self, pool: str) -> list[JobRecord]:
        return [r for r in self.jobs.values() if r.pool == pool and r.state in ("submitting", "pending", "running")]

    def _per_job(self, pool: str) -> int:
        return self.shapes[pool].workers_per_job

    def _describe(self, pool: str) -> str:
        shape = self.shapes[pool]
        fewest, most = shape.site.jobqueue.bounds
        jobs = f"{fewest}..{most} (adaptive)" if shape.site.jobqueue.adaptive else str(fewest)
        gpus = f", {shape.gpus} GPUs" if shape.gpus else ""
        workers = f"{shape.workers_per_job} worker" + ("s" if shape.workers_per_job != 1 else "")
        return (f"pool {pool} {jobs} × [{shape.cores} cores{gpus} → {workers}] "
                f"in {shape.site.queue or 'the default queue'}")

    def _failure_text(self, rec: JobRecord) -> str:
        logfile = self.rundir.path / LOG_DIR / f"{worker_job_name(rec.pool, self.run_id)}-{rec.job_id}.out" \
            if self.rundir else None
        where = f"; see {logfile}" if logfile and self.site.scheduler == "slurm" else \
            f"; see its log in {self.rundir.path / LOG_DIR}" if self.rundir else ""
        return f"worker job {rec.job_id} ({rec.name}, pool {rec.pool}) ended before its workers registered{where}"

    def _event(self, what: str, rec: JobRecord) -> None:
        self.events.append({"t": time.time(), "event": what, "job": rec.name, "pool": rec.pool, "job_id": rec.job_id})

    def _write_jobs(self) -> None:
        if self.rundir is None:
            return
        from hpc_garage.files import write_private

        data = {"run": self.run_id, "pools": {p: self._describe(p) for p in self.shapes},
                "jobs": [asdict(r) for r in self.jobs.values()], "events": self.events,
                "stopped": self.stopped_pools}
        with contextlib.suppress(OSError):
            write_private(self.rundir.path / JOBS_FILE, json.dumps(data, indent=1))

    def _cancel_leftovers(self, every: bool = False) -> None:
        """One `scancel`/`qdel` for the jobs that may still be queued or running."""
        from hpc_garage.schedulers import get

        done = {r.job_id for r in self.jobs.values() if r.state in ("ended", "failed", "retired")}
        ids = sorted({i for i in self.submissions.ids if every or i not in done})
        if not ids:
            return
        batch = get(self.site.scheduler)
        argv = [*batch.cancel_argv(ids[0])[:-1], *ids]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(argv, capture_output=True, timeout=60, env=submit_env(), start_new_session=True)


def _said(exc: BaseException) -> str:
    """What a failed sbatch/qsub said, in one line (dask-jobqueue wraps it in a long RuntimeError)."""
    text = str(exc)
    said = text.split("stderr:", 1)[1] if "stderr:" in text else text
    return " ".join(said.split())[:400] or type(exc).__name__


def _untagged_plugin() -> Any:
    """A scheduler plugin that applies the placement rule to every new task without restrictions."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class UntaggedTasks(SchedulerPlugin):
        name = "hpc-garage-untagged"

        def update_graph(self, scheduler: Any, *, tasks: list[Any], **kwargs: Any) -> None:
            for key in tasks:
                ts = scheduler.tasks.get(key)
                if ts is None or ts.state != "released" or ts.run_spec is None:
                    continue
                if ts.resource_restrictions or ts.worker_restrictions or ts.host_restrictions:
                    continue  # tagged, or pinned by the caller: theirs to decide
                ts.resource_restrictions = untagged_restrictions(None, UNTAGGED)

    return UntaggedTasks()
