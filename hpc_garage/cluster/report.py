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
"metrics", cluster/trial_metrics.py); `plot(report, path, curves)` draws a per-GPU timeline and below it each
reporting trial's curve (matplotlib, the `plot` extra). Plain Python: the CLI imports this module without Dask.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from hpc_garage.core.progress_text import search_text
from hpc_garage.core.units import format_bytes
from hpc_garage.files import read_json

__all__ = ["TASK_RUN_ID", "build", "busy_and_gaps", "by_task_run", "load", "plot", "summary", "trial_curves",
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
    from hpc_garage.rundir import REPORT_FILE, RunDir
    from hpc_garage.schedulers.submission import run_dir_of

    run_dir = run_dir_of(view, REPORT_FILE)
    if run_dir is None:
        raise UserError(f"job {job_id} has no run directory here, so no report; pass --site if its site keeps "
                        "its runs elsewhere")
    path = RunDir(run_dir).report_file
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"job {job_id} has no report yet ({path}): `hpc-garage run` writes it when the job's "
                        f"command ends; `hpc-garage status {job_id}` shows how far it is") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path} cannot be read ({exc}); the job's log ends with the same summary") from None
    if not isinstance(data, dict) or not {"trials", "workers", "gpus", "wall_s"} <= set(data):
        raise UserError(f"{path} is not an hpc-garage report; the job's log ends with its summary")
    if "metrics" not in data:  # written before the flow's last word on its trials, or by an older `run`
        with_metrics(data, RunDir(run_dir))
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


def by_task_run(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The report's Prefect trials by their task run id (hex): what trials.json calls a trial's `run`."""
    return {m.group(1): t for t in report.get("trials", []) if (m := TASK_RUN_ID.search(str(t.get("key", ""))))}


def trial_curves(view: Any, report: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Each reporting trial's points of the report's metric (`view`: the job's JobView), for `plot`."""
    from hpc_garage.cluster.trial_metrics import curves
    from hpc_garage.rundir import REPORT_FILE, RunDir
    from hpc_garage.schedulers.submission import run_dir_of

    run_dir = run_dir_of(view, REPORT_FILE)
    return curves(RunDir(run_dir), report["metrics"]) if run_dir is not None and report.get("metrics") else {}


def plot(report: dict[str, Any], path: str | Path, curves: dict[str, list[tuple[float, float]]] | None = None) -> None:
    """A timeline PNG: one row per GPU (per worker where there are none), a bar per trial, failed in red (and
    where trials reported, pruned in orange, the best in green); with `curves` (trial_curves), below it each
    reporting trial's metric by step: pruned ones dashed, the best drawn thick."""
    import os

    from hpc_garage.core.errors import UserError

    try:
        import matplotlib
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'hpc-garage[plot]'") from None
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise UserError(f"--plot {path}: directory {os.path.dirname(os.path.abspath(path))} does not exist; create it first")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = report.get("metrics") or {}
    states = {str(t.get("run")): t["state"] for t in metrics.get("trials", [])}
    best = (metrics.get("best") or {}).get("trial")
    best_run = next((str(t.get("run")) for t in metrics.get("trials", []) if t["trial"] == best), None)

    def color(trial: dict[str, Any]) -> str:
        run = m.group(1) if (m := TASK_RUN_ID.search(trial["key"])) else None
        return ("tab:red" if trial["failed"] else "tab:green" if run is not None and run == best_run
                else "tab:orange" if states.get(run or "") == "pruned" else "tab:blue")

    rows = [(f"{g['worker']} GPU {g['gpu']}", g["worker"]) for g in report["gpus"]] or [(w["worker"], w["worker"]) for w in report["workers"]]
    timeline_height = 1 + 0.35 * len(rows)
    if curves:
        fig, (ax, panel) = plt.subplots(2, 1, figsize=(11, timeline_height + 4.5),
                                        gridspec_kw={"height_ratios": [timeline_height, 4.5]})
    else:
        fig, ax = plt.subplots(figsize=(10, timeline_height))
    for y, (label, worker) in enumerate(rows):
        mine = [t for t in report["trials"] if t["worker"] == worker]
        ax.broken_barh([(t["start"], t["duration_s"]) for t in mine], (y - 0.4, 0.8),
                       facecolors=[color(t) for t in mine], edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel("seconds since the run started")
    ax.set_xlim(0, report["wall_s"])
    ax.invert_yaxis()
    what = "trials per GPU" if report["gpus"] else "trials per worker"
    shown = {color(t) for t in report["trials"]}
    key = [f"{name}: {word}" for name, word in (("blue", "ran"), ("orange", "pruned"), ("green", "best"),
                                                 ("red", "failed")) if f"tab:{name}" in shown]
    ax.set_title(f"{what} ({', '.join(key)})" if metrics else f"{what} (red: failed)")
    if curves:
        _curves(panel, metrics, curves)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _curves(ax: Any, metrics: dict[str, Any], curves: dict[str, list[tuple[float, float]]]) -> None:
    """Each reporting trial's metric by step: ran to the end solid blue, pruned dashed orange ending in an x,
    unfinished dotted grey, the best thick green with its best point marked."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    from hpc_garage.core.progress_text import trial_label

    rows = {t["trial"]: t for t in metrics.get("trials", [])}
    best = metrics.get("best") or {}
    look = {"done": ("tab:blue", "-"), "pruned": ("tab:orange", "--"), "running": ("tab:gray", ":")}
    counts: dict[str, int] = defaultdict(int)
    for trial, points in curves.items():
        if trial == best.get("trial"):
            continue
        state = rows.get(trial, {}).get("state", "running")
        counts[state] += 1
        colour, style = look.get(state, look["running"])
        steps, values = zip(*points)
        ax.plot(steps, values, color=colour, linestyle=style, linewidth=1.1, alpha=0.65)
        if state == "pruned":
            ax.plot(steps[-1], values[-1], marker="x", color=colour, markersize=5, alpha=0.8)
    handles = [Line2D([], [], color=look[s][0], linestyle=look[s][1], label=f"{label} ({counts[s]})")
               for s, label in (("done", "ran to the end"), ("pruned", "pruned"), ("running", "did not end"))
               if counts[s]]
    metric = metrics.get("metric") or best.get("metric") or "value"
    if (points := curves.get(best.get("trial", ""))) is not None:
        steps, values = zip(*points)
        name = trial_label(best["trial"], best.get("task"))
        ax.plot(steps, values, color="tab:green", linewidth=2.6, zorder=5)
        if best.get("step") is not None:
            ax.plot(best["step"], best["value"], marker="o", color="tab:green", markersize=7, zorder=6)
        handles.insert(0, Line2D([], [], color="tab:green", linewidth=2.6,
                                 label=f"best: {name}, {metric} {best['value']:.4g}"
                                       + (f" at step {best['step']}" if best.get("step") is not None else "")))
    values = [v for points in curves.values() for _, v in points]
    if values and min(values) > 0 and max(values) / min(values) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_ylabel(metric)
    better = "higher" if metrics.get("mode") == "max" else "lower"
    ax.set_title(f"{metric} per trial ({better} is better"
                 + (f"; pruner {metrics['pruner']}" if metrics.get("pruner") else "") + ")")
    ax.grid(True, alpha=0.3)
    ax.legend(handles=handles, loc="best", fontsize="small", framealpha=0.9)


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

