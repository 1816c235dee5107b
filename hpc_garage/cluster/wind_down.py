"""Ending a job before the batch system ends it: no trial cut short that could be kept, the sweep handed on.

The batch system kills a job at its walltime (or on preemption) in the middle of whatever runs. `run`
instead asks the batch system how long the job has left (squeue %L, qstat -f; never the site's default),
and `margin` seconds plus the longest trial seen so far before the end (at once when the batch system sends
the site's warning signal) it winds down:
1. every worker is paused: running trials go on, no trial starts (it could not finish; it runs in the next
   job instead, read back from nothing since it never finished);
2. with the site's `requeue: auto`, a follow-up job is submitted now, from this job's own script, to start
   once this job has ended (`afterany`), so the sweep goes on with nobody watching;
3. when the running trials are done (their results are persisted, core/sweep.py), or `grace` seconds
   before the end, COMMAND is stopped and `run` tears down as usual.
A COMMAND that finishes on its own meanwhile finished the sweep: the follow-up job is cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from hpc_garage.core.site import Site

EX_TEMPFAIL = 75  # sysexits: the sweep stopped short and can be resumed
RECHECK_SECONDS = 300.0  # the time left is asked again this often (an admin may extend a job)
TICK_SECONDS = 2.0
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGURG)

logger = logging.getLogger(__name__)  # the job log: each step of the wind-down


def margin_for(site: Site, limit: float) -> float:
    """Seconds before the end at which winding down starts: the site's, else 5 % of the job's limit (at
    least 30 s, at most 10 min); never more than half the limit, or a job would wind down as it starts."""
    wanted = float(site.walltime_margin) if site.walltime_margin is not None else min(600.0, max(30.0, limit / 20))
    return min(wanted, limit / 2)


class WindDown:
    """One run's watch on its job's end; `exit_code` says what the run ends with."""

    def __init__(self, site: Site, job_id: str, time_left: Callable[[], tuple[float, float] | None] | None,
                 follow_up: Callable[[], str] | None, cancel: Callable[[str], None]) -> None:
        self.site = site
        self.job_id = job_id
        self._time_left = time_left  # None: no batch job, no end
        self._follow_up = follow_up  # submits the follow-up job, gives its id; None: requeue: never
        self._cancel = cancel
        self._say: Callable[[str], None] = logger.info  # the job log
        self._note: Callable[..., None] = lambda **kw: None  # state.json
        self._warned = asyncio.Event()
        self._warning: str | None = None
        self._task: asyncio.Task[None] | None = None
        self.stopped = False  # COMMAND was stopped by the wind-down
        self.next_job: str | None = None

    def bind(self, say: Callable[[str], None] | None = None, note: Callable[..., None] | None = None) -> None:
        """Where it reports: state.json (`note`, what `status` shows), and the job log through this module's
        logger unless `say` takes its lines instead (a test's list)."""
        self._say = say or self._say
        self._note = note or self._note

    def warn(self, reason: str) -> None:
        """A signal handler's whole job: note it; the watch acts on it."""
        self._warning = reason
        self._warned.set()

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in WARNING_SIGNALS:
            loop.add_signal_handler(sig, self.warn, f"signal {signal.Signals(sig).name}")

    def start(self, scheduler: Any, proc: asyncio.subprocess.Process) -> None:
        self._task = asyncio.ensure_future(self._watch(scheduler, proc))

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def exit_code(self, command_code: int) -> int:
        """COMMAND's code, unless the wind-down stopped it: 0 when a follow-up job carries the sweep on,
        else EX_TEMPFAIL (resume it). A COMMAND that finished by itself needs no follow-up job."""
        if not self.stopped:
            if self.next_job is not None:
                self._cancel(self.next_job)
                self._say(f"the sweep finished here; follow-up job {self.next_job} cancelled")
                self._note(next_job=None)
                self.next_job = None
            return command_code
        return 0 if self.next_job is not None else EX_TEMPFAIL

    async def _watch(self, scheduler: Any, proc: asyncio.subprocess.Process) -> None:
        """Wind down at `end - margin - longest trial`: a trial started before then finishes before
        `end - margin`, which is left for teardown. Polls every TICK; asks the batch system every RECHECK."""
        loop = asyncio.get_running_loop()
        end, margin = await self._end(loop)
        asked = time.monotonic()
        while not self._warned.is_set():
            now = time.monotonic()
            if end is not None and now >= end - margin - _longest_trial(scheduler, margin):
                break
            try:
                await asyncio.wait_for(self._warned.wait(), timeout=TICK_SECONDS if end is not None else RECHECK_SECONDS)
            except asyncio.TimeoutError:
                if time.monotonic() - asked >= RECHECK_SECONDS:
                    end, margin = await self._end(loop)  # the limit may have changed (scontrol update)
                    asked = time.monotonic()
        why = self._warning or f"walltime: {max(0.0, (end or 0) - time.monotonic()):.0f} s left"
        await self._wind_down(scheduler, proc, why, end, margin, loop)

    async def _end(self, loop: asyncio.AbstractEventLoop) -> tuple[float | None, float]:
        if self._time_left is None:
            return None, 0.0
        answer = await loop.run_in_executor(None, self._time_left)
        if answer is None:
            return None, 0.0
        left, limit = answer
        margin = margin_for(self.site, limit)
        self._note(ends_in=round(left), wind_down_margin=round(margin))
        return time.monotonic() + left, margin

    async def _wind_down(self, scheduler: Any, proc: asyncio.subprocess.Process, why: str, end: float | None,
                         margin: float, loop: asyncio.AbstractEventLoop) -> None:
        from hpc_garage.compat import pause_workers

        paused = pause_workers(scheduler)
        running, finished = _executing(scheduler), _finished(scheduler)
        self._say(f"{why}: winding down; no new trials on the {paused} workers, {running} running may finish")
        self._note(phase="winding down", wind_down=why)
        if self._follow_up is not None and not finished and not _assigned(scheduler):
            self._say("no trial finished or ran in this job: no follow-up job (it would fare no better); give "
                      "the sweep a longer walltime and `hpc-garage resume` it")
        elif self._follow_up is not None:
            try:
                self.next_job = await loop.run_in_executor(None, self._follow_up)
                self._say(f"the sweep continues in job {self.next_job} once this one has ended "
                          f"(`hpc-garage status {self.next_job}`)")
                self._note(next_job=self.next_job)
            except Exception as exc:  # noqa: BLE001 - the sweep can still be resumed by hand
                self._say(f"could not submit the follow-up job ({exc}); resume by hand with `hpc-garage resume`")
        grace = margin / 2  # for stopping COMMAND and tearing down before the batch system kills the job
        await asyncio.sleep(2.0)  # a heartbeat or two: what the workers execute is known from them
        while _executing(scheduler) and proc.returncode is None:
            if end is not None and time.monotonic() >= end - grace:
                self._say(f"{_executing(scheduler)} trials still running {grace:.0f} s before the end; they "
                          "are stopped and run again in the next job")
                break
            await asyncio.sleep(0.5)
        if proc.returncode is None:
            self.stopped = True
            self._say("stopping COMMAND: this job's part of the sweep is done; finished trials are kept")
            proc.send_signal(signal.SIGTERM)


def _executing(scheduler: Any) -> int:
    return sum(len(ws.executing) for ws in scheduler.workers.values())


def _longest_trial(scheduler: Any, margin: float) -> float:
    """The longest mean duration of any kind of task seen so far (Dask keeps it per task prefix): trials
    that could not finish before the end are not started. Bounded, so one odd task cannot end a job early."""
    means = [tp.duration_average for tp in scheduler.task_prefixes.values() if tp.duration_average > 0]
    return min(max(means, default=0.0) * 1.2, 10 * margin)


def _assigned(scheduler: Any) -> int:
    """Tasks handed to workers (executing, or about to: the workers' heartbeats tell `executing` late)."""
    return sum(len(ws.processing) for ws in scheduler.workers.values())


def _finished(scheduler: Any) -> int:
    """Tasks whose results the flow holds (it holds every trial's future until it ends)."""
    return sum(1 for ts in scheduler.tasks.values() if ts.state == "memory")
