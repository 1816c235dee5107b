"""The efficiency report of a run: how well the allocation was used, per GPU, per worker and per trial.

`build(record)` turns what `progress.RunProgress.record()` kept (workers with the span they were up, trials
with their worker and the scheduler's compute start/stop, the samplers' GPU figures) into `report.json`:
- per GPU and per worker: allocated seconds (the worker's span: registration to the end of the run), busy
  seconds (the union of its trials' compute spans within it), the idle gaps between (they add up to
  allocated minus busy), and trials; a GPU is busy while its worker runs a trial;
- per worker: peak memory (as its heartbeats reported it) against its limit;
- per trial: worker, GPUs, duration, failed, and where the worker could read its GPUs (NVML, amdsmi),
  mean and peak utilisation and peak device memory.
`summary(report)` is the five lines `run` prints at the end and `hpc-garage report JOB` prints again, and where
trials reported (`trial.report`) what they did: the best trial, pruned ones, what pruning saved (report.json's
"metrics", cluster/trial_metrics.py); `report_plot.plot` draws it (`trial_curves`: the trials' points for it).
Plain Python: the CLI imports this module without Dask.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from typing import Any

from hpc_garage.core.progress_text import search_text
from hpc_garage.core.units import format_bytes
from hpc_garage.files import read_json

__all__ = ["TASK_RUN_ID", "build", "busy_and_gaps", "by_task_run", "load", "summary", "task_run_of", "trial_curves",
           "with_metrics"]

TASK_RUN_ID = re.compile(r"-([0-9a-f]{32})$")  # a Prefect trial's Dask key: `<task name>-<task run id hex>`
GPU_FIGURES = ("gpu_util_mean", "gpu_util_peak", "gpu_memory_peak")

Span = tuple[float, float]


def busy_and_gaps(spans: list[Span], window: Span) -> tuple[float, list[Span]]:
    """Busy seconds (the union of `spans` clipped to `window`) and the idle gaps of the window around them."""
    start, end = window
    busy, gaps, at = 0.0, [], start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans):
        if b <= a or b <= at:
            continue
        if a > at:
            gaps.append((at, a))
        busy += b - max(a, at)
        at = b
    if end > at:
        gaps.append((at, end))
    return busy, gaps


def build(record: dict[str, Any]) -> dict[str, Any]:
    """The report from a progress record (times in epoch seconds; gaps relative to the run's start)."""
    t0 = record["started"]
    by_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for trial in record["trials"]:
        by_worker[trial["worker"]].append(trial)
    workers, gpus = [], []
    for w in record["workers"]:
        window = (w["joined"], w["left"])
        mine = [t for t in by_worker.get(w["name"], [])  # a worker restarted under its name is a new record
                if t["stop"] > window[0] and t["start"] < window[1]]
        busy, gaps = busy_and_gaps([(t["start"], t["stop"]) for t in mine], window)
        usage = {"allocated_s": _r(window[1] - window[0]), "busy_s": _r(busy),
                 "idle_s": _r(sum(b - a for a, b in gaps)), "gaps": [[_r(a - t0), _r(b - t0)] for a, b in gaps],
                 "trials": len(mine)}
        workers.append({"worker": w["name"], **usage, "memory_peak": w["memory_peak"],
                        "memory_limit": w["memory_limit"], "gpus": w["gpu_ids"] or _unnamed(w["gpus"])})
        for gpu in (w["gpu_ids"] or _unnamed(w["gpus"])):
            gpus.append({"gpu": gpu, "worker": w["name"], **usage})
    trials = [{"key": t["key"], "worker": t["worker"], "gpus": _gpus_of(record, t["worker"]),
               "start": _r(t["start"] - t0), "duration_s": _r(t["stop"] - t["start"]), "failed": t["failed"],
               **({"interrupted": True} if t.get("interrupted") else {}),
               **{k: t[k] for k in GPU_FIGURES if k in t}} for t in record["trials"]]
    return {"started": t0, "ended": record["ended"], "wall_s": _r(record["ended"] - t0),
            "gpu_figures": any(k in t for t in trials for k in GPU_FIGURES),
            "gpus": gpus, "workers": workers, "trials": trials, "flow_runs": record.get("flow_runs", []),
            "interrupted": record.get("interrupted", [])}


def summary(report: dict[str, Any]) -> list[str]:
    """Five lines: trials (a pruned one is not "done": it ended early); GPUs (or workers) allocated, busy,
    idle; memory; trial durations; GPU figures; and a sixth where the job's end interrupted trials: the work each
    lost (the time since its last checkpoint)."""
    trials, gpus, workers = report["trials"], report["gpus"], report["workers"]
    failed = sum(1 for t in trials if t["failed"])
    cut = sum(1 for t in trials if t.get("interrupted"))
    pruned = min(int((report.get("metrics") or {}).get("pruned") or 0), len(trials) - failed - cut)  # ended early
    lines = [f"{len(trials)} trials ({len(trials) - failed - cut - pruned} done, {failed} failed"
             f"{f', {pruned} pruned' if pruned else ''}{f', {cut} interrupted' if cut else ''})"
             f" on {len(workers)} workers"
             f"{f' with {len(gpus)} GPUs' if gpus else ''} in {report['wall_s']:.1f} s"]
    for label, rows in (("GPU", gpus), ("worker", workers)) if gpus else (("worker", workers),):
        allocated = sum(r["allocated_s"] for r in rows)
        busy = sum(r["busy_s"] for r in rows)
        gaps = [b - a for r in rows for a, b in r["gaps"]]
        share = f"{100 * busy / allocated:.0f} %" if allocated else "-"
        least = min(rows, key=lambda r: r["busy_s"] / r["allocated_s"] if r["allocated_s"] else 1, default=None)
        lines.append(f"{label}-seconds: {allocated:.1f} allocated, {busy:.1f} busy ({share}), "
                     f"{allocated - busy:.1f} idle in {len(gaps)} gaps"
                     + (f" (longest {max(gaps):.1f} s)" if gaps else "")
                     + (f"; least busy {_label(least)}"
                        f" {100 * least['busy_s'] / least['allocated_s']:.0f} %" if least and least["allocated_s"] else ""))
    if not gpus:
        lines.append("GPUs: none allocated")
    top = max(workers, key=lambda w: w["memory_peak"], default=None)
    peak, limit = (format_bytes(top[key], tenths=True) for key in ("memory_peak", "memory_limit")) if top else ("", "")
    lines.append(f"memory: peak {peak} of {limit} ({top['worker']})" if top and top["memory_limit"]
                 else "memory: no worker reported")
    durations = [t["duration_s"] for t in trials]
    if durations:
        longest = max(trials, key=lambda t: t["duration_s"])
        figures = [t for t in trials if "gpu_util_mean" in t]
        gpu = (f"; GPU utilisation mean {statistics.fmean(t['gpu_util_mean'] for t in figures):.0f} %, "
               f"peak {max(t['gpu_util_peak'] for t in figures):.0f} %, memory peak "
               f"{format_bytes(max(t['gpu_memory_peak'] for t in figures), tenths=True)}" if figures
               else "; GPU utilisation not read (no NVML/amdsmi, or no GPU)" if gpus else "")
        lines.append(f"trials: median {statistics.median(durations):.2f} s, longest {longest['duration_s']:.2f} s"
                     f" ({longest['key'][:40]}){gpu}")
    else:
        lines.append("trials: none ran")
    from hpc_garage.cluster.trial_metrics import lines as metrics_lines

    search = [f"search {text}"] if (text := search_text(report.get("search"))) else []
    return lines[:5] + _interrupted(report.get("interrupted") or []) + metrics_lines(report.get("metrics")) + search


def _interrupted(trials: list[dict[str, Any]]) -> list[str]:
    if not trials:
        return []
    stopped = [t for t in trials if t.get("why")]
    lost = ", ".join(f"{t['task']} {t['lost']:.0f} s" for t in trials)
    return [f"interrupted: {len(trials)} trials ({len(trials) - len(stopped)} continued in the next job"
            + (f", {len(stopped)} not continued: {stopped[0]['why']}" if stopped else "")
            + f"); work lost since the last checkpoint: {lost}"]


def load(view: Any, job_id: str) -> dict[str, Any]:
    """A job's report.json (`view`: schedulers.submission.JobView); a missing or unreadable one is one line."""
    import json

    from hpc_garage.core.errors import UserError
    from hpc_garage.rundir import REPORT_FILE, RunDir, since_submission
    from hpc_garage.schedulers.submission import run_dir_of

    run_dir = run_dir_of(view, REPORT_FILE)
    if run_dir is None:
        raise UserError(f"job {job_id} has no run directory here, so no report; pass --site if its site keeps "
                        "its runs elsewhere")
    rundir = RunDir(run_dir)
    path = rundir.report_file
    try:
        if not since_submission(path, rundir.submitted_at()):  # none yet, or an earlier job's (a recycled id)
            raise FileNotFoundError(path)
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"job {job_id} has no report yet ({path}): `hpc-garage run` writes it when the job's "
                        f"command ends; `hpc-garage status {job_id}` shows how far it is") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); the job's log ends with the same summary") from None
    if not isinstance(data, dict) or not {"trials", "workers", "gpus", "wall_s"} <= set(data):
        raise UserError(f"{path} is not an hpc-garage report; the job's log ends with its summary")
    if "metrics" not in data:  # written before the flow's last word on its trials, or by an older `run`
        with_metrics(data, rundir)
    return data


def with_metrics(report: dict[str, Any], rundir: Any) -> dict[str, Any]:
    """The report with "metrics" where trials reported (trials.json in `rundir`, a RunDir); never fails it."""
    from hpc_garage.cluster.trial_metrics import read_summary, section

    try:
        if (search := read_json(rundir.search_summary)) is not None:
            report["search"] = search  # hpc_garage.search's best trial, counts, GPU-hours against its budget
        summary = read_summary(rundir.metrics_summary)
        if summary is not None and (found := section(summary, by_task_run(report))) is not None:
            report["metrics"] = found
    except Exception as exc:  # noqa: BLE001 - a foreign trials.json: the report stands without it
        report["metrics_error"] = f"{type(exc).__name__}: {exc}"
    return report


def task_run_of(trial: dict[str, Any]) -> str | None:
    """A timeline trial's Prefect task run id (hex), from its Dask key: what trials.json calls a trial's `run`."""
    return m.group(1) if (m := TASK_RUN_ID.search(str(trial.get("key", "")))) else None


def by_task_run(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The report's Prefect trials by their task run id (task_run_of)."""
    return {run: t for t in report.get("trials", []) if (run := task_run_of(t)) is not None}


def trial_curves(view: Any, report: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Each reporting trial's points of the report's metric (`view`: the job's JobView), for `plot`."""
    from hpc_garage.cluster.trial_metrics import curves
    from hpc_garage.rundir import REPORT_FILE, RunDir
    from hpc_garage.schedulers.submission import run_dir_of

    run_dir = run_dir_of(view, REPORT_FILE)
    return curves(RunDir(run_dir), report["metrics"]) if run_dir is not None and report.get("metrics") else {}


def _label(row: dict[str, Any]) -> str:
    return f"GPU {row['gpu']} of {row['worker']}" if "gpu" in row else str(row["worker"])


def _gpus_of(record: dict[str, Any], worker: str) -> list[str]:
    for w in record["workers"]:
        if w["name"] == worker:
            return w["gpu_ids"] or _unnamed(w["gpus"])
    return []


def _unnamed(count: float) -> list[str]:
    """Labels for a worker's GPUs whose ids it did not report (no trial ran there, or no pinning variable)."""
    return [f"#{i}" for i in range(int(count))]


def _r(seconds: float) -> float:
    return round(seconds, 3)

