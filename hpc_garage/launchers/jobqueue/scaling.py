"""The jobqueue launcher's scaling policy: what a worker job's state is, and how many jobs each pool needs.

Pure: no I/O, no Dask, no asyncio, no clock. The launcher reads the scheduler and the batch system, passes
the time in (`now`: monotonic seconds, as the records keep it), and applies what is decided here; so every
rule can be tested with plain numbers.

A worker job moves SUBMITTING → PENDING (the batch system gave it an id) → RUNNING (a worker registered),
then EXPIRING (its workers' lifetime is near: a replacement is submitted now, so no gap opens), DRAINING (its
workers take no new task, the ones running finish: see `drains`) and RETIRING (nothing runs there any more:
its workers were retired, their results moved to other workers). An idle job drains and retires the same
way. It finishes as ENDED (its workers are gone), RETIRED, CANCELLED, or FAILED (it left the queue before
any worker registered, or was refused). A pool whose jobs keep failing is stopped rather than resubmitted
forever.

Why the launcher retires workers itself instead of Dask's `--lifetime`: a worker at the end of its lifetime
runs `close_gracefully`, whose `retire_workers(remove=True)` hands its running tasks to other workers while
its own thread still runs them (measured: two trials ran twice at once, on two GPUs), then is killed mid-task
if the trial outlives it, and results that finished after the Active Memory Manager's last pass are lost
with it (`RetireWorker.done`: "it's OK to lose them and just recompute them"). Here a worker first stops
taking tasks, `drain_window` before its end (from how long tasks have run), and is retired only once none
runs on it, so nothing is rescheduled from a live worker and every result it holds is replicated first.

Placement across pools rests on Dask resources (see `hpc_garage.core.pools`): a task the cluster cannot place
now counts towards the pool that should take it (`choose_pool`), in workers' worth (`task_weight`).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hpc_garage.core.pools import RUN_END_MARGIN, UNTAGGED, JobShape, fits, lifetime, worker_names

GONE_AFTER = 5.0  # a started job whose workers have all been gone this long has ended
RETIRE_GRACE = 3.0  # seconds a retired job gets to end by itself before it is cancelled
DRAIN_FACTOR = 1.5  # a worker stops taking tasks this many longest mean task durations before its end
DRAIN_SLACK = 5.0  # ... plus this (a round of scaling decisions, the last task's result moving off)
DRAIN_SETTLE = 2.0  # seconds between telling workers to drain and trusting their heartbeats' executing tasks
REPLACE_AHEAD = 60.0  # a job is replaced this long (or twice its queue wait) before its workers' lifetime ends
FAILURES_BEFORE_GIVING_UP = 3  # worker jobs of a pool that end without a worker, in a row


# ------------------------------------------------------------------------------------------------ one job


class JobState(enum.StrEnum):
    """Where one worker job is. A StrEnum: the jobs file and its readers see the same words as before."""

    SUBMITTING = "submitting"  # its spec is in the cluster, sbatch/qsub under way
    PENDING = "pending"  # queued: it has a job id, no worker yet
    RUNNING = "running"  # a worker of it registered
    EXPIRING = "expiring"  # running, its replacement already submitted (lifetime nearly over)
    DRAINING = "draining"  # its workers take no new tasks; the running ones finish, then it retires
    RETIRING = "retiring"  # idle: its workers were retired, the job ends by itself
    ENDED = "ended"  # its workers are gone (lifetime, walltime, killed) or it left the queue after starting
    RETIRED = "retired"  # retired and out of the queue
    CANCELLED = "cancelled"  # cancelled by the launcher (idle before it started, or at the end of the run)
    FAILED = "failed"  # left the queue before any worker registered, or sbatch/qsub refused it


# finished: out of the queue, or about to be; nothing more is decided about it
FINISHED: frozenset[JobState] = frozenset({JobState.ENDED, JobState.RETIRED, JobState.CANCELLED, JobState.FAILED})
# may still be queued or running: the end of the run cancels it
UNFINISHED: frozenset[JobState] = frozenset(JobState) - FINISHED
# one of its pool's jobs, as `pool_targets` counts them
LIVE: frozenset[JobState] = frozenset({JobState.SUBMITTING, JobState.PENDING, JobState.RUNNING})
# on its way out, still in the queue: counts against the queue caps only
LEAVING: frozenset[JobState] = frozenset({JobState.EXPIRING, JobState.DRAINING, JobState.RETIRING})
# has a job id and workers to come or at work: the batch system is asked about it, its tasks are its pool's load
WATCHED: frozenset[JobState] = frozenset({JobState.PENDING, JobState.RUNNING, JobState.EXPIRING, JobState.DRAINING})
# started: ends by itself once its workers leave, so the end of the run waits a moment for it
STARTED: frozenset[JobState] = frozenset({JobState.RUNNING, JobState.EXPIRING, JobState.DRAINING,
                                          JobState.RETIRING})
# still takes tasks: may be told to drain (lifetime nearly over, or idle)
TAKING: frozenset[JobState] = frozenset({JobState.RUNNING, JobState.EXPIRING})
# ended without being asked: taken out of its cluster's spec, so a new job takes its place
TO_REPLACE: frozenset[JobState] = frozenset({JobState.ENDED, JobState.FAILED})
# known to be out of the batch queue: nothing left to cancel
LEFT_QUEUE: frozenset[JobState] = frozenset({JobState.ENDED, JobState.FAILED, JobState.RETIRED})


@dataclass
class JobRecord:
    """One worker job as the launcher follows it (written as is to the run's jobs file)."""

    pool: str
    name: str  # the SpecCluster's name for it; its workers are <name>-<k>
    job_id: str | None = None
    state: JobState = JobState.SUBMITTING
    nodes: str | None = None
    submitted: float | None = None  # epoch seconds
    started: float | None = None  # first worker registered
    finished: float | None = None
    last_seen: float = 0.0  # monotonic: a worker of it was registered
    busy: float | None = None  # monotonic: a worker of it last had tasks (idle since start counts from start)
    retiring: float | None = None  # monotonic: its workers were retired (idle), the job is ending
    started_at: float | None = None  # monotonic twin of `started`
    draining: float | None = None  # monotonic: its workers were told to take no new tasks
    ends_at: float | None = None  # monotonic: when the batch system ends it (asked once it started)
    cut: bool = False  # its walltime was cut to the run's end
    workers: int = 0  # registered now


def retires_at(rec: JobRecord, shape: JobShape, now: float, life: int | None = None) -> float:
    """When the first worker of a job may retire (monotonic), from its pool's lifetime (`now` if not started).
    `life`: the job's own lifetime when shorter than the pool's (the run's end comes first)."""
    pool_life, stagger = lifetime(shape.site, cut=rec.cut)
    return (rec.started_at or now) + min(pool_life, life if life is not None else pool_life) - stagger


def new_job_walltime(walltime: int, run_end: float | None, now: float, window: float) -> int | None:
    """Seconds a job submitted now (`now`, epoch seconds) may live: its pool's `walltime`, or less when the run
    ends first (`run_end`); None when the run ends too soon for a new job to start a task (`window`: the drain
    window, see `drain_window`)."""
    if run_end is None:
        return walltime
    left = int(run_end - now)
    if left - RUN_END_MARGIN <= window:
        return None
    return min(walltime, left)


def job_lifetime(rec: JobRecord, shape: JobShape, run_end: float | None) -> int | None:
    """The lifetime of a started job's workers, from the job's end and the run's (`run_end`, epoch seconds),
    whichever comes first; None before it started."""
    if rec.started_at is None:
        return None
    job_left = rec.ends_at - rec.started_at if rec.ends_at is not None else None
    run_left = run_end - rec.started if run_end is not None and rec.started is not None else None
    return lifetime(shape.site, job_left, run_left, cut=rec.cut)[0]


def drain_window(longest_task: float) -> float:
    """How long before its workers retire a job stops taking tasks: long enough for the longest kind of task
    seen so far (mean duration) to finish, with DRAIN_FACTOR for tasks that run long and DRAIN_SLACK."""
    return DRAIN_FACTOR * max(0.0, longest_task) + DRAIN_SLACK


def ahead(shape: JobShape, queue_wait: float, window: float = 0.0) -> float:
    """How long before its workers retire a job is replaced: REPLACE_AHEAD, or twice the pool's last queue
    wait if longer (the replacement must have started by then), and before the job drains (`window`), but
    never more than half the lifetime."""
    life, _ = lifetime(shape.site)
    return min(max(REPLACE_AHEAD, 2 * queue_wait, window + queue_wait), life / 2)


def expiring(rec: JobRecord, shape: JobShape, now: float, queue_wait: float, window: float = 0.0,
             life: int | None = None) -> bool:
    """Whether a running job is now to be replaced, before its workers' lifetime ends; at the latest when it
    drains (`ahead` is at most half the lifetime: a short one's drain window is longer)."""
    end = retires_at(rec, shape, now, life)
    return rec.state == JobState.RUNNING and now >= end - max(ahead(shape, queue_wait, window), window)


def drains(rec: JobRecord, shape: JobShape, now: float, window: float, life: int | None = None) -> bool:
    """Whether a job that takes tasks stops now: what starts later might not finish before its end."""
    return rec.state in TAKING and now >= retires_at(rec, shape, now, life) - window


def drained(rec: JobRecord, now: float, processing: Iterable[object], executing: Iterable[object]) -> bool:
    """Whether a draining job's workers can be retired: told DRAIN_SETTLE ago (their heartbeats have said
    since what they execute), and no task of theirs executes. A task processing there but not executing
    never starts on a draining worker: it moves to another worker when they retire, having never run."""
    running = set(executing)
    return (rec.state == JobState.DRAINING and now - (rec.draining or now) >= DRAIN_SETTLE
            and not any(task in running for task in processing))


def waited(rec: JobRecord) -> float:
    """Seconds from a started job's submission to its first worker: its pool's queue wait, last seen."""
    started = rec.started or 0.0
    return started - (rec.submitted or started)


def workers_gone(rec: JobRecord, now: float) -> bool:
    """Whether a started job none of whose workers is registered has ended: gone longer than GONE_AFTER
    (retired at the end of their lifetime, or killed), so a new job replaces it."""
    return rec.started is not None and now - rec.last_seen > GONE_AFTER


def retire_done(rec: JobRecord, now: float) -> bool:
    """Whether a retiring job is finished: its workers have left and it had RETIRE_GRACE to end by itself."""
    return rec.state == JobState.RETIRING and rec.workers == 0 and now - (rec.retiring or now) >= RETIRE_GRACE


def left_queue(rec: JobRecord) -> JobState | None:
    """What a watched job the batch system no longer runs becomes: FAILED if no worker of it ever registered,
    ENDED if its workers are gone too; None while its workers are still registered (they end it when they go)."""
    if rec.started is None:
        return JobState.FAILED
    if rec.state in (JobState.RUNNING, JobState.EXPIRING, JobState.DRAINING) and rec.workers == 0:
        return JobState.ENDED
    return None


def ended_as(rec: JobRecord) -> JobState:
    """What a started job that left the queue by itself at the end of the run is: RETIRED if it was retiring."""
    return JobState.RETIRED if rec.state == JobState.RETIRING else JobState.ENDED


def stopped_as(rec: JobRecord) -> JobState | None:
    """What a job is once the run's pools are closed: RETIRED if its workers had left, else CANCELLED if it
    may still be queued or running; None if it was finished already."""
    if rec.state == JobState.RETIRING and rec.workers == 0:
        return JobState.RETIRED
    return JobState.CANCELLED if rec.state in UNFINISHED else None


def gives_up(failures_in_row: int) -> bool:
    """Whether a pool stops submitting: FAILURES_BEFORE_GIVING_UP of its jobs in a row ended before any of
    their workers registered (a wrong queue, a broken environment: resubmitting would only repeat it)."""
    return failures_in_row >= FAILURES_BEFORE_GIVING_UP


# --------------------------------------------------------------------------------------------- one pool


def live_jobs(records: Iterable[JobRecord], pool: str) -> list[JobRecord]:
    """The jobs that count as `pool`'s jobs: submitting, queued or running, not leaving."""
    return [r for r in records if r.pool == pool and r.state in LIVE]


def worker_pools(records: Iterable[JobRecord], per_job: Mapping[str, int]) -> dict[str, str]:
    """Worker name → pool, for the workers of watched jobs (those whose tasks are their pool's load)."""
    return {n: r.pool for r in records if r.state in WATCHED for n in worker_names(r.name, per_job[r.pool])}


def pool_state(records: Iterable[JobRecord], pool: str, load: float) -> PoolState:
    """What `pool_targets` sees of one pool: its live jobs, its load, and its jobs on their way out."""
    records = list(records)
    return PoolState(jobs=len(live_jobs(records, pool)), load=load,
                     leaving=sum(1 for r in records if r.pool == pool and r.state in LEAVING))


def change(target: int, live: int, adaptive: bool) -> int:
    """Jobs to submit (> 0) or to let go (< 0) for a pool: only an adaptive pool lets jobs go."""
    if target > live or (target < live and adaptive):
        return target - live
    return 0


def to_let_go(live: Iterable[JobRecord], now: float, idle_timeout: float, surplus: int) -> list[str]:
    """Which of a pool's live jobs to cancel or retire: not started yet first, then the longest idle."""
    return idle_jobs({r.name: (r.busy if r.started else None) for r in live}, now, idle_timeout, surplus)


# ----------------------------------------------------------------------------------- where tasks go, how many


def choose_pool(restrictions: Mapping[str, float] | None, shapes: Sequence[JobShape]) -> str | None:
    """The pool whose workers should take a task the cluster cannot place now, or None if none ever can.

    Among the pools that fit, a task that asks for no GPU prefers pools without GPUs; then the site's order.
    A task with no restrictions at all goes to a pool that takes untagged tasks.
    """
    wanted = dict(restrictions or {})
    if not wanted:
        return next((s.pool for s in shapes if s.untagged), None)
    fitting = [s for s in shapes if any(fits(wanted, r) for r in s.worker_resources)]
    if not wanted.get("GPU"):
        fitting.sort(key=lambda s: s.gpus > 0)  # stable: keeps the site's order otherwise
    return fitting[0].pool if fitting else None


def task_weight(restrictions: Mapping[str, float] | None, shape: JobShape) -> float:
    """The share of one worker a task takes while it runs: 1/k when k such tasks run on a worker at once."""
    worker = max(shape.layout.workers, key=lambda w: w.nthreads)
    slots = float(worker.nthreads)
    resources = shape.worker_resources[shape.layout.workers.index(worker)]
    for name, amount in (restrictions or {}).items():
        if amount > 0 and name != UNTAGGED:
            slots = min(slots, math.floor(resources.get(name, 0) / amount))
    return 1.0 / max(1.0, slots)


@dataclass(frozen=True)
class PoolState:
    """What the launcher sees of one pool at one moment."""

    jobs: int  # worker jobs queued or running
    load: float  # workers' worth of tasks: running or waiting on its workers, plus unplaced ones it should take
    leaving: int = 0  # jobs whose workers retired, still in the queue: they count against the cap only


def pool_loads(shapes: Sequence[JobShape], unplaced: Iterable[Mapping[str, float] | None],
               assigned: Mapping[str, Iterable[Mapping[str, float] | None]]) -> dict[str, float]:
    """Workers' worth of work per pool: tasks assigned to its workers, plus the unplaced tasks it should take."""
    by_name = {s.pool: s for s in shapes}
    load = {s.pool: 0.0 for s in shapes}
    for pool, tasks in assigned.items():
        if pool in by_name:
            load[pool] += sum(task_weight(t, by_name[pool]) for t in tasks)
    for restrictions in unplaced:
        if (pool := choose_pool(restrictions, shapes)) is not None:
            load[pool] += task_weight(restrictions, by_name[pool])
    return load


def pool_targets(shapes: Sequence[JobShape], states: Mapping[str, PoolState], cap: int) -> dict[str, int]:
    """How many worker jobs each pool should have: its fixed count, or as many as its load needs within
    minimum_jobs..maximum_jobs; never more than its own max_jobs_in_queue, nor `cap` for all pools together."""
    wanted: dict[str, int] = {}
    for shape in shapes:
        fewest, most = shape.site.jobqueue.bounds
        if shape.site.jobqueue.adaptive:
            need = math.ceil(round(states[shape.pool].load, 6) / shape.workers_per_job)
            wanted[shape.pool] = min(max(need, fewest), most)
        else:
            wanted[shape.pool] = fewest
        own_room = shape.site.jobqueue.max_jobs_in_queue - states[shape.pool].leaving
        wanted[shape.pool] = min(wanted[shape.pool], max(own_room, 0))
    # growth shares what the run-wide cap leaves, in the site's order (a pool that shrinks frees room
    # only once its jobs are gone); shrinking is never held back
    room = cap - sum(states[s.pool].jobs + states[s.pool].leaving for s in shapes)
    for shape in shapes:
        have = states[shape.pool].jobs
        if wanted[shape.pool] > have:
            grow = max(0, min(wanted[shape.pool] - have, room))
            wanted[shape.pool] = have + grow
            room -= grow
    return wanted


def idle_jobs(busy_since: Mapping[str, float | None], now: float, idle_timeout: float, surplus: int) -> list[str]:
    """Up to `surplus` jobs to cancel: those idle longest, and at least `idle_timeout` (None = never started)."""
    never = [job for job, last in busy_since.items() if last is None]
    idle = sorted((last, job) for job, last in busy_since.items() if last is not None and now - last >= idle_timeout)
    return (never + [job for _, job in idle])[:max(0, surplus)]
