"""The efficiency report of a run: how well the allocation was used, per GPU, per worker and per trial.

`build(record)` turns what `progress.RunProgress.record()` kept (workers with the span they were up, trials
with their worker and the scheduler's compute start/stop, the samplers' GPU figures) into `report.json`:
- per GPU and per worker: allocated seconds (the worker's span: registration to the end of the run), busy
  seconds (the union of its trials' compute spans within it), idle seconds and the idle gaps between (their
  count, and the GAPS_KEPT longest), and trials; a GPU is busy while its worker runs a trial;
- per worker: peak memory (as its heartbeats reported it) against its limit;
- per trial: worker, GPUs, duration, failed, and where the worker could read its GPUs (NVML, amdsmi),
  mean and peak utilisation and peak device memory.
`summary(report)` is the five lines `run` prints at the end and `hpc-garage report JOB` prints again, and where
trials reported (`trial.report`) what they did: the best trial, pruned ones, what pruning saved (report.json's
"metrics", cluster/trial_metrics.py); `report_plot.plot` draws it (`trial_curves`: the trials' points for it).
Plain Python: the CLI imports this module without Dask.
"""

from __future__ import annotations

import heapq
import json
import re
import statistics
from array import array
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

from hpc_garage.core.progress_text import search_text
from hpc_garage.core.units import format_bytes
from hpc_garage.files import read_json

__all__ = ["GAPS_KEPT", "TASK_RUN_ID", "Trials", "build", "busy_and_gaps", "by_task_run", "load", "summary",
           "task_run_of", "trial_curves", "with_metrics", "write"]

TASK_RUN_ID = re.compile(r"-([0-9a-f]{32})$")  # a Prefect trial's Dask key: `<task name>-<task run id hex>`
GPU_FIGURES = ("gpu_util_mean", "gpu_util_peak", "gpu_memory_peak")
GAPS_KEPT = 1000  # idle gaps report.json keeps per worker and GPU, the longest (gap_count: all of them)

Span = tuple[float, float]


def busy_and_gaps(spans: list[Span], window: Span) -> tuple[float, list[Span]]:
    """Busy seconds (the union of `spans` clipped to `window`) and the idle gaps of the window around them."""
    start, end = window
    gaps: list[Span] = []
    busy = _union(sorted((max(a, start), min(b, end)) for a, b in spans), window, gaps.append)
    return busy, gaps


def _union(clipped: Iterable[Span], window: Span, gap: Callable[[Span], object]) -> float:
    """Busy seconds of `clipped` (spans within `window`, by start), each idle gap around them handed to `gap`."""
    busy, at = 0.0, window[0]
    for a, b in clipped:
        if b <= a or b <= at:
            continue
        if a > at:
            gap((at, a))
        busy += b - max(a, at)
        at = b
    if window[1] > at:
        gap((at, window[1]))
    return busy


class _Gaps:
    """A worker's idle gaps as they come: their count, their seconds, the `kept` longest (a heap)."""

    def __init__(self, kept: int) -> None:
        self.count, self.seconds, self.kept = 0, 0.0, kept
        self._longest: list[tuple[float, float, float]] = []

    def __call__(self, gap: Span) -> None:
        self.count += 1
        self.seconds += gap[1] - gap[0]
        item = (gap[1] - gap[0], gap[0], gap[1])
        if len(self._longest) < self.kept:
            heapq.heappush(self._longest, item)
        elif item > self._longest[0]:
            heapq.heapreplace(self._longest, item)

    def longest(self) -> list[Span]:
        """The kept gaps, in time order."""
        return sorted((a, b) for _, a, b in self._longest)


def _usage(starts: array[float], stops: array[float], window: Span) -> tuple[float, _Gaps, int]:
    """Busy seconds of the spans (starts[i], stops[i]) that overlap `window`, its idle gaps, how many overlap:
    sorted by index, one span's tuple at a time (a worker of 150,000 trials holds no list of them)."""
    start, end = window
    order = sorted((i for i in range(len(starts)) if stops[i] > start and starts[i] < end), key=starts.__getitem__)
    gaps = _Gaps(GAPS_KEPT)
    busy = _union(((max(starts[i], start), min(stops[i], end)) for i in order), window, gaps)
    return busy, gaps, len(order)


class Trials:
    """A run's trials, walked afresh each time they are read (at a run's end, from the scheduler's record of them,
    cluster/finished_trials.py): the report of 300,000 trials is never 300,000 dicts in memory. `len` reads
    nothing. report.json holds them as a list (`write`)."""

    def __init__(self, walk: Callable[[], Iterator[dict[str, Any]]], count: int) -> None:
        self._walk, self._count = walk, count

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self._walk()

    def __len__(self) -> int:
        return self._count


def build(record: dict[str, Any]) -> dict[str, Any]:
    """The report from a progress record (times in epoch seconds; gaps relative to the run's start). The record's
    trials are walked twice at most, each trial's span kept only as two floats: a list in, a list out; `Trials`
    in, `Trials` out."""
    t0 = record["started"]
    source = record["trials"]
    gpus_of: dict[str, list[str]] = {}
    for w in record["workers"]:
        gpus_of.setdefault(w["name"], w["gpu_ids"] or _unnamed(w["gpus"]))  # the first record under a name
    spans: dict[str, tuple[array[float], array[float]]] = defaultdict(lambda: (array("d"), array("d")))
    count, figures = 0, False
    for t in source:
        starts, stops = spans[t["worker"]]
        starts.append(t["start"])
        stops.append(t["stop"])
        count += 1
        figures = figures or any(k in t for k in GPU_FIGURES)
    workers, gpus = [], []
    for w in record["workers"]:
        window = (w["joined"], w["left"])
        starts, stops = spans.get(w["name"], (array("d"), array("d")))
        busy, gaps, mine = _usage(starts, stops, window)  # a worker restarted under its name is a new record
        usage = {"allocated_s": _r(window[1] - window[0]), "busy_s": _r(busy), "idle_s": _r(gaps.seconds),
                 "gaps": [[_r(a - t0), _r(b - t0)] for a, b in gaps.longest()], "gap_count": gaps.count,
                 "trials": mine}
        workers.append({"worker": w["name"], **usage, "memory_peak": w["memory_peak"],
                        "memory_limit": w["memory_limit"], "gpus": w["gpu_ids"] or _unnamed(w["gpus"])})
        for gpu in (w["gpu_ids"] or _unnamed(w["gpus"])):
            gpus.append({"gpu": gpu, "worker": w["name"], **usage})

    def rows() -> Iterator[dict[str, Any]]:
        for t in source:
            yield {"key": t["key"], "worker": t["worker"], "gpus": gpus_of.get(t["worker"], []),
                   "start": _r(t["start"] - t0), "duration_s": _r(t["stop"] - t["start"]), "failed": t["failed"],
                   **({"interrupted": True} if t.get("interrupted") else {}),
                   **{k: t[k] for k in GPU_FIGURES if k in t}}

    trials: list[dict[str, Any]] | Trials = list(rows()) if isinstance(source, list) else Trials(rows, count)
    return {"started": t0, "ended": record["ended"], "wall_s": _r(record["ended"] - t0),
            "gpu_figures": figures, "gpus": gpus, "workers": workers, "trials": trials,
            "flow_runs": record.get("flow_runs", []), "interrupted": record.get("interrupted", [])}


def write(path: Any, report: dict[str, Any]) -> None:
    """report.json, a private file written atomically, its trials one at a time (files.write_private)."""
    from hpc_garage.files import write_private

    def pieces() -> Iterator[str]:
        yield json.dumps({k: v for k, v in report.items() if k != "trials"})[:-1] + ', "trials": ['
        for i, trial in enumerate(report["trials"]):
            yield (", " if i else "") + json.dumps(trial)
        yield "]}"

    write_private(path, pieces())


def summary(report: dict[str, Any]) -> list[str]:
    """Five lines: trials (a pruned one is not "done": it ended early); GPUs (or workers) allocated, busy,
    idle; memory; trial durations; GPU figures; and a sixth where the job's end interrupted trials: the work each
    lost (the time since its last checkpoint)."""
    gpus, workers = report["gpus"], report["workers"]
    seen = _TrialFigures(report["trials"])  # one walk over the trials
    failed, cut, count = seen.failed, seen.cut, seen.count
    pruned = min(int((report.get("metrics") or {}).get("pruned") or 0), count - failed - cut)  # ended early
    lines = [f"{count} trials ({count - failed - cut - pruned} done, {failed} failed"
             f"{f', {pruned} pruned' if pruned else ''}{f', {cut} interrupted' if cut else ''})"
             f" on {len(workers)} workers"
             f"{f' with {len(gpus)} GPUs' if gpus else ''} in {report['wall_s']:.1f} s"]
    for label, rows in (("GPU", gpus), ("worker", workers)) if gpus else (("worker", workers),):
        allocated = sum(r["allocated_s"] for r in rows)
        busy = sum(r["busy_s"] for r in rows)
        gaps = [b - a for r in rows for a, b in r["gaps"]]  # the longest of each (report.json: GAPS_KEPT)
        gap_count = sum(r.get("gap_count", len(r["gaps"])) for r in rows)
        share = f"{100 * busy / allocated:.0f} %" if allocated else "-"
        least = min(rows, key=lambda r: r["busy_s"] / r["allocated_s"] if r["allocated_s"] else 1, default=None)
        lines.append(f"{label}-seconds: {allocated:.1f} allocated, {busy:.1f} busy ({share}), "
                     f"{allocated - busy:.1f} idle in {gap_count} gaps"
                     + (f" (longest {max(gaps):.1f} s)" if gaps else "")
                     + (f"; least busy {_label(least)}"
                        f" {100 * least['busy_s'] / least['allocated_s']:.0f} %" if least and least["allocated_s"] else ""))
    if not gpus:
        lines.append("GPUs: none allocated")
    top = max(workers, key=lambda w: w["memory_peak"], default=None)
    peak, limit = (format_bytes(top[key], tenths=True) for key in ("memory_peak", "memory_limit")) if top else ("", "")
    lines.append(f"memory: peak {peak} of {limit} ({top['worker']})" if top and top["memory_limit"]
                 else "memory: no worker reported")
    if seen.durations:
        gpu = (f"; GPU utilisation mean {statistics.fmean(seen.util_means):.0f} %, "
               f"peak {seen.util_peak:.0f} %, memory peak "
               f"{format_bytes(seen.memory_peak, tenths=True)}" if seen.util_means
               else "; GPU utilisation not read (no NVML/amdsmi, or no GPU)" if gpus else "")
        lines.append(f"trials: median {statistics.median(seen.durations):.2f} s, longest {seen.longest[1]:.2f} s"
                     f" ({seen.longest[0][:40]}){gpu}")
    else:
        lines.append("trials: none ran")
    from hpc_garage.cluster.trial_metrics import lines as metrics_lines

    search = [f"search {text}"] if (text := search_text(report.get("search"))) else []
    return lines[:5] + _interrupted(report.get("interrupted") or []) + metrics_lines(report.get("metrics")) + search


class _TrialFigures:
    """What summary() says of the trials, from one walk over them, a float or two kept per trial."""

    def __init__(self, trials: Iterable[dict[str, Any]]) -> None:
        self.count = self.failed = self.cut = 0
        self.durations: array[float] = array("d")
        self.util_means: array[float] = array("d")
        self.util_peak = self.memory_peak = 0.0
        self.longest = ("", float("-inf"))
        for t in trials:
            self.count += 1
            self.failed += bool(t["failed"])
            self.cut += bool(t.get("interrupted"))
            self.durations.append(t["duration_s"])
            if t["duration_s"] > self.longest[1]:
                self.longest = (t["key"], t["duration_s"])
            if "gpu_util_mean" in t:
                self.util_means.append(t["gpu_util_mean"])
                self.util_peak = max(self.util_peak, t["gpu_util_peak"])
                self.memory_peak = max(self.memory_peak, t["gpu_memory_peak"])


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
        reported = {str(t.get("run")) for t in summary["trials"].values()} if summary is not None else set()
        if summary is not None and (found := section(summary, by_task_run(report, reported))) is not None:
            report["metrics"] = found
    except Exception as exc:  # noqa: BLE001 - a foreign trials.json: the report stands without it
        report["metrics_error"] = f"{type(exc).__name__}: {exc}"
    return report


def task_run_of(trial: dict[str, Any]) -> str | None:
    """A timeline trial's Prefect task run id (hex), from its Dask key: what trials.json calls a trial's `run`."""
    return m.group(1) if (m := TASK_RUN_ID.search(str(trial.get("key", "")))) else None


def by_task_run(report: dict[str, Any], only: Collection[str] | None = None) -> dict[str, dict[str, Any]]:
    """The report's Prefect trials by their task run id (task_run_of); those of `only` where given."""
    return {run: t for t in report.get("trials", [])
            if (run := task_run_of(t)) is not None and (only is None or run in only)}


def trial_curves(view: Any, report: dict[str, Any]) -> dict[str, list[tuple[float, float]]]:
    """Each reporting trial's points of the report's metric (`view`: the job's JobView), for `plot`."""
    from hpc_garage.cluster.trial_metrics import curves
    from hpc_garage.rundir import REPORT_FILE, RunDir
    from hpc_garage.schedulers.submission import run_dir_of

    run_dir = run_dir_of(view, REPORT_FILE)
    return curves(RunDir(run_dir), report["metrics"]) if run_dir is not None and report.get("metrics") else {}


def _label(row: dict[str, Any]) -> str:
    return f"GPU {row['gpu']} of {row['worker']}" if "gpu" in row else str(row["worker"])


def _unnamed(count: float) -> list[str]:
    """Labels for a worker's GPUs whose ids it did not report (no trial ran there, or no pinning variable)."""
    return [f"#{i}" for i in range(int(count))]


def _r(seconds: float) -> float:
    return round(seconds, 3)

