"""The stop a wind-down hands to the trials running on each worker, and what each worker knows of them.

Lives in every worker process and imports nothing heavy: `hpc_garage.trial.should_stop()` reads one flag
here (a trial that never asks pays nothing), and the scheduler runs `stop_trials` on every worker through
Dask's own `run` op (compat.run_on_workers) when the job winds down. Which trial a task is comes from the
sweep cache (prefect/sweep_cache.py notes each trial's result key as Prefect computes it, by task run id);
the wind-down keys its record of interruptions by it, across jobs.

The batch system's SIGTERM (Slurm's preemption notice reaches the job's steps, scancel and PBS's qdel every
process) does not end a worker at once: its trials are told to stop (`hold_term`), while its node process tells
`run`, whose wind-down gives them the time left (launchers/mpi.py, cluster/wind_down.py). A second SIGTERM ends
the worker as before (so does distributed's own escalation: SIGTERM, then SIGKILL).

A reason is kept per trial (`None`: every trial of this process), so that another stop reason for one trial
(a pruner's "pruned": prefect/metrics.py sends it to that trial's worker) can be added beside the job's own.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from hpc_garage.core.sweep import CHECKPOINTS_DIR, TRIALS_DIR
from hpc_garage.variables import WORKER_PRELOAD

__all__ = ["CHECKPOINTS_DIR", "REPORT_TOPIC", "TRIALS_DIR", "answering", "answers", "any_stop", "decided",
           "known_trials", "note_step", "note_trial", "on_stop", "reason", "hold_term", "stop", "stop_trials", "trial", "wait_answer",
           "waits_at"]

logger = logging.getLogger(__name__)

KEEP = 4096  # trials remembered per process: far more than run at once on one worker
REPORT_TOPIC = "hpc-garage-report"  # the Dask event topic of trial.report(); the flow's process subscribes to it
TERM_REASON = "signal SIGTERM: the job is ending (preemption, cancel)"

_stopping = threading.Event()  # set once any stop reason is known here: the cheap test
_reasons: dict[str | None, str] = {}  # trial (task run id hex) or None (every trial) -> why it should stop
_callbacks: list[Callable[[str], None]] = []
_trials: OrderedDict[str, dict[str, Any]] = OrderedDict()  # task run id hex -> {key, task, started, asked, step}
_lock = threading.Lock()


def any_stop() -> bool:
    """Whether any stop is known in this process: what a trial that asks pays while none is."""
    return _stopping.is_set()


def reason(trial: str | None) -> str | None:
    """Why `trial` (or, with None, every trial here) should stop; None while it should not."""
    if not _stopping.is_set():
        return None
    return _reasons.get(trial) or _reasons.get(None)


def stop(why: str, trial: str | None = None) -> None:
    """Ask one trial (None: every trial in this process) to stop; each callback runs once, in this thread."""
    with _lock:
        if trial in _reasons:
            return
        _reasons[trial] = why
        _stopping.set()
        callbacks = list(_callbacks)
    for callback in callbacks:
        try:
            callback(why)
        except Exception:  # noqa: BLE001 - a user's callback must not keep the other trials from their stop
            logger.exception("an on_stop callback failed")


def on_stop(callback: Callable[[str], None]) -> None:
    """Call `callback(reason)` when this process is told to stop (at once if it already was)."""
    with _lock:
        _callbacks.append(callback)
        why = _reasons.get(None)
    if why is not None:
        callback(why)


def note_trial(run_id: str, key: str, task: str) -> None:
    """A trial starts here under the sweep cache: its result key, for its checkpoint directory and the
    wind-down's record. A dictionary insert per task (bounded)."""
    with _lock:
        _trials[run_id] = {"key": key, "task": task, "started": time.time(), "asked": False}
        if len(_trials) > KEEP:
            _trials.popitem(last=False)


def trial(run_id: str) -> dict[str, Any] | None:
    with _lock:
        return _trials.get(run_id)


def note_step(run_id: str, step: int) -> None:
    """The trial reported `step` (trial.report): the progress the wind-down counts (cluster/interruptions.py).
    One dictionary look-up per report; a trial the sweep cache does not know is not kept."""
    known = _trials.get(run_id)
    if known is not None and step > known.get("step", -1):
        known["step"] = step


def stop_trials(why: str, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Run on each worker by the wind-down: tell every trial here to stop; answer what is known of those of
    `run_ids` (the tasks the scheduler sees executing) that run here."""
    stop(why)
    return known_trials(run_ids)


def known_trials(run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """What is known of those of `run_ids` that run here (the wind-down asks again once they stopped: their
    last step)."""
    with _lock:
        return {run_id: dict(_trials[run_id]) for run_id in run_ids if run_id in _trials}


def hold_term() -> None:
    """In a worker's forkserver (prefect/worker.py, which every worker process inherits), not elsewhere: the
    first SIGTERM tells this process's trials to stop instead of ending it."""
    if os.environ.get(WORKER_PRELOAD) and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_term)


_term_seen = threading.Event()


def _on_term(signum: int, frame: Any) -> None:
    """The signal handler: no lock taken here (the interrupted thread may hold one); a thread says stop."""
    if _term_seen.is_set():  # the second: end as SIGTERM ends a process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _term_seen.set()
    threading.Thread(target=stop, args=(TERM_REASON,), name="hpc-garage-sigterm", daemon=True).start()


# ---- the pruner's answer to a report: Ray Tune's trials wait in tune.report() until its scheduler decided;
# a trial with slow steps here waits too (trial.report), so that a pruned trial does not run one more step.

_answered: dict[str, int] = {}  # task run id hex -> the last report number the flow's pruner answered
_wait_from: dict[str, int] = {}  # task run id hex -> the step from which its reports wait for an answer again
_answer = threading.Condition(_lock)
_answering = threading.Event()  # set on every worker of a flow with a pruner (prefect/metrics.py's plugin)


def answering(on: bool) -> None:
    """A flow whose pruner answers each report uses this worker (on), or no longer (off)."""
    if on:
        _answering.set()
    else:
        _answering.clear()


def decided(run_id: str, number: int, pruned: bool, wait_from: int | None = None) -> None:
    """Run on the trial's worker by the flow's process (Dask's run op): report `number` of task run `run_id`
    was decided; stop it first where it was pruned. `wait_from`: the first step at which the pruner can decide
    again, where the trial's reports wait once more (None: at its next report)."""
    if pruned:
        stop("pruned", trial=run_id)
    with _answer:
        if number > _answered.get(run_id, -1):
            _answered[run_id] = number
            if wait_from is not None:
                _wait_from[run_id] = wait_from
            else:
                _wait_from.pop(run_id, None)
            for kept in (_answered, _wait_from):
                if len(kept) > KEEP:
                    kept.pop(next(iter(kept)))
        _answer.notify_all()


def answers() -> bool:
    """Whether a pruner answers the reports of the trials here."""
    return _answering.is_set()


def waits_at(run_id: str, step: int) -> bool:
    """Whether the trial's report at `step` waits for the pruner's answer: from its first report on, until an
    answer said from which step the pruner can decide next."""
    return step >= _wait_from.get(run_id, step)


def wait_answer(run_id: str, number: int, timeout: float) -> bool:
    """Block the trial until report `number` is decided, at most `timeout` s; False when it was not."""
    with _answer:
        return _answer.wait_for(lambda: _answered.get(run_id, -1) >= number, timeout)


def reset() -> None:
    """Forget every stop (tests; a process reused for another run)."""
    with _lock:
        _reasons.clear()
        _callbacks.clear()
        _trials.clear()
        _answered.clear()
        _wait_from.clear()
        _answering.clear()
        _stopping.clear()
        _term_seen.clear()
