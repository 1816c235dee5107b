"""Sweeps on disk: `<results root>/<sweep>/sweep.json` (what the sweep is, its epochs and their jobs) and
`<results root>/<sweep>/<epoch>/`, where Prefect persists the epoch's finished trials.

The results root is the site's `results_directory` (default `<run root>/sweeps`), on storage every node
shares: trials finish on compute nodes, and a later job (a resume, a follow-up, a requeue) reads them back.
sweep.json is changed under a lock, since a follow-up job and a `resume` may write it at the same time.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.sweep import SOURCE_CHANGES, TRIALS_DIR, SweepKey, check_name, derived_name
from hpc_garage.files import expand_path, locked, write_private

if TYPE_CHECKING:
    from hpc_garage.core.site import Site

RECORD = "sweep.json"


def results_root(results_directory: str | None, run_directory: str) -> Path:
    """Where a site keeps its sweeps' results, as a path here."""
    if results_directory:
        return expand_path(results_directory)
    return expand_path(run_directory) / "sweeps"


def check_results_root(root: Path, *, given: bool, where: str) -> Path:
    """A results root the site names exists and this user can write in it; else one line. The default one
    may be missing: the first sweep written makes it. Creates nothing."""
    if not root.exists():
        if given:
            raise UserError(f"{where}: {root} does not exist; create it on storage every node shares, or fix the key")
        return root
    if not root.is_dir():
        raise UserError(f"{where}: {root} is not a directory; point it at a directory every node shares")
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserError(f"{where}: {root} is not writable by you; choose a directory you can write")
    return root


def results_key(site: Site) -> str:
    """Where a results directory came from, for error lines: the site file and its key."""
    return f"{site.path or 'site ' + site.name}: results_directory"


def sweep_of(site: Site, name: str | None, script: str, args: Sequence[str], cwd: str,
             flag: str = "--sweep") -> SweepBook:
    """The sweep `name` (checked), or by default the one named after the site, the script and its arguments,
    in the site's results root (checked); `submit` and `run` find the same sweep for the same script."""
    name = check_name(name, flag) if name is not None else derived_name(site.name, script, args, cwd)
    root = results_root(site.results_directory, site.run_directory)
    return SweepBook(check_results_root(root, given=bool(site.results_directory), where=results_key(site)), name)


@dataclass(frozen=True)
class SweepBook:
    """One sweep's directory."""

    root: Path
    name: str

    @property
    def path(self) -> Path:
        return self.root / self.name

    def results(self, epoch: int) -> Path:
        """Prefect's result storage for one epoch."""
        return self.path / str(epoch)

    def read(self) -> dict[str, Any] | None:
        try:
            data = json.loads((self.path / RECORD).read_text())
        except (OSError, json.JSONDecodeError):
            return None
        return data if isinstance(data, dict) and data.get("name") == self.name else None

    def update(self, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Change sweep.json under the sweep's lock (created with the directory if need be)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path.mkdir(mode=0o700, exist_ok=True)
        with locked(self.path / ".lock"):
            data = self.read() or {"name": self.name, "epochs": {}}
            change(data)
            write_private(self.path / RECORD, json.dumps(data, indent=1))
        return data


def latest_epoch(record: dict[str, Any] | None) -> int:
    return max((int(e) for e in (record or {}).get("epochs", {})), default=0)


def epoch_of_job(record: dict[str, Any] | None, job_id: str) -> int | None:
    """The epoch a job already belongs to (a requeued job restarts with its id)."""
    for epoch, entry in (record or {}).get("epochs", {}).items():
        if any(j.get("job_id") == job_id for j in entry.get("jobs", [])):
            return int(epoch)
    return None


def next_epoch(book: SweepBook, resume: bool, where: str) -> int:
    """The epoch a new submission or run joins: the latest to resume it, else a fresh one."""
    latest = latest_epoch(book.read())
    if resume and latest == 0:
        raise UserError(f"{where}: sweep {book.name!r} has not run yet, so there is nothing to resume; "
                        "drop --resume to start it")
    return latest if resume else latest + 1


def add_job(book: SweepBook, key: SweepKey, job_id: str, how: str, identity: dict[str, Any]) -> dict[str, Any]:
    """Record that `job_id` works on this epoch of the sweep (`how`: submit, run, resume, follow-up, requeue)."""

    def change(data: dict[str, Any]) -> None:
        data.setdefault("identity", identity)
        entry = data.setdefault("epochs", {}).setdefault(str(key.epoch), {"started": time.time(), "jobs": []})
        if not any(j.get("job_id") == job_id for j in entry["jobs"]):
            entry["jobs"].append({"job_id": job_id, "how": how, "at": time.time()})

    return book.update(change)


def jobs_of(record: dict[str, Any], epoch: int | None = None) -> list[dict[str, Any]]:
    """The jobs of one epoch (default: the latest), in the order they joined."""
    epoch = latest_epoch(record) if epoch is None else epoch
    return list(record.get("epochs", {}).get(str(epoch), {}).get("jobs", []))


def summary(book: SweepBook, epoch: int | None = None) -> dict[str, Any] | None:
    """What `status` shows of a sweep: its epoch, the epoch's jobs (and how each joined), how many results
    the epoch keeps (finished trials, read back by any later job of the epoch), and which trials ran again
    because their task's source changed."""
    record = book.read()
    if record is None:
        return None
    epoch = latest_epoch(record) if epoch is None else epoch
    results = book.results(epoch)
    kept = _files_in(results)
    return {"name": book.name, "epoch": epoch, "jobs": jobs_of(record, epoch), "results": kept,
            "source_changed": source_changes(results), "interrupted": interruptions(results),
            "directory": str(results)}


def _files_in(results: Path) -> int:
    """The results a directory keeps (its files but hidden ones): read from the directory's entries, with no
    stat per file, so that `status` stays fast at 100,000 results."""
    try:
        with os.scandir(results) as entries:
            return sum(1 for e in entries if not e.name.startswith(".") and e.is_file())
    except OSError:
        return 0


def interruptions(results: Path) -> dict[str, Any]:
    """The epoch's trials that a job's end interrupted (cluster/wind_down.py records each, by its result key):
    how many wait to be continued now (no result yet), how many checkpointed and were continued across jobs,
    the work the interruptions lost (seconds since each one's last checkpoint), and those not continued any
    more, with why."""
    records = []
    for file in sorted((results / TRIALS_DIR).glob("*.json")) if (results / TRIALS_DIR).is_dir() else []:
        try:
            records.append(json.loads(file.read_text()))
        except (OSError, ValueError):
            continue
    lost = [float(i.get("lost", 0)) for r in records for i in r.get("interruptions", [])]
    unfinished = [r for r in records if not (results / str(r.get("trial"))).is_file()]
    return {"trials": len(records), "interruptions": len(lost),
            "interrupted": sum(1 for r in unfinished if "gave_up" not in r),
            "continued": sum(1 for r in records if r.get("checkpointed")),
            "lost": round(sum(lost), 1), "lost_max": round(max(lost, default=0.0), 1),
            "stopped": [{"task": r.get("task"), "trial": r.get("trial"), "why": r["gave_up"]}
                        for r in unfinished if "gave_up" in r]}


def source_changes(results: Path) -> dict[str, int]:
    """Per task name, the trials of this epoch that ran again because the task's source changed
    (prefect/sweep_cache.py notes them)."""
    trials: dict[str, set[str]] = {}
    try:
        lines = (results / SOURCE_CHANGES).read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        try:
            entry = json.loads(line)
            trials.setdefault(str(entry["task"]), set()).add(str(entry["trial"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a job killed mid-write
    return {task: len(ids) for task, ids in sorted(trials.items())}


def across_jobs(kept: int, jobs: Sequence[tuple[dict[str, Any] | None, bool]]) -> dict[str, int]:
    """A sweep's trials across the jobs of its epoch, from each job's progress (oldest first; `True`: the
    job is still running). Done: the finished trials the epoch keeps, or the most one job saw done (a later
    job reads earlier trials back, so it counts them too). Running and failed: the latest job that reported
    (a trial that failed in one job runs again in the next). To go: the most trials any job knew of, less
    done, running and failed (a job stopped at its walltime forgets the trials it never started)."""
    reported = [(progress, live) for progress, live in jobs if progress]
    latest, live = reported[-1] if reported else ({}, False)
    done = max([kept, *(int(p.get("done", 0)) for p, _ in reported)])
    running = int(latest.get("running", 0)) if live else 0
    total = max([done, *(int(p.get("total", sum(int(p.get(k, 0)) for k in ("done", "running", "failed", "waiting"))))
                         for p, _ in reported)])
    failed = int(latest.get("failed", 0))
    return {"done": done, "running": running, "failed": failed, "to_go": max(total - done - running - failed, 0),
            "jobs": len(jobs)}


def find(name_or_job: str, roots: list[Path]) -> SweepBook:
    """A sweep by its name, or by the id of one of its jobs (the newest such sweep)."""
    if "/" not in name_or_job and ".." not in name_or_job:
        for root in roots:
            book = SweepBook(root, name_or_job)
            if book.read() is not None:
                return book
    found = [(book, record) for book, record in all_sweeps(roots) if epoch_of_job(record, name_or_job) is not None]
    if found:
        return max(found, key=lambda f: max((j["at"] for j in jobs_of(f[1])), default=0))[0]
    check_name(name_or_job, "sweep")
    raise UserError(f"no sweep {name_or_job!r} and no job {name_or_job} of a sweep under "
                    f"{', '.join(str(r) for r in roots)}; `hpc-garage status` lists jobs and their sweeps")


def all_sweeps(roots: list[Path]) -> Iterator[tuple[SweepBook, dict[str, Any]]]:
    for root in roots:
        for file in sorted(root.glob(f"*/{RECORD}")) if root.is_dir() else []:
            book = SweepBook(root, file.parent.name)
            if (record := book.read()) is not None:
                yield book, record
