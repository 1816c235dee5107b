"""What a trial uses while it runs: a checkpoint directory that follows it from job to job, a stop it can act
on before its job ends (or when the pruner stops it), the exception that says "saved, not done", and
`report()`, the values it reports as it goes.

    from hpc_garage import trial

    @task(tags=hpc_garage.resources(gpu=1))
    def train(lr: float) -> float:
        ckpt = trial.checkpoint_dir() / "state.pt"
        state = load(ckpt) if ckpt.exists() else fresh(lr)
        while not state.done:
            step(state)
            trial.report(state.step, loss=state.loss)
            if state.step % 100 == 0 or trial.should_stop():
                save(state, ckpt)
            if trial.stop_reason() == "pruned":  # the pruner stopped it: a result, not an interruption
                return state.loss
            if trial.should_stop():
                raise trial.Interrupted("checkpoint saved")
        return state.loss

Under `hpc-garage run` (a job, a follow-up, a resume, or `run` on a login node) the directory is
`<the epoch's results>/.checkpoints/<the trial's result key>`: the key Prefect caches the trial's result
under (task source + inputs + sweep epoch), so every job and attempt of the trial in the epoch finds it,
a trial whose source or inputs changed does not, and a fresh `submit` (a new epoch) starts clean. Outside
hpc-garage (plain `python sweep.py`) it is `./.hpc-garage-checkpoints/<task source + inputs>` and
`should_stop()` is always False: the same code runs unchanged.

An interrupted trial ends in Prefect's **Crashed** state ("Execution was interrupted ... Interrupted: ..."):
Prefect's own state for a run its infrastructure stopped, neither Failed nor Completed. Its result is not
cached and Prefect does not retry it; the follow-up job (the site's `requeue: auto`) or `hpc-garage resume`
runs it again, from its checkpoint. `Interrupted` derives from BaseException, as KeyboardInterrupt does, so
an `except Exception:` in the trial does not swallow it.

`report(step, loss=..., acc=...)` hands one message to the worker's event loop, which sends the reports on
Dask's own channel from the worker to its scheduler (structured events, several reports to an event, on the
worker's batched stream, no reply awaited, no Prefect API call); the flow's process stores it in the
run directory and, where `hpc_garage.task_runner(pruner=..., metric=...)` names a pruner, asks it. A trial
the pruner stops sees `should_stop()` true with `stop_reason() == "pruned"`: it should return its result
(it is then recorded as pruned, Completed and cached, and not run again by a resume or a follow-up job).
Outside a Dask worker (plain `python sweep.py`) `report()` checks its arguments and does nothing more.

Imports nothing heavy: should_stop() is one flag test; report() builds one small message.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_garage.cluster import stopping
from hpc_garage.cluster.stopping import CHECKPOINTS_DIR, REPORT_TOPIC
from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV

__all__ = ["Interrupted", "checkpoint_dir", "on_stop", "report", "should_stop", "stop_reason"]

LOCAL_DIR = ".hpc-garage-checkpoints"  # outside hpc-garage: under the current directory
# With a pruner, a report waits for its decision (as Ray Tune's tune.report does), at most ANSWER_TIMEOUT, but only
# at a step where the pruner can stop the trial (every step, or successive halving's rungs: each answer says where
# next) and where the trial's steps are slower than WAIT_ABOVE: a trial reporting faster loses less to one more
# step than to a round trip per report.
WAIT_ABOVE = 0.02  # s since the trial's previous report (or since it started)
ANSWER_TIMEOUT = 3.0  # s: a report held for its rivals at a rung waits up to 1 s (prefect/decisions.py's HOLD_MAX)
EVENT_REPORTS = 1000  # reports in one event at most: {"reports": [{"trial", "run", "task", "step", ...}, ...]}


class Interrupted(BaseException):
    """Raised by a trial that saved its checkpoint and is not done: recorded as interrupted (Prefect's
    Crashed), not failed and not finished; its result is not cached, and it is continued from the checkpoint."""


def should_stop() -> bool:
    """True once this trial's job is winding down (walltime margin, the site's warning_signal, a preemption
    notice): save a checkpoint and raise Interrupted within the site's `checkpoint_grace`. False outside
    hpc-garage."""
    return stopping.any_stop() and stopping.reason(_run_id()) is not None


def stop_reason() -> str | None:
    """Why this trial should stop (e.g. "walltime: 30 s left"), or None."""
    return stopping.reason(_run_id()) if stopping.any_stop() else None


def report(step: int, **metrics: float) -> None:
    """Report this trial's values at `step` (an int >= 0): `trial.report(step, loss=loss, acc=acc)`.

    They are kept per trial in the job's run directory (status, the report, Prefect show them) and, with a
    pruner, decide whether the trial goes on: check `should_stop()` after reporting. With a pruner, a trial
    whose steps take WAIT_ABOVE or more waits here for the decision (at most ANSWER_TIMEOUT), as Ray Tune's
    `tune.report` does, so that a pruned trial runs no step past it; a faster one does not wait, and no trial
    waits at a step where its pruner cannot stop it (between successive halving's rungs). A step reported again
    (a trial continued from its checkpoint) is kept, and the pruner keeps its first value. Outside a Dask
    worker this only checks its arguments. A bad step or value is a ValueError naming it.
    """
    values = _checked(step, metrics)
    worker = _worker()
    if worker is None:
        return
    header = _header()
    if header is None:  # a plain Dask task, not a Prefect task run: no trial to report for
        return
    run_id, now = header["run"], time.time()
    stopping.note_step(run_id, int(step))  # the progress a wind-down counts: the step the trial states
    number, previous = _numbers.get(run_id, (0, 0.0))
    number += 1
    _numbers[run_id] = (number, now)
    # a pruner answers: wait for its decision where a step takes longer than a round trip costs, unless this
    # trial was told to stop already (pruned: no more answers) or an answer came too late once
    wait = (stopping.answers() and now - previous >= WAIT_ABOVE and run_id not in _unanswered
            and stopping.reason(run_id) is None and stopping.waits_at(run_id, int(step)))
    _outbox.append((worker, {**header, "step": int(step), "time": now, "values": values, "worker": worker.address,
                             "number": number, "answer": wait, "since": now - previous if previous else None}))
    global _flush_due
    if not _flush_due:
        _flush_due = True
        worker.loop.add_callback(_flush)
    if wait and not stopping.wait_answer(run_id, number, ANSWER_TIMEOUT):
        _unanswered.add(run_id)  # the flow's process is too busy to answer in time: stop waiting for it


def on_stop(callback: Callable[[str], None]) -> None:
    """Call `callback(reason)` once when this process is told to stop, from the worker's event loop: keep it
    short (set a flag, signal a training loop); the checkpoint is saved by the trial's own thread."""
    stopping.on_stop(callback)


def checkpoint_dir() -> Path:
    """This trial's checkpoint directory (created): the same in every job and attempt of the trial within
    the sweep's epoch, on the sweep's results storage; a local directory outside hpc-garage."""
    from hpc_garage.prefect.sweep_cache import task_context, trial_key

    ctx = task_context()
    sweep, results = os.environ.get(SWEEP_ENV), os.environ.get(RESULTS_ENV)
    key = trial_key(ctx, sweep or "") if ctx is not None else None
    if sweep and results and key:
        run_id = ctx.task_run.id.hex
        if (known := stopping.trial(run_id)) is not None:
            known["asked"] = True
        path = Path(results) / CHECKPOINTS_DIR / key
    else:
        path = Path.cwd() / LOCAL_DIR / (key or "default")
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _run_id() -> str | None:
    """The current Prefect task run's id (hex); asked only once a stop is known."""
    try:
        from hpc_garage.prefect.sweep_cache import task_context
    except ImportError:  # no Prefect here
        return None
    ctx = task_context()
    return ctx.task_run.id.hex if ctx is not None else None


def _checked(step: Any, metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics as floats; ValueError, one line, for a step that is not an int >= 0 or a value that is not
    a finite real number (a 0-d tensor or a NumPy scalar is one)."""
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
        raise ValueError(f"trial.report(step={step!r}): step must be an int >= 0 (the trial's epoch or iteration)")
    if not metrics:
        raise ValueError(f"trial.report({step!r}) reports no value; name each one: trial.report(step, loss=...)")
    values = {}
    for name, value in metrics.items():
        try:
            number = float(value) if not isinstance(value, (str, bytes, bool)) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise ValueError(f"trial.report({step}, {name}={value!r}): {name} must be a finite real number")
        values[name] = number
    return values


def _worker() -> Any:
    """The Dask worker running this thread's task, or None; never imports distributed (plain python)."""
    module = sys.modules.get("distributed.worker")
    if module is None:
        return None
    try:
        return module.get_worker()
    except ValueError:
        return None


# Reports wait here for the worker's event loop, which sends them on (Worker.log_event: its batched stream):
# waking the loop once per report would cost more than the report (a thread switch each), so the first report
# after a flush wakes it, and the ones that follow while it is busy go with it.
_outbox: deque[tuple[Any, dict[str, Any]]] = deque()  # (worker, message); deque appends are thread-safe
_flush_due = False  # a flush is scheduled on the loop and has not started


def _flush() -> None:
    """On the worker's event loop: send the waiting reports, in order, as one event per worker and EVENT_REPORTS
    (the scheduler then handles one message for many reports)."""
    global _flush_due
    _flush_due = False  # first: a report added from here on schedules the next flush
    batches: dict[int, tuple[Any, list[dict[str, Any]]]] = {}
    while _outbox:
        worker, msg = _outbox.popleft()
        reports = batches.setdefault(id(worker), (worker, []))[1]
        reports.append(msg)
        if len(reports) >= EVENT_REPORTS:
            worker.log_event(REPORT_TOPIC, {"reports": batches.pop(id(worker))[1]})
    for worker, reports in batches.values():
        worker.log_event(REPORT_TOPIC, {"reports": reports})


_headers: dict[str, dict[str, str]] = {}  # task run id hex -> what each of its reports says it is
# task run id hex -> (its reports so far, when the last was made or, before the first, when the task started)
_numbers: dict[str, tuple[int, float]] = {}
_unanswered: set[str] = set()  # task run ids hex whose report was not answered within ANSWER_TIMEOUT


def _header() -> dict[str, str] | None:
    """{"trial", "run", "task"} of the current Prefect task run: its sweep-cache key where known (the same in
    every job of the epoch), else its task run id; None outside a task run."""
    context = sys.modules.get("prefect.context")
    ctx = context.TaskRunContext.get() if context is not None else None
    if ctx is None:
        return None
    run_id = ctx.task_run.id.hex
    header = _headers.get(run_id)
    if header is None:
        known = stopping.trial(run_id)
        if len(_headers) >= stopping.KEEP:
            _headers.clear()
            _numbers.clear()
            _unanswered.clear()
        header = _headers[run_id] = {"trial": str(known["key"]) if known else run_id, "run": run_id,
                                     "task": ctx.task.name}
        start = getattr(ctx.task_run, "start_time", None)  # Prefect's: the task run entered Running
        _numbers.setdefault(run_id, (0, start.timestamp() if start else 0.0))
    return header
