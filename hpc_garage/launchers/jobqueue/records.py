"""The jobqueue launcher's memory of its worker jobs: one record per job, what happened to each and when, and
which pools stopped submitting and why. The loop and the retirement steps change the records; this keeps
them, says them in one line (a pool, a failed job), and writes them to worker-jobs.json for people.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from hpc_garage.core.pools import JobShape, worker_names
from hpc_garage.core.site import Site
from hpc_garage.launchers.jobqueue.jobs import worker_job_name
from hpc_garage.launchers.jobqueue.scaling import LEFT_QUEUE, JobRecord, JobState, gives_up, live_jobs

if TYPE_CHECKING:
    from hpc_garage.rundir import RunDir

logger = logging.getLogger(__name__)


class JobBook:
    """Every worker job this run submitted, by its SpecCluster name, with its events and the stopped pools."""

    def __init__(self, site: Site, run_id: str, shapes: Mapping[str, JobShape]) -> None:
        self.site = site
        self.run_id = run_id
        self.shapes = shapes
        self.jobs: dict[str, JobRecord] = {}
        self.events: list[dict[str, Any]] = []
        self.failed_in_row: dict[str, int] = dict.fromkeys(shapes, 0)
        self.queue_wait: dict[str, float] = {}  # seconds from submission to the first worker, last seen
        self.stopped_pools: dict[str, str] = {}  # pool → why it no longer submits
        self.rundir: RunDir | None = None  # set when the launcher starts: where the jobs file and logs go

    # ---- records

    def event(self, what: str, rec: JobRecord) -> None:
        self.events.append({"t": time.time(), "event": what, "job": rec.name, "pool": rec.pool, "job_id": rec.job_id})

    def finish(self, rec: JobRecord, state: JobState, what: str) -> None:
        """A job reached a final state: when, and the event that says so."""
        rec.state, rec.finished = state, time.time()
        self.event(what, rec)

    def failed(self, rec: JobRecord) -> None:
        """A job left the queue before any worker of it registered; its pool stops after too many in a row."""
        self.finish(rec, JobState.FAILED, "failed")
        self.failed_in_row[rec.pool] += 1
        logger.warning(self.failure_text(rec))
        if gives_up(self.failed_in_row[rec.pool]):
            self.stop_pool(rec.pool, f"{self.failed_in_row[rec.pool]} worker jobs of pool {rec.pool} in a row ended "
                                     f"before their workers registered; no more are submitted for it "
                                     f"(last: {self.failure_text(rec)})")

    def stop_pool(self, pool: str, why: str) -> None:
        self.stopped_pools[pool] = why
        logger.error(why)

    def live(self, pool: str) -> list[JobRecord]:
        return live_jobs(self.jobs.values(), pool)

    def per_job(self, pool: str) -> int:
        return self.shapes[pool].workers_per_job

    def worker_names(self, rec: JobRecord) -> list[str]:
        return worker_names(rec.name, self.per_job(rec.pool))

    def first_failure(self, initial: Collection[str]) -> str | None:
        """Why `run` cannot get the workers it waits for: a stopped pool, or a job of them that failed."""
        if self.stopped_pools:
            return "; ".join(self.stopped_pools.values())
        for rec in self.jobs.values():
            if rec.state == JobState.FAILED and any(n in initial for n in self.worker_names(rec)):
                return self.failure_text(rec)
        return None

    def unfinished_ids(self, submitted: Iterable[str], every: bool = False) -> list[str]:
        """The job ids (of those submitted) that may still be queued or running: every one if `every`."""
        done = {r.job_id for r in self.jobs.values() if r.state in LEFT_QUEUE}
        return sorted({i for i in submitted if every or i not in done})

    # ---- what people read

    def describe(self, pool: str) -> str:
        shape = self.shapes[pool]
        fewest, most = shape.site.jobqueue.bounds
        jobs = f"{fewest}..{most} (adaptive)" if shape.site.jobqueue.adaptive else str(fewest)
        gpus = f", {shape.gpus} GPUs" if shape.gpus else ""
        workers = f"{shape.workers_per_job} worker" + ("s" if shape.workers_per_job != 1 else "")
        return (f"pool {pool} {jobs} × [{shape.cores} cores{gpus} → {workers}] "
                f"in {shape.site.queue or 'the default queue'}")

    def failure_text(self, rec: JobRecord) -> str:
        from hpc_garage.schedulers import get

        logfile = self.rundir.worker_log(worker_job_name(rec.pool, self.run_id), rec.job_id) if self.rundir else None
        where = f"; see {logfile}" if logfile and get(self.site.scheduler).names_worker_logs else \
            f"; see its log in {self.rundir.worker_logs}" if self.rundir else ""
        return f"worker job {rec.job_id} ({rec.name}, pool {rec.pool}) ended before its workers registered{where}"

    def write(self) -> None:
        """worker-jobs.json: the pools, every job's record, the events, the stopped pools (rewritten each step)."""
        if self.rundir is None:
            return
        from hpc_garage.files import write_json

        data = {"run": self.run_id, "pools": {p: self.describe(p) for p in self.shapes},
                "jobs": [asdict(r) for r in self.jobs.values()], "events": self.events,
                "stopped": self.stopped_pools}
        with contextlib.suppress(OSError):
            write_json(self.rundir.worker_jobs_file, data, indent=1)
