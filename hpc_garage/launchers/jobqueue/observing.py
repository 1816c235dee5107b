"""What the jobqueue loop sees at each step, before it decides: the scheduler's view of every worker job (its
id, its workers registered, busy, expiring, at their drain point, or gone) and, for jobs whose workers are not
there, the batch system's. The scheduler lives in `run`'s process, so reading its state costs nothing; the
batch system is asked once for all the jobs it watches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.launchers.jobqueue.records import JobBook
from hpc_garage.launchers.jobqueue.retirement import drain, drain_window_of
from hpc_garage.launchers.jobqueue.scaling import (FINISHED, WATCHED, JobRecord, JobState, PoolState, drains,
                                                   expiring, job_lifetime, left_queue, pool_loads, pool_state,
                                                   waited, worker_pools, workers_gone)

logger = logging.getLogger(__name__)


def observe(book: JobBook, clusters: dict[str, Any], scheduler: Any, end_time: float | None, now: float) -> None:
    """What the scheduler shows of each job now: its job id, its workers registered or gone."""
    registered = {ws.name: ws for ws in scheduler.workers.values()}
    for cluster in clusters.values():
        for name in list(cluster.worker_spec):
            rec = book.jobs.get(name)
            if rec is None or rec.state in FINISHED:
                continue
            job = cluster.workers.get(name)
            if rec.job_id is None and job is not None and getattr(job, "job_id", None):
                rec.job_id, rec.state = str(job.job_id), JobState.PENDING
                book.event("submitted", rec)
            present = [registered[n] for n in book.worker_names(rec) if n in registered]
            rec.workers = len(present)
            if rec.state == JobState.RETIRING:
                continue
            if present and rec.state == JobState.DRAINING:
                rec.last_seen = now
                continue
            if present:
                _seen_at_work(book, scheduler, end_time, rec, present, now)
            elif workers_gone(rec, now):
                book.finish(rec, JobState.ENDED, "ended")  # retired (lifetime) or killed: replace it


def _seen_at_work(book: JobBook, scheduler: Any, end_time: float | None, rec: JobRecord, present: list[Any],
                  now: float) -> None:
    """A job with workers registered: started (its pool's queue wait), expiring (replaced now, so no gap
    opens), busy, or at the point where it stops taking tasks before its end."""
    pool, shape = rec.pool, book.shapes[rec.pool]
    if rec.started is None:
        rec.started, rec.started_at, rec.state, rec.busy = time.time(), now, JobState.RUNNING, now
        book.event("running", rec)
        book.failed_in_row[pool] = 0
        book.queue_wait[pool] = waited(rec)
    rec.last_seen = now
    life = job_lifetime(rec, shape, end_time)
    window = drain_window_of(scheduler)
    if expiring(rec, shape, now, book.queue_wait.get(pool, 0.0), window, life):
        rec.state = JobState.EXPIRING  # its replacement is submitted now, so no gap opens
        book.event("expiring", rec)
    if any(ws.processing for ws in present):
        rec.busy = now
    if drains(rec, shape, now, window, life):
        drain(scheduler, book, rec, present, now, "lifetime")


async def poll_batch_system(book: JobBook, scheduler_name: str) -> None:
    """Ask once for every job whose workers are not (yet) there: a job that left the queue without
    them failed; record where running jobs run."""
    from hpc_garage.schedulers import get

    waiting = {r.job_id: r for r in book.jobs.values() if r.job_id and r.state in WATCHED}
    if not waiting:
        return
    batch = get(scheduler_name)
    try:
        statuses = await asyncio.to_thread(batch.statuses, list(waiting))
    except UserError as exc:
        logger.warning("asking the batch system failed: %s", exc)
        return
    for job_id, rec in waiting.items():
        status = statuses.get(job_id)
        if status is not None and status.nodes:
            rec.nodes = status.nodes
        if status is not None and status.phase != "finished":
            continue
        state = left_queue(rec)
        if state == JobState.FAILED:
            book.failed(rec)
        elif state == JobState.ENDED:
            book.finish(rec, state, "ended")


def pool_states(book: JobBook, scheduler: Any) -> dict[str, PoolState]:
    """Each pool's jobs and load, read from the scheduler's own state (it lives in this process)."""
    shapes = book.shapes
    owner = worker_pools(book.jobs.values(), {pool: book.per_job(pool) for pool in shapes})
    assigned: dict[str, list[Any]] = {pool: [] for pool in shapes}
    for ws in scheduler.workers.values():
        if (pool := owner.get(ws.name)) is not None:
            assigned[pool] += [ts.resource_restrictions for ts in ws.processing]
    unplaced = [ts.resource_restrictions for ts in scheduler.unrunnable]
    unplaced += [None] * len(scheduler.queued)
    loads = pool_loads(list(shapes.values()), unplaced, assigned)
    return {pool: pool_state(book.jobs.values(), pool, loads[pool]) for pool in shapes}
