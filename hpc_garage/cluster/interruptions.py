"""What a job's end did to each unfinished trial, and whether the job chain goes on: pure decisions that the
wind-down (cluster/wind_down.py) records in `.trials/<key>.json`, job after job.

Progress is what the trial states: the step of its latest `hpc_garage.trial.report(step, ...)` in the job
(its worker keeps it, cluster/stopping.py). A trial that reports a step past every step an earlier job saw
and has a checkpoint made progress; one that re-saves the same step each job (its restart costs about a job)
did not, however new its checkpoint file is, and ends the chain after `max_continuations` jobs, named. A
trial that reports no step is judged by its checkpoint as before: a checkpoint newer than the one its last
interruption saw (file times against file times: the shared storage's clock, never a node's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_garage.core.sweep import CHECKPOINTS_DIR

NEVER_CHECKPOINTS = "longer than the walltime and never checkpoints"


@dataclass(frozen=True)
class Unfinished:
    """A trial still running when its job wound down, as the job saw it end."""

    trial: str  # its result key (the sweep cache's), or `task:<name>` for a task the sweep does not cache
    task: str
    started: float  # when it started in this job (epoch seconds)
    checkpoint: float | None  # when its newest checkpoint was written, if it has one
    ended: float | None = None  # when it stopped (raised Interrupted); None: it ran until the job's end
    step: int | None = None  # the step of its latest trial.report() in this job; None: it reported none


def interruption(before: dict[str, Any] | None, trial: Unfinished, job_id: str, now: float,
                 max_continuations: int) -> dict[str, Any]:
    """The trial's record after this interruption (progress: see the module's text); the work lost: the time
    since its newest checkpoint (since its start, without progress). Given up: more than `max_continuations`
    interruptions in a row without progress."""
    record = dict(before or {"task": trial.task, "trial": trial.trial, "interruptions": []})
    seen, seen_step = record.get("checkpoint"), record.get("step")
    if trial.step is not None:  # the step it states, never a file's time
        progress = trial.checkpoint is not None and (seen_step is None or trial.step > int(seen_step))
        record["step"] = trial.step if seen_step is None else max(trial.step, int(seen_step))
    else:
        progress = trial.checkpoint is not None and (seen is None or trial.checkpoint > float(seen))
    if trial.checkpoint is not None:
        record["checkpoint"] = trial.checkpoint
    lost = (trial.ended or now) - (trial.checkpoint if progress and trial.checkpoint is not None else trial.started)
    record["interruptions"] = [*record.get("interruptions", []),
                               {"job": job_id, "at": now, "progress": progress, "lost": round(max(lost, 0.0), 1)}
                               | ({"step": trial.step} if trial.step is not None else {})]
    record["without_progress"] = 0 if progress else int(record.get("without_progress", 0)) + 1
    record["checkpointed"] = bool(record.get("checkpointed")) or trial.checkpoint is not None
    if record["without_progress"] > max_continuations:
        n = record["without_progress"]
        record["gave_up"] = (NEVER_CHECKPOINTS if not record["checkpointed"]
                             else f"no step past {record['step']} in {n} jobs in a row" if trial.step is not None
                             else f"no new checkpoint in {n} jobs in a row")
    else:
        record.pop("gave_up", None)
    return record


def follow_up_needed(records: list[dict[str, Any]], new_results: int) -> bool:
    """Whether another job would get further: this one stored a result, or some interrupted trial made
    progress or may still be continued."""
    return new_results > 0 or any(r["interruptions"][-1]["progress"] or "gave_up" not in r for r in records)


def unfinished_trial(key: str, info: dict[str, Any] | None, results: Path | None, told: float,
                ended: float | None) -> Unfinished:
    """A trial the job's end interrupted, with its newest checkpoint (what its directory holds)."""
    if info is None:
        task = str(key).rsplit("-", 1)[0]
        return Unfinished(f"task:{task}", task, told, None, ended)
    checkpoint = newest(results / CHECKPOINTS_DIR / str(info["key"])) if results is not None else None
    step = info.get("step")
    return Unfinished(str(info["key"]), str(info["task"]), float(info["started"]), checkpoint, ended,
                      int(step) if isinstance(step, int) else None)


def newest(path: Path) -> float | None:
    """When anything under `path` was last written; None for nothing there."""
    found = None
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                mtime = os.stat(os.path.join(root, name)).st_mtime
            except OSError:
                continue
            found = mtime if found is None else max(found, mtime)
    return found
