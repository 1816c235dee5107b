"""Ending a job before the batch system ends it: no trial cut short that could be kept, the sweep handed on.

The batch system kills a job at its walltime (or on preemption) in the middle of whatever runs. `run`
instead asks the batch system how long the job has left (squeue %L, qstat -f; never the site's default),
and `margin` seconds plus the longest trial seen so far before the end (at once when the batch system sends
the site's warning signal) it winds down:
1. every worker is paused: running trials go on, no trial starts (it could not finish; it runs in the next
   job instead, read back from nothing since it never finished); the running trials are told to stop
   (`hpc_garage.trial.should_stop()`, cluster/stopping.py), at least the site's `checkpoint_grace` before
   they would be killed, so that a trial that checkpoints saves its state and raises `Interrupted`;
2. when the running trials are done (their results are persisted, core/sweep.py), or `grace` seconds
   before the end, each trial still unfinished is recorded as interrupted (`.trials/<key>.json` in the
   epoch's results: how often, whether it made progress (its reported step) since, the work lost since
   its last one);
3. with the site's `requeue: auto`, a follow-up job is submitted from this job's own script, to start once
   this job has ended (`afterany`), so the sweep goes on with nobody watching: but only where this job got
   somewhere (a trial finished or made progress) or an interrupted trial may still be continued. A trial
   interrupted more than `max_continuations` jobs in a row without progress (the step it reports:
   cluster/interruptions.py) is not: when only such trials are left, the chain ends, naming them ("longer
   than the walltime and never checkpoints", "no step past 40 in 3 jobs in a row"), and `run` exits
   EX_TEMPFAIL;
4. COMMAND is stopped and `run` tears down as usual.
A COMMAND that finishes on its own meanwhile finished the sweep: the follow-up job is cancelled.

The batch system's SIGTERM to the job's steps (Slurm's preemption notice with a GraceTime; it reaches `run`
only with the kill) winds it down at once: each node process tells the scheduler (launchers/mpi.py, a Dask
event), the workers' trials already see `should_stop()` (cluster/stopping.py), and the end is asked again
(preemption moves it to now + GraceTime). No follow-up job: the batch system requeues the job (the same job
id runs again and continues the sweep) or `hpc-garage resume` does.

`hpc-garage cancel` of a running job winds it down the same way: it marks the run directory
(`RunDir.request_cancel`) and sends WIND_DOWN_SIGNAL (schedulers/base.py) to the batch shell, which is `run`.
The trials get `checkpoint_grace` to save (one that does not stop by then is killed, however far the walltime
is), the interrupted ones are recorded as above, so that `hpc-garage resume` continues them from their
checkpoints, but no follow-up job is submitted, and `run` ends as a cancelled job does (128 + SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_garage.cluster.interruptions import (NEVER_CHECKPOINTS, Unfinished, follow_up_needed, interruption,
                                             unfinished_trial)
from hpc_garage.cluster.prefect_cancel import REASON as PREFECT_REASON
from hpc_garage.cluster.stopping import TERM_REASON, TRIALS_DIR
from hpc_garage.core.site import Site
from hpc_garage.files import write_private
from hpc_garage.launchers.common import NOTICE_TOPIC

EX_TEMPFAIL = 75  # sysexits: the sweep stopped short and can be resumed
EX_CANCELLED = 128 + signal.SIGTERM  # `hpc-garage cancel`: what a job scancel/qdel killed exits with
RECHECK_SECONDS = 300.0  # the time left is asked again this often (an admin may extend a job)
TICK_SECONDS = 2.0
LINGER_SECONDS = 60.0  # after a preemption notice: waited past the job's end for the batch system to end it
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGURG)  # SIGURG: also `hpc-garage cancel`'s
CANCEL_REASON = "cancelled (`hpc-garage cancel`)"

logger = logging.getLogger(__name__)  # the job log: each step of the wind-down


def margin_for(site: Site, limit: float) -> float:
    """Seconds before the end at which winding down starts: the site's, else 5 % of the job's limit (at
    least 30 s, at most 10 min); never more than half the limit, or a job would wind down as it starts."""
    wanted = float(site.walltime_margin) if site.walltime_margin is not None else min(600.0, max(30.0, limit / 20))
    return min(wanted, limit / 2)


def lead_for(margin: float, checkpoint_grace: float, limit: float) -> float:
    """Seconds before the end at which the trials are told to stop: the margin, or more where the trials'
    checkpoint grace would not fit before they are killed (`margin / 2` before the end); never more than
    half the limit."""
    return min(max(margin, checkpoint_grace + margin / 2), max(margin, limit / 2))


class WindDown:
    """One run's watch on its job's end; `exit_code` says what the run ends with."""

    def __init__(self, site: Site, job_id: str, time_left: Callable[[], tuple[float, float] | None] | None,
                 follow_up: Callable[[], str] | None, cancel: Callable[[str], None],
                 results: Path | None = None, cancel_requested: Callable[[], bool] | None = None) -> None:
        self.site = site
        self.job_id = job_id
        self.results = results  # the epoch's results directory: interrupted trials' records, checkpoints
        self._kept = _results_in(results)  # results the epoch had when this job began
        self._lead = 0.0
        self.winding = False  # the trials were told to stop
        self.gave_up: list[dict[str, Any]] = []  # trials this job's end stopped continuing
        self.interrupted: list[dict[str, Any]] = []  # for the report: each interrupted trial, the work it lost
        self._time_left = time_left  # None: no batch job, no end
        self._follow_up = follow_up  # submits the follow-up job, gives its id; None: requeue: never
        self._cancel = cancel
        self._cancel_requested = cancel_requested or (lambda: False)  # `hpc-garage cancel` marked the job
        self.cancelling = False  # ... and the wind-down saw it: no follow-up job, the exit code of a cancel
        self.noticed = False  # the batch system's SIGTERM reached the job's steps: no follow-up job either
        self.prefect: Any = None  # cluster/prefect_cancel.py: a Cancel in Prefect winds down as `cancel` does
        self._kill_at: float | None = None  # after a notice: when the batch system ends the job (monotonic)
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
        self._note(checkpoint_grace=float(self.site.checkpoint_grace))  # `cancel` gives the trials as long
        scheduler.add_plugin(_notices(self._notice), name=NOTICE_TOPIC, idempotent=True)
        self._task = asyncio.ensure_future(self._watch(scheduler, proc))

    def _notice(self, msg: Any) -> None:
        """A node process got the batch system's SIGTERM (this job's, not a worker job's)."""
        if isinstance(msg, dict) and str(msg.get("job")) == self.job_id and not self.noticed:
            self.noticed = True
            self.warn(TERM_REASON)

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def exit_code(self, command_code: int) -> int:
        """COMMAND's code, unless the wind-down stopped it: 0 when a follow-up job carries the sweep on,
        else EX_TEMPFAIL (resume it). A COMMAND that finished by itself needs no follow-up job."""
        if not self.stopped and not (self.winding and command_code != 0):  # (an interrupted trial ends the flow)
            if self.next_job is not None:
                self._cancel(self.next_job)
                self._say(f"the sweep finished here; follow-up job {self.next_job} cancelled")
                self._note(next_job=None)
                self.next_job = None
            return command_code
        if self.cancelling:
            return EX_CANCELLED
        return 0 if self.next_job is not None else EX_TEMPFAIL

    async def linger(self) -> None:
        """After the batch system's SIGTERM (preemption), `run` does not end the job itself: Slurm requeues a
        preempted job (PreemptMode=REQUEUE) only if it kills it; one that exits first has ended. At most until
        the job's end as last asked, plus LINGER_SECONDS (a notice the batch system does not follow)."""
        if not self.noticed:
            return
        self._say("waiting for the batch system to end this job (it requeues or cancels a preempted job)")
        left = (self._kill_at - time.monotonic()) if self._kill_at is not None else 0.0
        await asyncio.sleep(max(0.0, left) + LINGER_SECONDS)

    async def settled(self, timeout: float = 600.0) -> None:
        """Once winding down, until the wind-down has decided (COMMAND may end first: a trial that raised
        Interrupted ends the flow)."""
        if self.winding and self._task is not None and not self._task.done():
            await asyncio.wait([self._task], timeout=timeout)
        if self.prefect is not None and self.prefect.cancelling:  # COMMAND has ended: its engine said its last
            await asyncio.get_running_loop().run_in_executor(None, self.prefect.settle)

    async def _watch(self, scheduler: Any, proc: asyncio.subprocess.Process) -> None:
        """Wind down at `end - margin - longest trial`: a trial started before then finishes before
        `end - margin`, which is left for teardown. Polls every TICK; asks the batch system every RECHECK."""
        loop = asyncio.get_running_loop()
        end, margin = await self._end(loop)
        asked = time.monotonic()
        while not self._warned.is_set():
            now = time.monotonic()
            if end is not None and now >= end - self._lead - _longest_trial(scheduler, margin):
                break
            if self.prefect is not None and self.prefect.due() and await loop.run_in_executor(None, self.prefect.poll):
                self.cancelling = True
                self._note(cancelled=True)
                self.warn(PREFECT_REASON)
                break
            try:
                await asyncio.wait_for(self._warned.wait(), timeout=TICK_SECONDS if end is not None or self.prefect
                                   else RECHECK_SECONDS)
            except asyncio.TimeoutError:
                if time.monotonic() - asked >= RECHECK_SECONDS:
                    end, margin = await self._end(loop)  # the limit may have changed (scontrol update)
                    asked = time.monotonic()
        why = self._warning or f"walltime: {max(0.0, (end or 0) - time.monotonic()):.0f} s left"
        if self.noticed:  # preemption moved the job's end: ask it again
            end, margin = await self._end(loop)
            self._kill_at = end
            if end is not None:
                margin = min(margin, 2 * (end - time.monotonic()) / 3)  # COMMAND stopped a third before it
        if self._is_cancelled() and why != PREFECT_REASON:
            why = CANCEL_REASON
        await self._wind_down(scheduler, proc, why, end, margin, loop)

    async def _end(self, loop: asyncio.AbstractEventLoop) -> tuple[float | None, float]:
        if self._time_left is None:
            return None, 0.0
        answer = await loop.run_in_executor(None, self._time_left)
        if answer is None:
            return None, 0.0
        left, limit = answer
        margin = margin_for(self.site, limit)
        self._lead = lead_for(margin, float(self.site.checkpoint_grace), limit)
        self._note(ends_in=round(left), ends_at=round(time.time() + left), wind_down_margin=round(self._lead))
        return time.monotonic() + left, margin

    async def _wind_down(self, scheduler: Any, proc: asyncio.subprocess.Process, why: str, end: float | None,
                         margin: float, loop: asyncio.AbstractEventLoop) -> None:
        from hpc_garage.cluster.stopping import stop_trials
        from hpc_garage.compat import hold_pause, pause_workers, run_on_workers

        paused = pause_workers(scheduler)
        await run_on_workers(scheduler, hold_pause)  # else the memory monitor resumes them within 0.1 s
        self.winding = True
        running = _executing_keys(scheduler)
        told = time.time()
        answers = await run_on_workers(scheduler, stop_trials, why, [_run_id(k) for k in running])
        known = {run_id: info for answer in answers.values() for run_id, info in (answer or {}).items()}
        grace = float(self.site.checkpoint_grace)
        self._say(f"{why}: winding down; no new trials on the {paused} workers; {len(running)} running are "
                  f"told to stop (checkpoint_grace {grace:.0f} s) and may finish")
        self._note(phase="winding down", wind_down=why)
        kill = margin / 2  # for stopping COMMAND and tearing down before the batch system kills the job
        ended: dict[str, float] = {}  # when each trial told to stop did
        while executing := await _executing(scheduler):  # asked of the workers, never a heartbeat late
            _note_ended(running, executing, ended)
            if end is not None and time.monotonic() >= end - kill:
                self._say(f"{len(executing)} trials still running {kill:.0f} s before the end; they "
                          "are stopped and run again in the next job")
                break
            if proc.returncode is not None and time.time() >= told + grace:
                break  # COMMAND ended (an interrupted trial ends the flow): the others had their grace
            if self._is_cancelled() and time.time() >= told + grace:
                self._say(f"{len(executing)} trials still running after their checkpoint_grace: they are "
                          "stopped (the job is being cancelled)")
                break
            await asyncio.sleep(0.5)
        known |= await _known(scheduler, [_run_id(k) for k in running])  # their last steps, now they stopped
        unfinished = [unfinished_trial(key, known.get(_run_id(key)), self.results, told, ended.get(key))
                      for key in running
                      if (_run_id(key) in known or key in executing) and _state(scheduler, key) != "memory"]
        await loop.run_in_executor(None, self._decide, unfinished)
        if proc.returncode is None:
            self.stopped = True
            self._say("stopping COMMAND: this job's part of the sweep is done; finished trials are kept")
            proc.send_signal(signal.SIGTERM)

    def _decide(self, unfinished: list[Unfinished]) -> None:
        """Record each interrupted trial; submit the follow-up job where another job gets further."""
        now = time.time()
        records = [_record(self.results, trial, self.job_id, now, self.site.max_continuations, self._say)
                   for trial in unfinished]
        new_results = _results_in(self.results) - self._kept
        interrupted = len(records)
        lost = [r["interruptions"][-1]["lost"] for r in records]
        self._note(interrupted=interrupted, continued=sum(1 for r in records if len(r["interruptions"]) > 1),
                   work_lost=round(sum(lost), 1))
        if records:
            self._say(f"{interrupted} trials interrupted: work lost since their last checkpoint "
                      + ", ".join(f"{r['task']} {r['interruptions'][-1]['lost']:.0f} s" for r in records))
        self.gave_up = [r for r in records if "gave_up" in r]
        self.interrupted = [{"task": r["task"], "trial": r["trial"], "lost": r["interruptions"][-1]["lost"],
                             "progress": r["interruptions"][-1]["progress"], "why": r.get("gave_up")}
                            for r in records]
        if self._is_cancelled():
            self._say("no follow-up job: the job is being cancelled; `hpc-garage resume "
                      f"{self.job_id}` continues the sweep" + (" from the trials' checkpoints" if records else ""))
            return
        if self.noticed:
            self._say("no follow-up job: the batch system is ending this job (SIGTERM); a requeued job continues "
                      f"the sweep, else `hpc-garage resume {self.job_id}`")
            return
        if self._follow_up is None:
            return
        if not new_results and not records:  # (noted: `status` and `--wait` end with it, not "to be continued")
            self._note(chain_ended=(why := "no trial finished or ran in this job, so no follow-up job (it would "
                                    "fare no better): give the sweep a longer walltime, then "
                                    f"`hpc-garage resume {self.job_id}`"))
            return self._say(why)
        if not follow_up_needed(records, new_results):
            for r in self.gave_up:
                self._say(f"trial {r['task']} ({r['trial'][:12]}) is not continued: {r['gave_up']} (interrupted "
                          f"{len(r['interruptions'])} times; the site's max_continuations is "
                          f"{self.site.max_continuations}); no follow-up job")
            self._note(chain_stopped=[{"task": r["task"], "trial": r["trial"], "why": r["gave_up"]}
                                      for r in self.gave_up])
            return
        try:
            self.next_job = self._follow_up()
            self._say(f"the sweep continues in job {self.next_job} once this one has ended "
                      f"(`hpc-garage status {self.next_job}`)")
            self._note(next_job=self.next_job)
        except Exception as exc:  # noqa: BLE001 - the sweep can still be resumed by hand
            self._say(f"could not submit the follow-up job ({exc}); resume by hand with `hpc-garage resume`")

    def _is_cancelled(self) -> bool:
        """Whether `hpc-garage cancel` asked for this wind-down (or for one under way): once seen, noted."""
        if not self.cancelling and self._cancel_requested():
            self.cancelling = True
            self._note(cancelled=True)
        return self.cancelling


def _record(results: Path | None, trial: Unfinished, job_id: str, now: float, max_continuations: int,
            say: Callable[[str], None]) -> dict[str, Any]:
    """The trial's record in the epoch's results, updated with this interruption."""
    path = results / TRIALS_DIR / f"{trial.trial.replace('/', '_')}.json" if results else None
    before = None
    if path is not None:
        try:
            before = json.loads(path.read_text())
        except (OSError, ValueError):
            before = None
    record = interruption(before, trial, job_id, now, max_continuations)
    if path is not None:
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)
            write_private(path, json.dumps(record))
        except OSError as exc:
            say(f"could not record interrupted trial {trial.task} in {path} ({exc})")
    return record


def _notices(heard: Callable[[Any], None]) -> Any:
    """A scheduler plugin that hands `heard` each NOTICE_TOPIC event (distributed imported here, not above)."""
    from distributed.diagnostics.plugin import SchedulerPlugin

    class Notices(SchedulerPlugin):
        def log_event(self, topic: str, msg: Any) -> None:
            if topic == NOTICE_TOPIC:
                heard(msg)

    return Notices()


def _run_id(key: str) -> str:
    """A task's Prefect task run id (hex) from its Dask key, `<task name>-<task run id hex>` (prefect/fast.py)."""
    return str(key).rsplit("-", 1)[-1]


def _executing_keys(scheduler: Any) -> list[str]:
    """Tasks running now, or about to (the workers' heartbeats tell `executing` late)."""
    return [str(ts.key) for ws in scheduler.workers.values() for ts in ws.processing]


def _state(scheduler: Any, key: str) -> str | None:
    return ts.state if (ts := scheduler.tasks.get(key)) is not None else None


def _note_ended(running: list[str], executing: set[str], ended: dict[str, float]) -> None:
    for key in running:
        if key not in executing and key not in ended:
            ended[key] = time.time()


async def _known(scheduler: Any, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """What the workers know of these trials now; nothing from a worker that does not answer."""
    from hpc_garage.cluster.stopping import known_trials
    from hpc_garage.compat import run_on_workers

    try:
        answers = await run_on_workers(scheduler, known_trials, run_ids, timeout=3.0)
    except Exception:  # noqa: BLE001 - the first answer stands
        return {}
    return {run_id: info for answer in answers.values() for run_id, info in (answer or {}).items()}


def _results_in(results: Path | None) -> int:
    """Finished trials the epoch keeps (Prefect's result files)."""
    if results is None or not results.is_dir():
        return 0
    return sum(1 for p in results.iterdir() if not p.name.startswith(".") and p.is_file())


async def _executing(scheduler: Any) -> set[str]:
    """What the workers execute, as they say (not their heartbeats: late under load, they missed trials)."""
    from hpc_garage.compat import executing_now, run_on_workers

    answers = await run_on_workers(scheduler, executing_now, timeout=3.0)
    return {str(key) for answer in answers.values() for key in (answer or ())} | {
        str(ts.key) for address, ws in scheduler.workers.items() if address not in answers for ts in ws.executing}


def _longest_trial(scheduler: Any, margin: float) -> float:
    """The longest mean duration of any kind of task seen so far (Dask keeps it per task prefix): trials
    that could not finish before the end are not started. Bounded, so one odd task cannot end a job early."""
    means = [tp.duration_average for tp in scheduler.task_prefixes.values() if tp.duration_average > 0]
    return min(max(means, default=0.0) * 1.2, 10 * margin)
