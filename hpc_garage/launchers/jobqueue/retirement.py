"""The end of a worker job's life, acted out on `run`'s scheduler (it lives in this process): when a job ends
(asked of the batch system once its workers are up), its workers told to take no new tasks, retired once
nothing runs there, its job let go; and, at the end of the run, a moment for retired jobs to end by
themselves. `scaling` decides when (and says why Dask's `--lifetime` is not used); this does it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.launchers.jobqueue.records import JobBook
from hpc_garage.launchers.jobqueue.scaling import STARTED, TAKING, JobRecord, JobState, drain_window, drained, \
    ended_as, retire_done


def workers_of(scheduler: Any, book: JobBook, rec: JobRecord) -> list[Any]:
    """The scheduler's WorkerStates of one job's workers that are registered now."""
    names = set(book.worker_names(rec))
    return [ws for ws in scheduler.workers.values() if ws.name in names]


def drain_window_of(scheduler: Any) -> float:
    """`drain_window` from the longest task seen: finished (per kind) or still executing."""
    longest = max((tp.max_exec_time for tp in scheduler.task_prefixes.values()), default=0.0)
    for ws in scheduler.workers.values():
        longest = max(longest, *ws.executing.values(), 0.0)
    return drain_window(longest)


async def read_clocks(book: JobBook, now: float) -> None:
    """Ask the batch system once, when a job's workers have registered, how long it has left: its clock
    started when the job did, not when its workers were up (seen here: 35 s apart on a busy machine)."""
    from hpc_garage.schedulers import get

    for rec in [r for r in book.jobs.values() if r.state in TAKING and r.ends_at is None and r.job_id]:
        try:
            left = await asyncio.to_thread(get(book.site.scheduler).time_left, rec.job_id)
        except UserError:
            left = None
        # where it will not say: the pool's walltime from the first worker (what the worker assumes too)
        rec.ends_at = now + left[0] if left is not None else (rec.started_at or now) + book.shapes[rec.pool].walltime


def drain(scheduler: Any, book: JobBook, rec: JobRecord, present: list[Any], now: float, why: str) -> None:
    """Its workers take no new tasks (the status `retire_workers` gives them, so the scheduler and the
    worker agree at once); what runs there finishes; `retire_drained` retires them after."""
    from distributed.core import Status

    stimulus_id = f"hpc-garage-drain-{time.time()}"
    for ws in present:
        scheduler.handle_worker_status_change(Status.closing_gracefully, ws, stimulus_id)
        if (comm := scheduler.stream_comms.get(ws.address)) is not None:
            comm.send({"op": "worker-status-change", "status": Status.closing_gracefully.name,
                       "stimulus_id": stimulus_id})
    rec.state, rec.draining = JobState.DRAINING, now
    book.event(f"drain ({why})", rec)


async def retire_drained(scheduler: Any, book: JobBook, now: float) -> None:
    """Retire the workers of drained jobs: nothing executes there, so nothing is rescheduled from a live
    worker, and the results they hold are replicated to other workers before they close."""
    for rec in [r for r in book.jobs.values() if r.state == JobState.DRAINING]:
        present = workers_of(scheduler, book, rec)
        processing = [ts for ws in present for ts in ws.processing]
        executing = [ts for ws in present for ts in ws.executing]
        if not present or not drained(rec, now, processing, executing):
            continue  # (its workers gone before they could retire: the loop's `_observe` finds it ENDED)
        try:
            retired = await asyncio.wait_for(scheduler.retire_workers(
                names=book.worker_names(rec), close_workers=True, remove=True,
                stimulus_id=f"hpc-garage-retire-{time.time()}"), 30)
        except (asyncio.TimeoutError, OSError):
            continue
        if len(retired) < len(present):
            continue  # data no other worker can take yet (its replacement is still queued): try again
        rec.state, rec.retiring = JobState.RETIRING, now
        book.event("retire", rec)


async def finish_retired(clusters: dict[str, Any], book: JobBook, now: float) -> None:
    """A retired job whose workers have left is out of the cluster's spec; scancel only if it lingers."""
    for rec in [r for r in book.jobs.values() if retire_done(r, now)]:
        await clusters[rec.pool].scale_down([rec.name])  # scancel: harmless once it has ended
        book.finish(rec, JobState.RETIRED, "retired")


async def let_jobs_end(book: JobBook, grace: float) -> None:
    """Jobs whose workers were told to leave (`run` retires them first) end by themselves in a moment;
    wait that moment, so they end COMPLETED rather than CANCELLED. What is left is cancelled after."""
    from hpc_garage.schedulers import get

    waiting = {r.job_id: r for r in book.jobs.values() if r.job_id and r.state in STARTED}
    deadline = time.monotonic() + grace
    batch = get(book.site.scheduler)
    while waiting and time.monotonic() < deadline:
        try:
            statuses = await asyncio.to_thread(batch.statuses, list(waiting))
        except UserError:
            return
        for job_id in [i for i in waiting if i not in statuses or statuses[i].phase == "finished"]:
            rec = waiting.pop(job_id)
            state = ended_as(rec)
            book.finish(rec, state, str(state))
        if waiting:
            await asyncio.sleep(0.5)
