"""What the trials reported (`hpc_garage.trial.report`), as `status`, `--wait`, the report, its plot and Prefect
read it.

The flow's driver (prefect/metrics.py) keeps the run directory's `metrics/trials.json` (RunDir.metrics_summary:
each reporting trial's last and best values, its state, the best trial, counts) and one `<trial>.jsonl` of
reports per trial. Everything here only reads them, and a reader must never fail what it serves: a missing,
half-written or foreign file reads as nothing. Plain Python: the CLI imports this without Dask.
- `Watch`: for `run`'s progress (cluster/progress.py), every PROGRESS_SECONDS; the file is read again only
  when it changed, so a sweep that never reports costs one stat.
- `live(summary)`: state.json's `progress.metrics`, {reporting, pruned, best}.
- `section(summary, timed)`: report.json's "metrics": per trial its state, duration and GPUs (`timed`: the
  report's own trials by task run id, cluster/report.by_task_run), the best trial, and the GPU-seconds pruning
  saved, an estimate: for each pruned trial, the mean duration of the trials that ran to the end less its own
  (never below 0), times its GPUs.
- `lines(section)`: what the report's summary adds; `curves(rundir, section)`: the points `report --plot`
  draws.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.files import read_json

if TYPE_CHECKING:
    from hpc_garage.rundir import RunDir

__all__ = ["Watch", "best_of", "curves", "lines", "live", "read_summary", "section"]

STATES = ("running", "done", "pruned", "failed", "interrupted")  # prefect/metrics.py's; "running" until it ends
UNFINISHED = (("failed", "failed"), ("interrupted", "interrupted"), ("running", "did not end"))  # state, in words


def read_summary(path: Path) -> dict[str, Any] | None:
    """trials.json as its writer left it, its trials those that are objects; None where there is none, it is
    being written (files.write_json replaces it whole, but a copy or an older writer may not), or it is not one."""
    data = read_json(path)
    if data is None or not isinstance(data.get("trials"), dict):
        return None
    return {**data, "trials": {str(k): v for k, v in data["trials"].items() if isinstance(v, dict)}}


class Watch:
    """trials.json's `live` figures, read again only when the file changed (its size or mtime)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: tuple[int, int] | None = None
        self.figures: dict[str, Any] | None = None

    def __call__(self) -> dict[str, Any] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            self.seen, self.figures = None, None
            return None
        if (stat.st_mtime_ns, stat.st_size) != self.seen:
            try:
                summary = read_summary(self.path)
                self.figures = live(summary) if summary is not None else None
            except Exception:  # noqa: BLE001 - a foreign file's shape: progress goes on without it
                self.figures = None
            self.seen = (stat.st_mtime_ns, stat.st_size)
        return self.figures


def live(summary: dict[str, Any]) -> dict[str, Any] | None:
    """{reporting (trials reporting now: running), pruned, best} where some trial reported; None where none did
    (status then shows nothing)."""
    trials = summary["trials"]
    if not trials:
        return None
    running = sum(1 for t in trials.values() if t.get("state") == "running")
    return {"reporting": _count(summary.get("reporting"), running),
            "pruned": _count(summary.get("pruned"), sum(1 for t in trials.values() if t.get("state") == "pruned")),
            "best": best_of(summary)}


def best_of(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The best trial: {trial, task, metric, value, step}. As trials.json names it; where it names none, each
    trial's best of the summary's metric (without one, the first metric a trial reported), lowest unless the
    mode is "max"."""
    trials, metric = summary["trials"], summary.get("metric")
    best = summary.get("best")
    if isinstance(best, dict) and str(best.get("trial")) in trials and _finite(best.get("value")):
        trial = trials[str(best["trial"])]
        name = metric or next(iter(trial.get("best") or {}), None)
        return {"trial": str(best["trial"]), "task": trial.get("task"), "metric": name,
                "value": float(best["value"]), "step": best.get("step")}
    if not metric:
        metric = next((name for t in trials.values() for name in (t.get("best") or {})), None)
    scored = [(float(t["best"][metric]), trial) for trial, t in trials.items()
              if isinstance(t.get("best"), dict) and _finite(t["best"].get(metric))]
    if not scored:
        return None
    value, trial = (max if summary.get("mode") == "max" else min)(scored, key=lambda s: s[0])
    return {"trial": trial, "task": trials[trial].get("task"), "metric": metric, "value": value,
            "step": trials[trial].get("best_step")}  # trials.json names the step of the run's best only


def section(summary: dict[str, Any], timed: Mapping[str, dict[str, Any]]) -> dict[str, Any] | None:
    """report.json's "metrics" (see the module docstring); None where no trial reported. `timed`: the report's
    trials (duration_s, gpus) by their task run id hex, the `run` of each trial in trials.json."""
    if not summary["trials"]:
        return None
    rows = []
    for trial_id, t in summary["trials"].items():
        ran = timed.get(str(t.get("run")))
        if ran is not None:
            duration, gpus = float(ran["duration_s"]), len(ran.get("gpus") or ())
        else:  # a task run the report did not time (run elsewhere): the driver's own first and last word
            started, ended = t.get("started"), t.get("ended")
            duration = float(ended) - float(started) if _finite(started) and _finite(ended) else None
            gpus = 0
        rows.append({"trial": trial_id, "task": t.get("task"), "run": t.get("run"),
                     "state": t.get("state") if t.get("state") in STATES else "running",
                     "reports": t.get("reports"), "last_step": t.get("last_step"),
                     "last": _values(t.get("last")), "best": _values(t.get("best")),
                     "duration_s": None if duration is None else round(duration, 3), "gpus": gpus})
    finished = [r["duration_s"] for r in rows if r["state"] == "done" and r["duration_s"] is not None]
    pruned = [r for r in rows if r["state"] == "pruned"]
    mean = statistics.fmean(finished) if finished else None
    timed_pruned = [r for r in pruned if r["duration_s"] is not None]
    gpu = any(r["gpus"] for r in timed_pruned)  # else worker-seconds: a CPU sweep's pruning saves those
    saved = (sum(max(mean - r["duration_s"], 0.0) * (r["gpus"] if gpu else 1) for r in timed_pruned)
             if mean is not None and timed_pruned else None)
    return {"metric": summary.get("metric"), "mode": summary.get("mode") or "min", "pruner": summary.get("pruner"),
            "reporting": len(rows), "done": sum(1 for r in rows if r["state"] == "done"), "pruned": len(pruned),
            **{state: sum(1 for r in rows if r["state"] == state) for state in ("failed", "interrupted", "running")},
            "best": best_of(summary),
            "saved": None if saved is None else {"seconds": round(saved, 1), "unit": "GPU-s" if gpu else "worker-s",
                                                 "mean_finished_s": round(mean or 0.0, 3), "finished": len(finished),
                                                 "pruned_timed": len(timed_pruned)},
            "trials": rows}


def lines(metrics: dict[str, Any] | None) -> list[str]:
    """The report's lines on what the trials reported: the best trial, how many were pruned, what that saved."""
    from hpc_garage.core.progress_text import trial_label

    if not metrics:
        return []
    best = metrics.get("best")
    text = f"trial metrics: {metrics['reporting']} trials reported"
    if best:
        text += (f"; best {best['metric']} {best['value']:.4g} (trial {trial_label(best['trial'], best.get('task'))}"
                 + (f" step {best['step']}" if best.get("step") is not None else "") + ")")
    text += (f"; {metrics['done']} ran to the end, {metrics['pruned']} pruned"
             + (f" ({metrics['pruner']})" if metrics.get("pruner") else "")
             + "".join(f", {metrics[state]} {word}" for state, word in UNFINISHED if metrics.get(state)))
    found = [text]
    saved = metrics.get("saved")
    if saved:
        found.append(f"pruning saved about {saved['seconds']:.1f} {saved['unit']} (an estimate: for each of the "
                     f"{saved['pruned_timed']} pruned trials, the {saved['mean_finished_s']:.1f} s mean of the "
                     f"{saved['finished']} that ran to the end less its own duration, times its "
                     f"{'GPUs' if saved['unit'] == 'GPU-s' else 'workers'})")
    elif metrics["pruned"]:
        found.append("pruning saved: not estimated (no trial ran to the end to compare the pruned ones with)")
    return found


def curves(rundir: RunDir, metrics: dict[str, Any], *, most: int = 100_000) -> dict[str, list[tuple[float, float]]]:
    """Each reporting trial's (step, value) of the metric (without one, the first it reported), from its
    `<trial>.jsonl`; at most `most` points per trial (the last ones); unreadable lines and files skipped."""
    metric = metrics.get("metric") or (metrics.get("best") or {}).get("metric")
    found: dict[str, list[tuple[float, float]]] = {}
    for row in metrics.get("trials", []):
        points: list[tuple[float, float]] = []
        try:
            with open(rundir.trial_metrics(str(row["trial"])), encoding="utf-8") as lines_:
                for line in lines_:
                    try:
                        report = json.loads(line)
                        values = report["values"]
                        name = metric or next(iter(values))
                        if _finite(report["step"]) and _finite(values.get(name)):
                            points.append((float(report["step"]), float(values[name])))
                    except (ValueError, KeyError, TypeError, AttributeError, StopIteration):
                        continue
        except OSError:
            continue
        if points:
            found[str(row["trial"])] = sorted(points[-most:])
    return found


def _values(values: Any) -> dict[str, float]:
    return {str(k): float(v) for k, v in values.items() if _finite(v)} if isinstance(values, dict) else {}


def _count(value: Any, otherwise: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else otherwise


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
