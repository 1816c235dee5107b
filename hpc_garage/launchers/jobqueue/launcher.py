"""The jobqueue launcher: workers in batch jobs of their own, submitted and cancelled as work comes and goes.

`hpc-garage run` keeps its one scheduler, in its own process, with TLS: every pool of worker jobs attaches
to it, through a dask-jobqueue cluster per pool that is pointed at that scheduler instead of starting one
(`jobs` renders, submits and cancels the jobs). One loop here scales every pool: it observes the scheduler's
own state (it lives in this process) and asks the batch system about jobs whose workers have not arrived
(`observing`), and applies the policy of `scaling`: `pool_targets` per pool, new jobs as work arrives, idle
ones cancelled, expiring and ended ones replaced, never more than `max_jobs_in_queue`, and a pool whose jobs
keep failing stopped rather than resubmitted forever (`records` keeps every job's record and what happened to it). Tasks
without resource tags get the UNTAGGED marker on the scheduler (a scheduler plugin), so they run only on pools
that take them, whichever client submitted them.
Workers are retired by this loop, not by Dask's `--lifetime` (see `scaling`; `retirement` does it): a job
stops taking tasks a drain window before its end, and retires once none runs on it. The run's own end
(`end_time`: the driver job's, or `--time` on the login node; see `plan`) bounds every worker job: their
walltime and their workers' lifetime end before it, and no job is submitted that could not start a task
before it.
Teardown cancels every job this run submitted; `abandon()` does it once more, synchronously, if the event
loop was cut short. Worker jobs of a run that was killed outright exit after `death_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import warnings
from typing import TYPE_CHECKING, Any

from hpc_garage.compat import correct_state, scheduler_at
from hpc_garage.core.errors import UserError
from hpc_garage.variables import POOL_RESOURCES_ENV
from hpc_garage.core.pools import UNTAGGED, job_shapes, pool_offers, untagged_restrictions
from hpc_garage.core.site import Site
from hpc_garage.core.units import format_walltime
from hpc_garage.launchers.common import Launcher, security_from
from hpc_garage.launchers.jobqueue.jobs import (
    Submissions,
    _classes,
    cancel_jobs,
    job_kwargs,
    worker_job_file,
    worker_job_name,
)
from hpc_garage.launchers.jobqueue.observing import observe, poll_batch_system, pool_states
from hpc_garage.launchers.jobqueue.plan import initial_workers
from hpc_garage.launchers.jobqueue.records import JobBook
from hpc_garage.launchers.jobqueue.retirement import (
    drain,
    drain_window_of,
    finish_retired,
    let_jobs_end,
    read_clocks,
    retire_drained,
    workers_of,
)
from hpc_garage.launchers.jobqueue.scaling import (
    RETIRE_GRACE,
    TAKING,
    TO_REPLACE,
    JobRecord,
    JobState,
    change,
    new_job_walltime,
    pool_targets,
    stopped_as,
    to_let_go,
)

if TYPE_CHECKING:
    from hpc_garage.rundir import RunDir

INTERVAL = 1.0  # seconds between scaling decisions
POLL_EVERY = 5.0  # seconds between asking the batch system about jobs whose workers have not arrived

logger = logging.getLogger(__name__)  # the driver's stderr (the job log): worker jobs, their failures


class JobqueueLauncher(Launcher):
    """Worker jobs for every pool of a jobqueue site, attached to `run`'s scheduler, scaled by one loop."""

    def __init__(self, site: Site, run_id: str, end_time: float | None = None) -> None:
        self.site = site
        self.end_time = end_time  # epoch seconds: when the run ends (its driver job's end, or --time)
        self.initial = set(initial_workers(site))  # failure() asks every 0.1 s while workers start
        self.run_id = run_id
        self.shapes = job_shapes(site)
        self.scheduler_host = {"interface": site.interface} if site.interface else {"host": None}
        self.command_env = {POOL_RESOURCES_ENV: json.dumps(pool_offers(self.shapes))}
        self.scheduler: Any = None
        self.clusters: dict[str, Any] = {}
        self.book = JobBook(site, run_id, self.shapes)
        self.loop_task: asyncio.Task[None] | None = None
        self.draining_now = False
        self.last_poll = 0.0
        self.submissions = Submissions()
        self.stopped = False  # stop() ran to its end

    # ---- Launcher

    async def start(self, address: str, tls: dict[str, str] | None, worker_env: dict[str, str],
                    rundir: RunDir) -> None:
        from hpc_garage.files import write_private

        self.book.rundir = rundir
        self.scheduler = scheduler_at(address)
        if self.scheduler is None:
            raise UserError(f"the jobqueue launcher runs inside `hpc-garage run`, next to its scheduler ({address})")
        if any(shape.marker for shape in self.shapes.values()):
            self.scheduler.add_plugin(_untagged_plugin(), name="hpc-garage-untagged", idempotent=True)
        logs = rundir.worker_logs
        logs.mkdir(mode=0o700, exist_ok=True)
        security = security_from(tls)
        job_cls, cluster_cls = _classes(self.site.scheduler)
        job_cls.submissions = self.submissions
        for pool, shape in self.shapes.items():
            plan_file = rundir.worker_file(pool)
            write_private(plan_file, json.dumps(worker_job_file(self.site, pool, address=address, tls=tls,
                                                            worker_env=worker_env, end_time=self.end_time)))
            kwargs = job_kwargs(shape, plan_file=str(plan_file), log_dir=str(logs),
                                job_name=worker_job_name(pool, self.run_id))
            cluster = cluster_cls(asynchronous=True, name=pool, security=security, silence_logs=False, **kwargs)
            cluster.shutdown_scheduler = False  # the scheduler is run's: closing a pool must not close it
            cluster.scheduler = self.scheduler  # attach instead of starting one (SpecCluster._start checks)
            with warnings.catch_warnings():  # each pool subscribes to worker status; the last one is kept
                warnings.filterwarnings("ignore", "Scheduler already contains a plugin with name worker-status")
                await cluster
            self.clusters[pool] = cluster
        logger.info(f"worker jobs: {', '.join(self.book.describe(p) for p in self.shapes)}; logs in {logs}")
        await self._step()
        self.loop_task = asyncio.create_task(self._loop())

    def failure(self) -> str | None:
        return self.book.first_failure(self.initial)

    def draining(self) -> None:
        self.draining_now = True
        if self.loop_task is not None:
            self.loop_task.cancel()

    async def stop(self) -> None:
        self.draining()
        if self.loop_task is not None:
            with contextlib.suppress(BaseException):
                await self.loop_task
        await let_jobs_end(self.book, RETIRE_GRACE)
        for pool, cluster in self.clusters.items():
            try:
                await asyncio.wait_for(cluster.close(), 60)
            except Exception as exc:  # noqa: BLE001 - the sweep below cancels what is left
                logger.debug("closing pool %s: %r", pool, exc)
        for rec in self.book.jobs.values():
            if (state := stopped_as(rec)) is not None:
                self.book.finish(rec, state, "retired" if state == JobState.RETIRED else "cancel")
        await self.submissions.settle()
        await asyncio.to_thread(self._cancel_leftovers)
        for plan_file in self.book.rundir.worker_files() if self.book.rundir else []:
            plan_file.unlink(missing_ok=True)  # holds the Prefect API's credentials
        self.book.write()
        self.stopped = True

    def abandon(self) -> None:
        """Cancel every job this run submitted, once more and synchronously (an interrupted teardown)."""
        if not self.stopped:
            self._cancel_leftovers(every=True)

    def _cancel_leftovers(self, every: bool = False) -> None:
        """One `scancel`/`qdel` for the jobs that may still be queued or running."""
        cancel_jobs(self.site.scheduler, self.book.unfinished_ids(self.submissions.ids, every))

    # ---- scaling

    async def _loop(self) -> None:
        while not self.draining_now:
            await asyncio.sleep(INTERVAL)
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - one bad step must not stop scaling for the whole run
                logger.warning("scaling step failed: %s", exc, exc_info=True)

    async def _step(self) -> None:
        """Observe the jobs, decide how many each pool needs, submit or cancel to get there."""
        if self.draining_now or self.scheduler is None or self.scheduler.status.name != "running":
            return
        now = time.monotonic()
        observe(self.book, self.clusters, self.scheduler, self.end_time, now)
        await read_clocks(self.book, now)
        if now - self.last_poll >= POLL_EVERY:
            self.last_poll = now
            await poll_batch_system(self.book, self.site.scheduler)
        for rec in [r for r in self.book.jobs.values() if r.state in TO_REPLACE and r.name in
                    self.clusters[r.pool].worker_spec]:
            await self.clusters[rec.pool].scale_down([rec.name])  # gone: out of the cluster's spec, so it is replaced
        await retire_drained(self.scheduler, self.book, now)
        await finish_retired(self.clusters, self.book, now)
        targets = pool_targets(list(self.shapes.values()), pool_states(self.book, self.scheduler),
                               self.site.jobqueue.max_jobs_in_queue)
        for pool, cluster in self.clusters.items():
            live = self.book.live(pool)
            if pool in self.book.stopped_pools or self.draining_now:
                continue
            more = change(targets[pool], len(live), self.shapes[pool].site.jobqueue.adaptive)
            if more > 0 and self._life_left(pool, time.time()) is not None:
                await self._grow(pool, cluster, more)
            elif more < 0:
                await self._shrink(pool, cluster, -more, now)
        self.book.write()

    async def _grow(self, pool: str, cluster: Any, count: int) -> None:
        """Add job specs as SpecCluster.scale does, and submit them now, so a refusal is seen here."""
        from distributed.core import Status

        new = []
        walltime = self._life_left(pool, time.time())
        for _ in range(count):
            spec = cluster.new_worker_spec()
            if walltime is not None and walltime < self.shapes[pool].walltime:  # the run ends first
                minutes = max(60, walltime // 60 * 60)  # the batch system counts whole minutes
                spec = {name: {**one, "options": {**one["options"], "walltime": format_walltime(minutes)}}
                        for name, one in spec.items()}
            cluster.worker_spec.update(spec)
            new += list(spec)
        for name in new:
            self.book.jobs[name] = JobRecord(pool=pool, name=name, submitted=time.time(),
                                             cut=walltime is not None and walltime < self.shapes[pool].walltime)
        try:
            await correct_state(cluster)
        except Exception as exc:  # noqa: BLE001 - sbatch refused: say why, stop the pool, do not retry blindly
            for name in new:
                job = cluster.workers.get(name)
                if job is None or not getattr(job, "job_id", None):
                    if job is not None:
                        job.status = Status.failed  # never started: nothing for SpecCluster to close
                    self.book.finish(self.book.jobs[name], JobState.FAILED, "failed")
                    del cluster.worker_spec[name]
                    cluster.workers.pop(name, None)
            self.book.stop_pool(pool, f"submitting a worker job of pool {pool} failed: {_said(exc)}")
        observe(self.book, self.clusters, self.scheduler, self.end_time, time.monotonic())

    async def _shrink(self, pool: str, cluster: Any, surplus: int, now: float) -> None:
        """Cancel jobs not started yet; retire the workers of jobs idle for idle_timeout (their data moves
        to other workers, then their processes exit and the job ends by itself: see `finish_retired`)."""
        live = {r.name: r for r in self.book.live(pool)}
        timeout = self.shapes[pool].site.jobqueue.idle_timeout
        chosen = to_let_go(live.values(), now, timeout, surplus)
        for name in chosen:
            rec = live[name]
            if rec.started is None:
                await cluster.scale_down([name])  # scancel: still queued (or just starting)
                self.book.finish(rec, JobState.CANCELLED, "cancel")
                continue
            if rec.state in TAKING:
                drain(self.scheduler, self.book, rec, workers_of(self.scheduler, self.book, rec), now, "idle")

    def _life_left(self, pool: str, now: float) -> int | None:
        """Seconds a job of `pool` submitted now may live (see `new_job_walltime`); None: submit none."""
        return new_job_walltime(self.shapes[pool].walltime, self.end_time, now, drain_window_of(self.scheduler))


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
