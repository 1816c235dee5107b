"""A run's progress in words: the lines `status`, `submit --wait`, `run`'s report and the trials' Prefect
artifacts show for the figures other layers keep (state.json's "progress", cluster/progress.py; what the trials
reported, cluster/trial_metrics.py; a sweep's trials across its jobs, sweeps.py). Plain dicts in, one line out:
every layer that shows a job uses these, so a job reads the same wherever it is shown.
"""

from __future__ import annotations

from typing import Any

__all__ = ["interrupted_text", "metrics_text", "progress_text", "sweep_text", "trial_label"]


def progress_text(progress: dict[str, Any]) -> str:
    """`12 done, 4 running, 1 failed, 20 waiting; GPUs 4/4 busy; 1m05s, ETA 2m10s` (cluster/progress.py)."""
    counts = ", ".join(f"{progress.get(k, 0)} {k}" for k in ("done", "running", "failed", "waiting"))
    parts = [counts]
    if progress.get("gpus"):
        parts.append(f"GPUs {progress.get('gpus_busy', 0)}/{progress['gpus']} busy")
    elapsed = progress.get("elapsed")
    if elapsed is not None:
        eta = progress.get("eta")
        parts.append(_duration(elapsed) + (f", ETA {_duration(eta)}" if eta is not None else ""))
    if text := metrics_text(progress.get("metrics")):
        parts.append(text)
    return "; ".join(parts)


def metrics_text(metrics: Any) -> str | None:
    """`best loss 0.29 (trial train-3 step 11), 3 reporting, 5 pruned` (progress's "metrics", from what the
    trials reported: cluster/trial_metrics.py; reporting: those running now); None where no trial reported, or
    the figures are not that shape."""
    if not isinstance(metrics, dict) or not isinstance(metrics.get("reporting"), int):
        return None
    best = metrics.get("best")
    best = best if isinstance(best, dict) and isinstance(best.get("value"), (int, float)) else None
    if not metrics["reporting"] and not metrics.get("pruned") and best is None:
        return None
    parts = []
    if best is not None:
        step = f" step {best['step']}" if best.get("step") is not None else ""
        parts.append(f"best {best.get('metric') or 'value'} {best['value']:.4g} "
                     f"(trial {trial_label(str(best.get('trial')), best.get('task'))}{step})")
    parts.append(f"{metrics['reporting']} reporting")
    if isinstance(metrics.get("pruned"), int) and metrics["pruned"]:
        parts.append(f"{metrics['pruned']} pruned")
    return ", ".join(parts)


def trial_label(trial: str, task: Any = None) -> str:
    """A trial as a line names it: its id where short, else its task and the id's first 8 characters (a
    trial's id is its result's key or its task run's id: 32 hex digits)."""
    if len(trial) <= 16:
        return trial
    return f"{task}-{trial[:8]}" if task else trial[:12]


def sweep_text(sweep: dict[str, Any] | None) -> str | None:
    """`40 done, 4 running, 0 failed, 36 to go (3 jobs); 2 ran again because their task's source changed
    (train)`: the trials of a sweep's epoch across its jobs (JobView.sweep)."""
    trials = (sweep or {}).get("trials")
    if not trials:
        return None
    text = ", ".join(f"{trials.get(k, 0)} {k.replace('_', ' ')}" for k in ("done", "running", "failed", "to_go"))
    jobs = trials.get("jobs", 0)
    text += f" ({jobs} job{'s' if jobs != 1 else ''})"
    if changed := (sweep or {}).get("source_changed"):
        n = sum(changed.values())
        text += f"; {n} ran again because {'its' if n == 1 else 'their'} task's source changed ({', '.join(changed)})"
    return text + interrupted_text((sweep or {}).get("interrupted"))


def interrupted_text(cut: dict[str, Any] | None) -> str:
    """`; 2 interrupted, to be continued; 2 continued from their checkpoints (work lost 12 s, at most 5 s);
    trial train (3f2a…) not continued: longer than the walltime and never checkpoints` (sweeps.interruptions)."""
    if not cut:
        return ""
    text = f"; {cut['interrupted']} interrupted, to be continued" if cut.get("interrupted") else ""
    if cut.get("continued"):
        text += (f"; {cut['continued']} continued from their checkpoints (work lost {cut.get('lost', 0):.0f} s, "
                 f"at most {cut.get('lost_max', 0):.0f} s)")
    by_why: dict[str, list[str]] = {}
    for stopped in cut.get("stopped") or []:
        by_why.setdefault(str(stopped["why"]), []).append(f"{stopped['task']} ({str(stopped['trial'])[:12]})")
    for why, trials in by_why.items():
        text += f"; trial{'s' if len(trials) > 1 else ''} {', '.join(trials)} not continued: {why}"
    return text


def search_text(search: Any) -> str | None:
    """A search's search.json (hpc_garage.search) in one line: told, pruned, failed, GPU-hours against the
    budget, the best trial and its parameters, why it stopped; None for anything else."""
    if not isinstance(search, dict) or "told" not in search:
        return None
    budget = search.get("budget_gpu_hours")
    used = f"{search.get('gpu_hours') or 0:.3g} GPUh" + (f" of {budget:.3g} GPUh" if budget is not None else "")
    best = search.get("best")
    found = (f"best #{best.get('number')} {search.get('metric')} {best.get('value'):.6g} {best.get('params')}"
             if isinstance(best, dict) and isinstance(best.get("value"), (int, float)) else "no trial finished yet")
    stopped = f"; stopped: {search['stopped']}" if search.get("stopped") else ""
    return (f"{search.get('study')}: {search['told']} trials told ({search.get('complete', 0)} complete, "
            f"{search.get('pruned', 0)} pruned, {search.get('failed', 0)} failed), {used}; {found}{stopped}")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60
            else f"{rest}s")
