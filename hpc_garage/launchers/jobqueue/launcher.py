"""The jobqueue launcher: workers in batch jobs of their own, submitted and cancelled as work comes and goes.

`hpc-garage run` keeps its one scheduler, in its own process, with TLS: every pool of worker jobs attaches
to it, through a dask-jobqueue cluster per pool that is pointed at that scheduler instead of starting one
(`jobs` renders and submits the jobs). One loop here scales every pool: it observes the scheduler's own
state (it lives in this process) and asks the batch system about jobs whose workers have not arrived, and
applies the policy of `scaling`: `pool_targets` per pool, new jobs as work arrives, idle ones cancelled,
expiring and ended ones replaced, never more than `max_jobs_in_queue`, and a pool whose jobs keep failing
stopped rather than resubmitted forever. Tasks without resource tags get the UNTAGGED marker on the
scheduler (a scheduler plugin), so they run only on pools that take them, whichever client submitted them.
Workers are retired by this loop, not by Dask's `--lifetime` (see `scaling`): a job stops taking tasks a
drain window before its end, and retires once none runs on it. The run's own end (`end_time`: the driver
job's, or `--time` on the login node) bounds every worker job: their walltime and their workers' lifetime
end before it, and no job is submitted that could not start a task before it.
Teardown cancels every job this run submitted; `abandon()` does it once more, synchronously, if the event
loop was cut short. Worker jobs of a run that was killed outright exit after `death_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from hpc_garage.compat import correct_state, scheduler_at
from hpc_garage.core.errors import UserError
from hpc_garage.core.layout import Layout, WorkerSpec
from hpc_garage.core.pools import (
    POOL_RESOURCES_ENV,
    RUN_END_MARGIN,
    UNTAGGED,
    job_shapes,
    lifetime,
    pool_offers,
    untagged_restrictions,
    worker_names,
)
from hpc_garage.core.site import Site
from hpc_garage.core.units import format_walltime
from hpc_garage.launchers.common import Launcher, security_from
from hpc_garage.launchers.jobqueue.jobs import (
    LOG_DIR,
    WORKER_FILE_PREFIX,
    Submissions,
    _classes,
    job_kwargs,
    submit_env,
    worker_job_file,
    worker_job_name,
)
from hpc_garage.launchers.jobqueue.scaling import (
    FINISHED,
    LEFT_QUEUE,
    RETIRE_GRACE,
    STARTED,
    TAKING,
    TO_REPLACE,
    WATCHED,
    JobRecord,
    JobState,
    PoolState,
    change,
    drain_window,
    drained,
    drains,
    ended_as,
    expiring,
    gives_up,
    left_queue,
    live_jobs,
    pool_loads,
    pool_state,
    pool_targets,
    retire_done,
    stopped_as,
    to_let_go,
    waited,
    worker_pools,
    workers_gone,
)

JOBS_FILE = "worker-jobs.json"  # <run dir>/worker-jobs.json: every worker job of the run, and the events
INTERVAL = 1.0  # seconds between scaling decisions
POLL_EVERY = 5.0  # seconds between asking the batch system about jobs whose workers have not arrived

log = logging.getLogger("hpc_garage.jobqueue")


def say(message: str) -> None:
    print(f"hpc-garage: {message}", file=sys.stderr, flush=True)


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


def run_end_time(site: Site, env: Mapping[str, str], walltime: int | None = None) -> float | None:
    """When the run ends (epoch seconds), which its worker jobs must not outlive: `walltime` from now (`--time`
    for a driver on the login node), else the end of the batch job `run` is in (its driver job), else None."""
    from hpc_garage.schedulers import allocation_from_env, detect, job_id

    if walltime is not None:
        return time.time() + walltime
    batch, job = detect(env, prefer=site.scheduler), job_id(env)
    if batch is None or job is None:
        return None
    with contextlib.suppress(Exception):  # the environment's end time, where the batch system exports it
        if (end := allocation_from_env(site, env).end_time) is not None:
            return end
    try:
        left = batch.time_left(job)
    except UserError as exc:
        say(f"warning: the driver job's end is unknown ({exc}); worker jobs get the site's walltime")
        return None
    return time.time() + left[0] if left is not None else None


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
        say(f"worker jobs: {', '.join(self._describe(p) for p in self.shapes)}; logs in {logs}")
        await self._step()
        self.loop_task = asyncio.create_task(self._loop())

    def failure(self) -> str | None:
        if self.stopped_pools:
            return "; ".join(self.stopped_pools.values())
        for rec in self.jobs.values():
            if rec.state == JobState.FAILED and any(n in self.initial
                                                    for n in worker_names(rec.name, self._per_job(rec.pool))):
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
            if (state := stopped_as(rec)) is not None:
                rec.state, rec.finished = state, time.time()
                self._event("retired" if state == JobState.RETIRED else "cancel", rec)
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

        waiting = {r.job_id: r for r in self.jobs.values() if r.job_id and r.state in STARTED}
        deadline = time.monotonic() + grace
        batch = get(self.site.scheduler)
        while waiting and time.monotonic() < deadline:
            try:
                statuses = await asyncio.to_thread(batch.statuses, list(waiting))
            except UserError:
                return
            for job_id in [i for i in waiting if i not in statuses or statuses[i].phase == "finished"]:
                rec = waiting.pop(job_id)
                rec.state, rec.finished = ended_as(rec), time.time()
                self._event(str(rec.state), rec)
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
        await self._read_clocks(now)
        if now - self.last_poll >= POLL_EVERY:
            self.last_poll = now
            await self._poll_batch_system()
        for rec in [r for r in self.jobs.values() if r.state in TO_REPLACE and r.name in
                    self.clusters[r.pool].worker_spec]:
            await self.clusters[rec.pool].scale_down([rec.name])  # gone: out of the cluster's spec, so it is replaced
        await self._retire_drained(now)
        await self._finish_retired(now)
        targets = pool_targets(list(self.shapes.values()), self._pool_states(), self.site.jobqueue.max_jobs_in_queue)
        for pool, cluster in self.clusters.items():
            live = self._live(pool)
            if pool in self.stopped_pools or self.draining_now:
                continue
            more = change(targets[pool], len(live), self.shapes[pool].site.jobqueue.adaptive)
            if more > 0 and self._life_left(pool, time.time()) is not None:
                await self._grow(pool, cluster, more)
            elif more < 0:
                await self._shrink(pool, cluster, -more, now)
        self._write_jobs()

    def _observe(self, now: float) -> None:
        registered = {ws.name: ws for ws in self.scheduler.workers.values()}
        for pool, cluster in self.clusters.items():
            for name in list(cluster.worker_spec):
                rec = self.jobs.get(name)
                if rec is None or rec.state in FINISHED:
                    continue
                job = cluster.workers.get(name)
                if rec.job_id is None and job is not None and getattr(job, "job_id", None):
                    rec.job_id, rec.state = str(job.job_id), JobState.PENDING
                    self._event("submitted", rec)
                present = [registered[n] for n in worker_names(name, self._per_job(pool)) if n in registered]
                rec.workers = len(present)
                if rec.state == JobState.RETIRING:
                    continue
                if present and rec.state == JobState.DRAINING:
                    rec.last_seen = now
                    continue
                if present:
                    if rec.started is None:
                        rec.started, rec.started_at, rec.state, rec.busy = time.time(), now, JobState.RUNNING, now
                        self._event("running", rec)
                        self.failed_in_row[pool] = 0
                        self.queue_wait[pool] = waited(rec)
                    rec.last_seen = now
                    life, window = self._job_life(rec), self._drain_window()
                    if expiring(rec, self.shapes[pool], now, self.queue_wait.get(pool, 0.0), window, life):
                        rec.state = JobState.EXPIRING  # its replacement is submitted now, so no gap opens
                        self._event("expiring", rec)
                    if any(ws.processing for ws in present):
                        rec.busy = now
                    if drains(rec, self.shapes[pool], now, window, life):
                        self._drain(rec, present, now, "lifetime")
                elif workers_gone(rec, now):
                    rec.state, rec.finished = JobState.ENDED, time.time()  # retired (lifetime) or killed: replace it
                    self._event("ended", rec)

    async def _poll_batch_system(self) -> None:
        """Ask once for every job whose workers are not (yet) there: a job that left the queue without
        them failed; record where running jobs run."""
        from hpc_garage.schedulers import get

        waiting = {r.job_id: r for r in self.jobs.values() if r.job_id and r.state in WATCHED}
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
            if status is not None and status.phase != "finished":
                continue
            state = left_queue(rec)
            if state == JobState.FAILED:
                rec.state, rec.finished = state, time.time()
                self._event("failed", rec)
                self.failed_in_row[rec.pool] += 1
                say(f"warning: {self._failure_text(rec)}")
                if gives_up(self.failed_in_row[rec.pool]):
                    self.stopped_pools[rec.pool] = (
                        f"{self.failed_in_row[rec.pool]} worker jobs of pool {rec.pool} in a row ended before their "
                        f"workers registered; no more are submitted for it (last: {self._failure_text(rec)})")
                    say(f"error: {self.stopped_pools[rec.pool]}")
            elif state == JobState.ENDED:
                rec.state, rec.finished = state, time.time()
                self._event("ended", rec)

    def _pool_states(self) -> dict[str, PoolState]:
        """Each pool's jobs and load, read from the scheduler's own state (it lives in this process)."""
        owner = worker_pools(self.jobs.values(), {pool: self._per_job(pool) for pool in self.shapes})
        assigned: dict[str, list[Any]] = {pool: [] for pool in self.shapes}
        for ws in self.scheduler.workers.values():
            if (pool := owner.get(ws.name)) is not None:
                assigned[pool] += [ts.resource_restrictions for ts in ws.processing]
        unplaced = [ts.resource_restrictions for ts in self.scheduler.unrunnable]
        unplaced += [None] * len(self.scheduler.queued)
        loads = pool_loads(list(self.shapes.values()), unplaced, assigned)
        return {pool: pool_state(self.jobs.values(), pool, loads[pool]) for pool in self.shapes}

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
            self.jobs[name] = JobRecord(pool=pool, name=name, submitted=time.time(),
                                        cut=walltime is not None and walltime < self.shapes[pool].walltime)
        try:
            await correct_state(cluster)
        except Exception as exc:  # noqa: BLE001 - sbatch refused: say why, stop the pool, do not retry blindly
            for name in new:
                job = cluster.workers.get(name)
                if job is None or not getattr(job, "job_id", None):
                    if job is not None:
                        job.status = Status.failed  # never started: nothing for SpecCluster to close
                    rec = self.jobs[name]
                    rec.state, rec.finished = JobState.FAILED, time.time()
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
        chosen = to_let_go(live.values(), now, timeout, surplus)
        for name in chosen:
            rec = live[name]
            if rec.started is None:
                await cluster.scale_down([name])  # scancel: still queued (or just starting)
                rec.state, rec.finished = JobState.CANCELLED, time.time()
                self._event("cancel", rec)
                continue
            if rec.state in TAKING:
                self._drain(rec, self._workers_of(rec), now, "idle")

    def _drain(self, rec: JobRecord, present: list[Any], now: float, why: str) -> None:
        """Its workers take no new tasks (the status `retire_workers` gives them, so the scheduler and the
        worker agree at once); what runs there finishes; `_retire_drained` retires them after."""
        from distributed.core import Status

        stimulus_id = f"hpc-garage-drain-{time.time()}"
        for ws in present:
            self.scheduler.handle_worker_status_change(Status.closing_gracefully, ws, stimulus_id)
            if (comm := self.scheduler.stream_comms.get(ws.address)) is not None:
                comm.send({"op": "worker-status-change", "status": Status.closing_gracefully.name,
                           "stimulus_id": stimulus_id})
        rec.state, rec.draining = JobState.DRAINING, now
        self._event(f"drain ({why})", rec)

    async def _retire_drained(self, now: float) -> None:
        """Retire the workers of drained jobs: nothing executes there, so nothing is rescheduled from a live
        worker, and the results they hold are replicated to other workers before they close."""
        for rec in [r for r in self.jobs.values() if r.state == JobState.DRAINING]:
            present = self._workers_of(rec)
            processing = [ts for ws in present for ts in ws.processing]
            executing = [ts for ws in present for ts in ws.executing]
            if not present or not drained(rec, now, processing, executing):
                continue  # (its workers gone before they could retire: `_observe` finds it ENDED)
            names = worker_names(rec.name, self._per_job(rec.pool))
            try:
                retired = await asyncio.wait_for(self.scheduler.retire_workers(
                    names=names, close_workers=True, remove=True, stimulus_id=f"hpc-garage-retire-{time.time()}"),
                    30)
            except (asyncio.TimeoutError, OSError):
                continue
            if len(retired) < len(present):
                continue  # data no other worker can take yet (its replacement is still queued): try again
            rec.state, rec.retiring = JobState.RETIRING, now
            self._event("retire", rec)

    async def _finish_retired(self, now: float) -> None:
        """A retired job whose workers have left is out of the cluster's spec; scancel only if it lingers."""
        for rec in [r for r in self.jobs.values() if retire_done(r, now)]:
            await self.clusters[rec.pool].scale_down([rec.name])  # scancel: harmless once it has ended
            rec.state, rec.finished = JobState.RETIRED, time.time()
            self._event("retired", rec)

    # ---- bookkeeping

    def _workers_of(self, rec: JobRecord) -> list[Any]:
        names = set(worker_names(rec.name, self._per_job(rec.pool)))
        return [ws for ws in self.scheduler.workers.values() if ws.name in names]

    def _drain_window(self) -> float:
        """`drain_window` from the longest task seen: finished (per kind) or still executing."""
        longest = max((tp.max_exec_time for tp in self.scheduler.task_prefixes.values()), default=0.0)
        for ws in self.scheduler.workers.values():
            longest = max(longest, *ws.executing.values(), 0.0)
        return drain_window(longest)

    def _life_left(self, pool: str, now: float) -> int | None:
        """Seconds a job of `pool` submitted now may live: its walltime, or less when the run ends first;
        None when the run ends too soon for a new job to start a task."""
        walltime = self.shapes[pool].walltime
        if self.end_time is None:
            return walltime
        left = int(self.end_time - now)
        if left - RUN_END_MARGIN <= self._drain_window():
            return None
        return min(walltime, left)

    async def _read_clocks(self, now: float) -> None:
        """Ask the batch system once, when a job's workers have registered, how long it has left: its clock
        started when the job did, not when its workers were up (seen here: 35 s apart on a busy machine)."""
        from hpc_garage.schedulers import get

        for rec in [r for r in self.jobs.values() if r.state in TAKING and r.ends_at is None and r.job_id]:
            try:
                left = await asyncio.to_thread(get(self.site.scheduler).time_left, rec.job_id)
            except UserError:
                left = None
            # where it will not say: the pool's walltime from the first worker (what the worker assumes too)
            rec.ends_at = now + left[0] if left is not None else (rec.started_at or now) + self.shapes[rec.pool].walltime

    def _job_life(self, rec: JobRecord) -> int | None:
        """The lifetime of a started job's workers, from the job's end and the run's, whichever comes first."""
        if rec.started_at is None:
            return None
        job_left = rec.ends_at - rec.started_at if rec.ends_at is not None else None
        run_left = self.end_time - rec.started if self.end_time is not None and rec.started is not None else None
        return lifetime(self.shapes[rec.pool].site, job_left, run_left, cut=rec.cut)[0]

    def _live(self, pool: str) -> list[JobRecord]:
        return live_jobs(self.jobs.values(), pool)

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

        done = {r.job_id for r in self.jobs.values() if r.state in LEFT_QUEUE}
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
