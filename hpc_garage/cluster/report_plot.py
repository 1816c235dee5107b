"""`hpc-garage report JOB --plot`: the report (cluster/report.py) as a PNG (matplotlib, the `plot` extra).

A per-GPU timeline of the trials; below it, where trials reported (`trial.report`), each trial's curve; and
where the run held an `hpc_garage.search` (report["search"], its search.json), the search's best value so far
against the GPU-hours its trials used, as they ended (`search_progress`: the points, a pure function of the
report). Plain Python: matplotlib is imported only when a plot is drawn.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_garage.cluster.report import task_run_of

__all__ = ["SearchPoint", "SearchProgress", "plot", "search_progress"]

SEARCH_HEIGHT = 4.0  # inches: the search's panel


@dataclass(frozen=True)
class SearchPoint:
    """One trial of the job as it ended: the GPU-hours this job's trials had used by then, its state ("done",
    "pruned", "failed", "interrupted"), its value (one that ran to the end: the last it reported of the search's
    metric; else None) and the best value so far (None until a trial that ran to the end had one)."""

    key: str
    gpu_hours: float
    state: str
    value: float | None
    best: float | None


@dataclass(frozen=True)
class SearchProgress:
    """What the search's panel draws: its metric and mode, one point per trial in the order they ended, the
    budget (GPU-hours, or None) and the study's best as search.json has it (all jobs')."""

    metric: str
    mode: str
    points: tuple[SearchPoint, ...]
    budget_gpu_hours: float | None
    study_best: float | None

    @property
    def best(self) -> float | None:
        return self.points[-1].best if self.points else None


def search_progress(report: dict[str, Any]) -> SearchProgress | None:
    """The search's best so far against GPU-hours, from the report alone (None where the run held no search).

    A trial's GPU-hours are its duration times the GPUs its worker held (1 where it held none, as the search
    counts them), summed in the order trials ended; its state and value come from what it reported
    (report["metrics"], matched by task run id); pruned, failed and interrupted trials never count as best."""
    search = report.get("search")
    if not isinstance(search, dict) or "told" not in search:  # as core/progress_text.search_text reads it
        return None
    metric = str(search.get("metric") or "value")
    metrics = report.get("metrics") or {}
    mode = search.get("mode")
    if mode not in ("min", "max"):  # a search.json without it: the trials' metric's mode, where the same metric
        mode = "max" if metrics.get("metric") == metric and metrics.get("mode") == "max" else "min"
    better = max if mode == "max" else min
    reported = {str(row.get("run")): row for row in metrics.get("trials", []) if row.get("run")}
    used, best, points = 0.0, None, []
    for trial in sorted(report["trials"], key=lambda t: t["start"] + t["duration_s"]):
        run = task_run_of(trial) or ""
        row = reported.get(run, {})
        used += trial["duration_s"] * max(len(trial.get("gpus") or ()), 1) / 3600
        state = ("failed" if trial["failed"] or row.get("state") == "failed"
                 else "interrupted" if trial.get("interrupted") or row.get("state") == "interrupted"
                 else "pruned" if row.get("state") == "pruned" else "done")
        value = (row.get("last") or {}).get(metric) if state == "done" else None
        value = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
        if value is not None:
            best = value if best is None else better(best, value)
        points.append(SearchPoint(str(trial.get("key", "")), used, state, value, best))
    budget, found = search.get("budget_gpu_hours"), search.get("best")
    study_best = found.get("value") if isinstance(found, dict) else None
    return SearchProgress(metric, mode, tuple(points), float(budget) if isinstance(budget, (int, float)) else None,
                          float(study_best) if isinstance(study_best, (int, float)) else None)


def plot(report: dict[str, Any], path: str | Path,
         curves: dict[str, list[tuple[float, float]]] | None = None) -> SearchProgress | None:
    """A timeline PNG: one row per GPU (per worker where there are none), a bar per trial, failed in red (and
    where trials reported, pruned in orange, the best in green); with `curves` (report.trial_curves), below it
    each reporting trial's metric by step: pruned ones dashed, the best drawn thick; where the run held a
    search, below that its best so far against GPU-hours. Returns what the search's panel drew (or None)."""
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
        run = task_run_of(trial)
        return ("tab:red" if trial["failed"] else "tab:green" if run is not None and run == best_run
                else "tab:orange" if states.get(run or "") == "pruned" else "tab:blue")

    rows = [(f"{g['worker']} GPU {g['gpu']}", g["worker"]) for g in report["gpus"]] or [(w["worker"], w["worker"]) for w in report["workers"]]
    timeline_height = 1 + 0.35 * len(rows)
    progress = search_progress(report)
    heights = [timeline_height] + ([4.5] if curves else []) + ([SEARCH_HEIGHT] if progress else [])
    if len(heights) > 1:
        fig, (ax, *panels) = plt.subplots(len(heights), 1, figsize=(11, sum(heights)),
                                          gridspec_kw={"height_ratios": heights})
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
        _curves(panels[0], metrics, curves)
    if progress:
        _search(panels[-1], progress)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return progress


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


def _search(ax: Any, progress: SearchProgress) -> None:
    """The best so far as a green step line; each trial that ran to the end a blue dot at its value; pruned (an
    orange x), failed (a red x) and interrupted (a grey +) on the line where they ended; the budget a dashed
    red line."""
    from matplotlib.lines import Line2D

    points, metric = progress.points, progress.metric
    scored = [p for p in points if p.best is not None]
    handles: list[Any] = []
    if scored:
        ax.plot([p.gpu_hours for p in scored], [p.best for p in scored], drawstyle="steps-post", color="tab:green",
                linewidth=2.2, zorder=4)
        handles.append(Line2D([], [], color="tab:green", linewidth=2.2, label="best so far"))
    done = [p for p in points if p.value is not None]
    if done:
        ax.plot([p.gpu_hours for p in done], [p.value for p in done], "o", color="tab:blue", markersize=4,
                alpha=0.6, zorder=3)
        handles.append(Line2D([], [], color="tab:blue", marker="o", linestyle="",
                              label=f"ran to the end ({len(done)})"))
    first = scored[0].best if scored else None
    marks = (("pruned", "tab:orange", "x"), ("failed", "tab:red", "x"), ("interrupted", "tab:gray", "+"),
             ("done", "tab:gray", "."))  # done without a value: it did not report the metric
    for state, colour, marker in marks:
        mine = [p for p in points if p.state == state and p.value is None]
        if not mine:
            continue
        xs = [p.gpu_hours for p in mine]
        if first is None:  # no value at all: along the panel's middle
            ax.plot(xs, [0.5] * len(xs), marker, color=colour, markersize=7, transform=ax.get_xaxis_transform())
        else:
            ax.plot(xs, [first if p.best is None else p.best for p in mine], marker, color=colour, markersize=7,
                    zorder=5)
        word = f"no {metric} reported" if state == "done" else state
        handles.append(Line2D([], [], color=colour, marker=marker, linestyle="", label=f"{word} ({len(mine)})"))
    used = points[-1].gpu_hours if points else 0.0
    if progress.budget_gpu_hours is not None:
        ax.axvline(progress.budget_gpu_hours, color="tab:red", linestyle="--", linewidth=1.2)
        handles.append(Line2D([], [], color="tab:red", linestyle="--",
                              label=f"budget {progress.budget_gpu_hours:.4g} GPUh"))
    ax.set_xlim(0, max(used, progress.budget_gpu_hours or 0.0) * 1.03 or 1.0)
    values = [p.value for p in done if p.value is not None]
    if values and min(values) > 0 and max(values) / min(values) > 100:
        ax.set_yscale("log")
    ax.set_xlabel("GPU-hours used by the job's trials, as they ended")
    better = "higher" if progress.mode == "max" else "lower"
    if progress.best is None:
        ax.set_yticks([])  # no value to read off: the trials along the GPU-hours only
        title = f"search: no trial of this job ran to the end and reported {metric}"
    else:
        at = next(p.gpu_hours for p in points if p.best == progress.best)
        title = f"search: best {metric} {progress.best:.4g} after {at:.3g} GPUh ({better} is better)"
    if progress.study_best is not None and progress.study_best != progress.best:
        title += f"; the study's best (all jobs) {progress.study_best:.4g}"
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if handles:
        ax.legend(handles=handles, loc="best", fontsize="small", framealpha=0.9)
