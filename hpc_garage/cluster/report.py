"""The efficiency report of a run: how well the allocation was used, per GPU, per worker and per trial.

`build(record)` turns what `progress.RunProgress.record()` kept (workers with the span they were up, trials
with their worker and the scheduler's compute start/stop, the samplers' GPU figures) into `report.json`:
- per GPU and per worker: allocated seconds (the worker's span: registration to the end of the run), busy
  seconds (the union of its trials' compute spans within it), the idle gaps between (they add up to
  allocated minus busy), and trials; a GPU is busy while its worker runs a trial;
- per worker: peak memory (as its heartbeats reported it) against its limit;
- per trial: worker, GPUs, duration, failed, and where the worker could read its GPUs (NVML, amdsmi),
  mean and peak utilisation and peak device memory.
`summary(report)` is the five lines `run` prints at the end and `hpc-garage report JOB` prints again;
`plot(report, path)` draws a per-GPU timeline (matplotlib, the `plot` extra). Plain Python: the CLI imports
this module without Dask.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

__all__ = ["build", "busy_and_gaps", "load", "plot", "summary"]

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
    """Five lines: trials; GPUs (or workers) allocated, busy, idle; memory; trial durations; GPU figures; and
    a sixth where the job's end interrupted trials: the work each lost (the time since its last checkpoint)."""
    trials, gpus, workers = report["trials"], report["gpus"], report["workers"]
    failed = sum(1 for t in trials if t["failed"])
    cut = sum(1 for t in trials if t.get("interrupted"))
    lines = [f"{len(trials)} trials ({len(trials) - failed - cut} done, {failed} failed"
             f"{f', {cut} interrupted' if cut else ''}) on {len(workers)} workers"
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
    lines.append(f"memory: peak {_size(top['memory_peak'])} of {_size(top['memory_limit'])} ({top['worker']})"
                 if top and top["memory_limit"] else "memory: no worker reported")
    durations = [t["duration_s"] for t in trials]
    if durations:
        longest = max(trials, key=lambda t: t["duration_s"])
        figures = [t for t in trials if "gpu_util_mean" in t]
        gpu = (f"; GPU utilisation mean {statistics.fmean(t['gpu_util_mean'] for t in figures):.0f} %, "
               f"peak {max(t['gpu_util_peak'] for t in figures):.0f} %, memory peak "
               f"{_size(max(t['gpu_memory_peak'] for t in figures))}" if figures
               else "; GPU utilisation not read (no NVML/amdsmi, or no GPU)" if gpus else "")
        lines.append(f"trials: median {statistics.median(durations):.2f} s, longest {longest['duration_s']:.2f} s"
                     f" ({longest['key'][:40]}){gpu}")
    else:
        lines.append("trials: none ran")
    return lines[:5] + _interrupted(report.get("interrupted") or [])


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
    return data


def plot(report: dict[str, Any], path: str | Path) -> None:
    """A timeline PNG: one row per GPU (per worker where there are none), a bar per trial, failed in red."""
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

    rows = [(f"{g['worker']} GPU {g['gpu']}", g["worker"]) for g in report["gpus"]] or [(w["worker"], w["worker"]) for w in report["workers"]]
    fig, ax = plt.subplots(figsize=(10, 1 + 0.35 * len(rows)))
    for y, (label, worker) in enumerate(rows):
        spans = [(t["start"], t["duration_s"]) for t in report["trials"] if t["worker"] == worker]
        colors = ["tab:red" if t["failed"] else "tab:blue" for t in report["trials"] if t["worker"] == worker]
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=colors)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel("seconds since the run started")
    ax.set_xlim(0, report["wall_s"])
    ax.invert_yaxis()
    ax.set_title("trials per GPU (red: failed)" if report["gpus"] else "trials per worker (red: failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
