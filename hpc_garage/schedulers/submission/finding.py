"""Finding jobs and their state: a job is known by its run directory across every visible site's run root.

`find` reads `submit.json` for the site and log paths; `refresh` asks the batch system about the job and reads
`state.json`, which `hpc-garage run` keeps up to date inside the job, for what the batch system cannot know
(workers up, the exit code once the batch system has forgotten the job). Files from an older job with a
recycled id are ignored by time. A `JobView` says the job's state in a few words (`summary`): the data that
`status --json` prints and `--wait` follows; its progress in words is core/progress_text.py's, and how a
terminal shows the rest is the CLI's (`cli/status_text.py`).
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.progress_text import progress_text
from hpc_garage.rundir import RunDir, RunRoot, first_run_dir, newest_submitted, since_submission, submission_time
from hpc_garage.schedulers.base import JOB_ID, BatchSystem, JobStatus
from hpc_garage.sweeps import SweepBook, results_root


@dataclass
class JobView:
    """One job as hpc-garage sees it: its record, the batch system's word, and `run`'s state file."""

    job_id: str
    record: dict[str, Any] | None  # submit.json; None for a job hpc-garage has no run directory for
    run_dir: Path | None
    batch: BatchSystem
    status: JobStatus | None = None  # None: the batch system does not know the job (any more)
    state: dict[str, Any] | None = field(default=None)  # state.json, if written for this very job

    @property
    def finished(self) -> bool:
        if self.status is not None:
            return self.status.phase == "finished"
        return True  # out of the queue: nothing more will happen

    @property
    def exit_code(self) -> int | None:
        if self.status is not None and self.status.exit_code is not None:
            return self.status.exit_code
        code = (self.state or {}).get("exit_code")
        return code if isinstance(code, int) else None

    def summary(self) -> str:
        """`pending`, `running`, `workers 3/8`, `done`, `failed (exit 3)`, ...: what `--wait` shows."""
        s, state = self.status, self.state or {}
        phase = state.get("phase")
        if s is None:
            if phase in ("done", "failed"):
                return self._ended("COMPLETED" if self.exit_code == 0 else "FAILED")
            gone = "left the queue" if self.batch.takes_jobs else "ended"  # a run here: its process is gone
            return gone + (f" (last seen {phase})" if phase else "; no state recorded")
        if s.phase == "pending":
            return "pending" + (f" ({s.reason})" if s.reason else "")
        if s.phase == "running":
            workers, expected = state.get("workers"), state.get("expected")
            if phase == "workers" and expected:
                return f"workers {workers or 0}/{expected}"
            if phase == "winding down" and (progress := state.get("progress")):  # walltime, a warning signal
                return f"winding down: {progress_text(progress)}"
            if phase == "running":
                if progress := state.get("progress"):
                    return f"running: {progress_text(progress)}"
                return f"running ({workers} worker{'s' if workers != 1 else ''})" if workers else "running"
            return "running" + (" (starting)" if phase == "starting" else "")
        return self._ended(s.state)

    def _ended(self, state: str) -> str:
        code = self.exit_code
        word = state.split()[0].lower() if state else "finished"
        if word in ("completed", "c", "f", "x"):
            word = "done" if code == 0 else "failed" if code else "finished"
        if (self.state or {}).get("cancelled") and code != 0:  # `hpc-garage cancel` ended it (run noted it)
            word = "cancelled"
        if code is None:
            return f"{word} (exit code unknown)"
        why = (self.state or {}).get("chain_ended")  # the sweep's chain of jobs ended here, and why (wind_down.py)
        return word if code == 0 and word == "done" else f"{word} (exit {code}{f': {why}' if why else ''})"

    def sweep(self) -> dict[str, Any] | None:
        """The job's sweep (sweeps.summary), when hpc-garage submitted it, with its trials across the epoch's
        jobs (sweeps.across_jobs, from each job's state.json in this job's run root)."""
        from hpc_garage.sweeps import across_jobs, summary

        sweep = (self.record or {}).get("sweep") or {}
        if not sweep.get("root") or not sweep.get("name"):
            return None
        found = summary(SweepBook(Path(sweep["root"]), sweep["name"]), sweep.get("epoch"))
        if found is not None:
            found["trials"] = across_jobs(found["results"], [self._progress_of(j["job_id"]) for j in found["jobs"]])
        return found

    def _progress_of(self, job_id: str) -> tuple[dict[str, Any] | None, bool]:
        """Another job of the sweep: its last progress, and whether it still runs (as its state.json says)."""
        if job_id == self.job_id:
            return (self.state or {}).get("progress"), not self.finished
        if self.run_dir is None or not JOB_ID.fullmatch(job_id) or ".." in job_id:
            return None, False
        state = RunDir(self.run_dir).root.run_dir(job_id).state() or {}
        return state.get("progress"), state.get("phase") == "running" and state.get("exit_code") is None

    def to_dict(self, *, sweep: bool = False) -> dict[str, Any]:
        """The job as JSON; with `sweep`, its sweep too (read from the sweep's directory: one job's view)."""
        record = self.record or {}
        return {
            "sweep": self.sweep() if sweep else None,
            "job_id": self.job_id,
            "site": record.get("site"),
            "scheduler": self.batch.name,
            "name": record.get("job_name") or (self.status.name if self.status else None),
            "summary": self.summary(),
            "finished": self.finished,
            "exit_code": self.exit_code if self.finished else None,
            "batch": self.status.to_dict() if self.status else None,
            "run": self.state,
            "submitted": record.get("submitted"),
            "log": (record.get("log") or {}).get("path"),
            "run_dir": str(self.run_dir) if self.run_dir else None,
        }


# ------------------------------------------------------------------------------------------ finding jobs


def run_roots() -> list[RunRoot]:
    """Every run root a visible site names (sites may differ), the default one first."""
    roots = [RunRoot.default()]
    for run_directory, _ in _site_directories():
        if (root := RunRoot.of(run_directory)) not in roots:
            roots.append(root)
    return roots


def results_roots(site_name: str | None = None) -> list[Path]:
    """Where sweeps are kept: the site's results root, or every visible site's (the default one first)."""
    from hpc_garage.core.site_values import DEFAULT_RUN_DIRECTORY
    from hpc_garage.sites import load_site

    if site_name:
        site = load_site(site_name)
        return [results_root(site.results_directory, site.run_directory)]
    roots = [results_root(None, DEFAULT_RUN_DIRECTORY)]
    for run_directory, results_directory in _site_directories():
        if (root := results_root(results_directory, run_directory)) not in roots:
            roots.append(root)
    return roots


def _site_directories() -> Iterator[tuple[str, str | None]]:
    """(run_directory, results_directory) of every visible site file that can be read (sites/files.py)."""
    from hpc_garage.sites.files import directories, find_sites

    for path in find_sites().values():
        try:
            yield directories(path)
        except UserError:
            continue


def records(roots: Sequence[RunRoot] | None = None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(run directory, submit.json) for every job hpc-garage submitted, in any order."""
    for root in run_roots() if roots is None else roots:
        for rundir, record in root.jobs():
            yield rundir.path, record


def check_job_id(job_id: str) -> str:
    if not JOB_ID.fullmatch(job_id) or ".." in job_id:
        raise UserError(f"job id {job_id!r} is not a job id (like 12, 12.server or 12_3)")
    return job_id


def find(job_id: str, site_name: str | None = None) -> JobView:
    """The job with this id: from its run directory (the newest, if ids were recycled), or just its batch system."""
    from hpc_garage.schedulers import get

    check_job_id(job_id)
    roots = None
    if site_name:
        from hpc_garage.sites import load_site

        site = load_site(site_name)
        roots = [RunRoot.of_site(site)]
    if (found := newest_submitted(job_id, roots or run_roots())) is not None:
        rundir, record = found
        return JobView(job_id=job_id, record=record, run_dir=rundir.path,
                       batch=get(record.get("scheduler", "slurm")))
    batch = get(site.scheduler) if site_name else _guess_batch(job_id)
    return JobView(job_id=job_id, record=None, run_dir=None, batch=batch)


def lookup(job_id: str, site_name: str | None = None) -> JobView:
    """`find` and `refresh`, refusing a job that neither hpc-garage nor the batch system knows."""
    view = refresh(find(job_id, site_name))
    if view.record is None and view.status is None:
        raise UserError(
            f"job {job_id} is unknown: not in the {view.batch.name} queue, and no run directory of that id "
            "(pass --site if the job's site keeps its runs elsewhere)"
        )
    return view


def _guess_batch(job_id: str) -> BatchSystem:
    """For a job hpc-garage did not submit: SLURM where its commands exist (its qsub is a wrapper), else PBS."""
    from hpc_garage.schedulers import get

    for name, command in (("slurm", "scontrol"), ("pbs", "qstat")):
        if shutil.which(command):
            return get(name)
    raise UserError(f"job {job_id} has no run directory and neither scontrol nor qstat is on PATH; pass --site")


def refresh(view: JobView, status: JobStatus | None | bool = False) -> JobView:
    """Ask the batch system (unless `status` is given) and read state.json; ignore what is an older job's."""
    if status is False:
        status = view.batch.status(view.job_id)
    record = view.record or {}
    if status is not None and record.get("job_name") and status.name and status.name != record["job_name"]:
        status = None  # the id now belongs to someone else's job: ours has left the queue
    view.status = status  # type: ignore[assignment]
    view.state = None
    if view.run_dir is not None:
        state = RunDir(view.run_dir).state()
        if state and since_submission(state.get("updated") or 0, submission_time(record)):
            view.state = state
    if view.status is None and not view.batch.takes_jobs:
        view.status = _elsewhere(view)
    return view


def other_host(view: JobView) -> str | None:
    """The host a `run` outside a batch job runs on, where that is not this one (another login node): its
    process can be neither seen nor signalled from here."""
    if view.batch.takes_jobs:
        return None
    host = (view.record or {}).get("host")
    return host if host and host != socket.gethostname() else None


def _elsewhere(view: JobView) -> JobStatus | None:
    """A `run` of another host: this host cannot see its process, so its state file says whether it runs (a
    run killed outright still says so; `status` names the host to check)."""
    host, state = other_host(view), view.state or {}
    if not host or state.get("phase") in (None, "done", "failed") or "exit_code" in state:
        return None
    return JobStatus(job_id=view.job_id, state="RUNNING", phase="running",
                     reason=f"on {host}, as its state file says (its process is checked only there)")


def status_all(roots: Sequence[RunRoot] | None = None) -> list[JobView]:
    """Every job with a run directory, newest first, each batch system asked once."""
    from hpc_garage.schedulers import get

    found: dict[tuple[str, str], tuple[Path, dict[str, Any]]] = {}
    for run_dir, record in records(roots):
        key = (record.get("scheduler", "slurm"), record["job_id"])
        if key not in found or (record.get("submitted") or 0) > (found[key][1].get("submitted") or 0):
            found[key] = (run_dir, record)
    views = [
        JobView(job_id=job_id, record=record, run_dir=run_dir, batch=get(scheduler))
        for (scheduler, job_id), (run_dir, record) in found.items()
    ]
    for scheduler in {v.batch.name for v in views}:
        mine = [v for v in views if v.batch.name == scheduler]
        answers = mine[0].batch.statuses([v.job_id for v in mine])
        for v in mine:
            refresh(v, answers.get(v.job_id))
    return sorted(views, key=lambda v: (v.record or {}).get("submitted") or 0, reverse=True)


def run_dir_of(view: JobView, holding: str | None = None) -> Path | None:
    """The job's run directory: the one hpc-garage submitted it with, else (a `run` on a login node, or in a
    job written by hand) the first one of that id under a run root (that holds `holding`, where given)."""
    if view.run_dir is not None:
        return view.run_dir
    found = first_run_dir(view.job_id, run_roots(), holding)
    return found.path if found is not None else None
