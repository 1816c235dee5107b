"""Submitting a job and following it: the mechanism every batch system shares, written once.

A submission either completes or leaves nothing behind. The job script is written to a private temporary
file in the site's run root and handed to sbatch/qsub; once the id is known, the job's run directory
`<run root>/<id>/` gets `job.sh` (that script) and `submit.json` (what was asked, where the log goes). If
anything fails after the batch system took the job, the job is cancelled and what was created is removed.

Afterwards a job is known by its run directory: `status`, `wait`, `cancel` and `logs` read `submit.json`
for the site and log paths, ask the batch system about the job, and read `state.json`, which `hpc-garage
run` keeps up to date inside the job, for what the batch system cannot know (workers up, the exit code
once the batch system has forgotten the job). Files from an older job with a recycled id are ignored by time.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.request import Request
from hpc_garage.core.sweep import SweepKey
from hpc_garage.files import run_dir as job_run_dir, run_root as expand_root, write_private
from hpc_garage.schedulers.base import JOB_ID, BatchSystem, JobStatus
from hpc_garage.sweeps import SweepBook, add_job, next_epoch, results_root, sweep_of

if TYPE_CHECKING:
    from hpc_garage.schedulers.jobscript import JobSpec
    from hpc_garage.core.layout import Layout
    from hpc_garage.core.site import Site

SUBMIT_FILE = "submit.json"
STATE_FILE = "state.json"
SCRIPT_FILE = "job.sh"
SWEEP_SECONDS = 2.0  # `--wait` reads a sweep's directory this often (run writes progress as often)
CLOCK_SLACK = 5.0  # seconds: a state.json or log older than the submission (minus this) is an older job's


def run_root(site: Site) -> Path:
    """Where a site's run directories live (`files.run_dir(site.run_directory, id)` is one of them)."""
    return _root(site.run_directory)


def _root(run_directory: str) -> Path:
    return expand_root(run_directory)


# -------------------------------------------------------------------------------------------- submitting


@dataclass(frozen=True)
class Prepared:
    """A checked, rendered job that has not been submitted: what `--dry-run` prints."""

    site: Site
    spec: JobSpec
    layout: Layout
    script: str  # the job script's text
    root: Path  # the site's run root
    sweep: SweepBook | None = None  # where the job's sweep keeps its results, and how it joins it
    how: str = "submit"  # submit | resume


def prepare(
    site_name: str,
    script: str,
    args: Sequence[str] = (),
    request: Request = Request(),
    *,
    cwd: str | None = None,
    output: str | None = None,
    error: str | None = None,
    must_exist: bool = True,
    sweep: str | None = None,
    resume: bool = False,
) -> Prepared:
    """Load the site, check the script, the request and the sweep, render the job script. Reads, never writes.

    The job belongs to sweep `sweep` (default: derived from the site, the script and its arguments): a
    fresh epoch of it, or with `resume` the latest one, whose finished trials the job reads back."""
    from hpc_garage.schedulers.jobscript import job_name_for, job_spec, render
    from hpc_garage.schedulers import get
    from hpc_garage.sites import load_site

    site = load_site(site_name)
    if site.scheduler == "local":
        raise UserError(
            f"site {site.name} is local (no batch system); run it here with "
            f"`hpc-garage run --site {site.name} -- python {script}`"
        )
    workdir = os.path.abspath(cwd or os.getcwd())
    script_path = os.path.join(workdir, os.path.expanduser(script))
    if must_exist:
        _check_script(script_path)
    root = run_root(site)
    batch = get(site.scheduler)
    name = job_name_for(request.job_name, script_path)
    output = _absolute(output, workdir, "--output") if output else batch.default_output(root, name)
    error = _absolute(error, workdir, "--error") if error else None
    python = os.path.expanduser(site.python) if site.python else sys.executable
    spec, layout_ = job_spec(site, request, script=os.path.abspath(script_path), args=args, output=output,
                             error=error, workdir=workdir, python=python)
    book = sweep_of(site, sweep, os.path.abspath(script_path), args, workdir)
    spec = replace(spec, sweep=book.name, sweep_epoch=next_epoch(book, resume, "--resume"))
    return Prepared(site=site, spec=spec, layout=layout_, script=render(spec), root=root, sweep=book,
                    how="resume" if resume else "submit")


def _check_script(path: str) -> None:
    """The job runs SCRIPT with the site's Python: it must be a Python file (a shell script would fail there)."""
    if os.path.isdir(path):
        raise UserError(f"script {path} is a directory; give the Python file to run")
    if not os.path.isfile(path):
        raise UserError(f"script {path} does not exist; check the path")
    if path.endswith(".py"):
        return
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError as exc:
        raise UserError(f"script {path} cannot be read ({exc.strerror})") from None
    if not (first.startswith(b"#!") and b"python" in first):
        raise UserError(f"script {path} is not a Python script (no .py suffix, no python #! line); the job runs it "
                        "with the site's Python. Give a .py file, or run other programs from a Python script")


def _absolute(path: str, workdir: str, flag: str) -> str:
    """A log path as the job will open it; its directory must exist now, or the log is lost."""
    full = os.path.join(workdir, os.path.expanduser(path))
    if not os.path.isdir(os.path.dirname(full)):
        raise UserError(f"{flag} {path}: directory {os.path.dirname(full)} does not exist; create it first")
    return full


@dataclass(frozen=True)
class Submitted:
    job_id: str
    run_dir: Path
    log: str  # the output file (job id filled in)
    error_log: str | None
    record: dict[str, Any]


def submit(prepared: Prepared) -> Submitted:
    """Hand the job to the batch system and record it; on any failure, leave no job and no files."""
    from hpc_garage.schedulers import get

    spec, batch = prepared.spec, get(prepared.spec.scheduler)
    record = {
        "site": prepared.site.name,
        "site_file": spec.site,
        "scheduler": spec.scheduler,
        "script": spec.script,
        "args": list(spec.args),
        "cwd": spec.workdir,
        "job_name": spec.job_name,
        "log": {"output": spec.output, "error": spec.error},
        "request": {
            k: getattr(spec, k)
            for k in ("nodes", "tasks_per_node", "cpus_per_task", "gpus_per_node", "memory", "walltime", "queue")
        },
    }
    if prepared.sweep is not None:
        record["sweep"] = {"name": spec.sweep, "epoch": spec.sweep_epoch, "root": str(prepared.sweep.root)}
    return _hand_over(batch, prepared.root, prepared.script, lambda temp: batch.submit_argv(temp, spec), record,
                      prepared.how)


def resubmit(previous: Path, *, after: str | None, how: str) -> Submitted:
    """Submit a job's saved script again: same site, script, arguments, request and sweep epoch. `after`:
    the new job starts once that job has ended, however it ended (a walltime follow-up); None: now (resume)."""
    from hpc_garage.schedulers import get

    record = _read_json(previous / SUBMIT_FILE)
    if record is None or not (previous / SCRIPT_FILE).is_file():
        raise UserError(f"{previous} holds no job script of hpc-garage's ({SCRIPT_FILE}, {SUBMIT_FILE}); "
                        "submit the script again with `hpc-garage submit --resume`")
    batch = get(record.get("scheduler", "slurm"))
    output = record["log"]["output"]
    if batch.name == "pbs" and Path(output).parent == previous.parent:  # PBS logs carry no job id: a new name
        output = batch.default_output(previous.parent, record["job_name"])
    record = {**record, "log": {**record["log"], "output": output}, "follows": record["job_id"]}
    for stale in ("job_id", "submitted"):
        record.pop(stale, None)
    return _hand_over(batch, previous.parent, (previous / SCRIPT_FILE).read_text(),
                      lambda temp: batch.follow_up_argv(temp, after, output), record, how)


def _hand_over(batch: BatchSystem, root: Path, script: str, submit_argv: Callable[[Path], list[str]],
               record: dict[str, Any], how: str) -> Submitted:
    """Submit `script` from a private temporary file, then give the job its run directory (job.sh,
    submit.json) and its place in its sweep; anything that fails undoes the rest, the job first."""
    undo: list[Callable[[], None]] = []
    try:
        _make_dirs(root, undo)
        fd, temp = tempfile.mkstemp(dir=root, prefix=".submit-", suffix=".sh")
        undo.append(lambda: Path(temp).unlink(missing_ok=True))
        with os.fdopen(fd, "w") as f:
            f.write(script)
        job_id = batch.parse_job_id(batch.run(submit_argv(Path(temp))))
        # undone in reverse: the job is cancelled first, then its log and run directory go
        run_dir = job_run_dir(root, job_id)
        if not run_dir.exists():
            undo.append(lambda: shutil.rmtree(run_dir, ignore_errors=True))
        logs = record["log"]
        log = batch.log_path(logs["output"], job_id, record["job_name"])
        error_log = batch.log_path(logs["error"], job_id, record["job_name"]) if logs.get("error") else None
        new_logs = [Path(p) for p in (log, error_log) if p and not os.path.exists(p)]  # never a user's old file
        undo.append(lambda: [p.unlink(missing_ok=True) for p in new_logs])
        undo.append(lambda: _cancel_quietly(batch, job_id))
        run_dir.mkdir(mode=0o700, exist_ok=True)
        os.replace(temp, run_dir / SCRIPT_FILE)
        record = {"job_id": job_id, **record, "log": {**logs, "path": log, "error_path": error_log},
                  "submitted": time.time()}
        write_private(run_dir / SUBMIT_FILE, json.dumps(record, indent=2))
        if sweep := record.get("sweep"):
            book = SweepBook(Path(sweep["root"]), sweep["name"])
            add_job(book, SweepKey(book.name, sweep["epoch"]), job_id, how,
                    {k: record[k] for k in ("site", "script", "args", "cwd")})
    except BaseException:
        for step in reversed(undo):
            try:
                step()
            except Exception:  # noqa: BLE001 - undoing is best effort; the first error is the one to show
                pass
        raise
    return Submitted(job_id=job_id, run_dir=run_dir, log=log, error_log=error_log, record=record)


def _make_dirs(root: Path, undo: list[Callable[[], None]]) -> None:
    """The run root and any missing parents (0700), each removed again on failure if it stayed empty."""
    missing = []
    for parent in [root, *root.parents]:
        if parent.exists():
            break
        missing.append(parent)
    for directory in reversed(missing):
        directory.mkdir(mode=0o700)
        undo.append(lambda d=directory: d.rmdir() if d.is_dir() and not any(d.iterdir()) else None)


def _cancel_quietly(batch: BatchSystem, job_id: str) -> None:
    try:
        batch.run(batch.cancel_argv(job_id))
    except UserError:
        pass


# ---------------------------------------------------------------------------------------- finding jobs


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
            return "left the queue" + (f" (last seen {phase})" if phase else "; no state recorded")
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
        if code is None:
            return f"{word} (exit code unknown)"
        return word if code == 0 and word == "done" else f"{word} (exit {code})"

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
        state = _read_json(self.run_dir.parent / job_id / STATE_FILE) or {}
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


def run_roots() -> list[Path]:
    """Every run root a visible site names (sites may differ), the default one first."""
    from hpc_garage.core.site import Site
    from hpc_garage.sites import find_sites, load_site

    roots = [_root(Site.model_fields["run_directory"].default)]
    for path in find_sites().values():
        try:
            root = run_root(load_site(path))
        except UserError:
            continue
        if root not in roots:
            roots.append(root)
    return roots


def results_roots(site_name: str | None = None) -> list[Path]:
    """Where sweeps are kept: the site's results root, or every visible site's (the default one first)."""
    from hpc_garage.core.site import Site
    from hpc_garage.sites import find_sites, load_site

    if site_name:
        site = load_site(site_name)
        return [results_root(site.results_directory, site.run_directory)]
    fields = Site.model_fields
    roots = [results_root(fields["results_directory"].default, fields["run_directory"].default)]
    for path in find_sites().values():
        try:
            site = load_site(path)
        except UserError:
            continue
        if (root := results_root(site.results_directory, site.run_directory)) not in roots:
            roots.append(root)
    return roots


def resume(target: str, site_name: str | None = None) -> tuple[SweepBook, Submitted]:
    """Continue a sweep (by name, or by the id of one of its jobs): its latest job script, submitted again
    in the same epoch, so finished trials are read back. Refused while a job of the sweep is still queued
    or running (two jobs would run the same trials)."""
    from hpc_garage.sweeps import find as find_sweep, jobs_of

    book = None
    if JOB_ID.fullmatch(target) and ".." not in target:  # a job hpc-garage submitted names its sweep
        sweep = ((find(target, site_name).record or {}).get("sweep") or {})
        if sweep.get("root") and sweep.get("name"):
            book = SweepBook(Path(sweep["root"]), sweep["name"])
    if book is None or book.read() is None:
        book = find_sweep(target, results_roots(site_name))
    record = book.read() or {}
    jobs = [j["job_id"] for j in jobs_of(record)]
    views = [find(job_id, site_name) for job_id in jobs]
    for view in views:
        refresh(view)
        if view.status is not None and view.status.phase != "finished":
            raise UserError(f"sweep {book.name} is still {view.status.phase} in job {view.job_id}; wait for it "
                            f"(`hpc-garage status {view.job_id}`) or cancel it before resuming")
    scripts = [v.run_dir for v in views if v.run_dir is not None and (v.run_dir / SCRIPT_FILE).is_file()]
    if not scripts:
        identity = record.get("identity") or {}
        raise UserError(f"sweep {book.name} ran on this machine, not as a submitted job; continue it with "
                        f"`hpc-garage run --site {identity.get('site', 'SITE')} --sweep {book.name} --resume -- "
                        f"python {identity.get('script', 'SCRIPT')}`")
    return book, resubmit(scripts[-1], after=None, how="resume")


def records(roots: Sequence[Path] | None = None) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(run directory, submit.json) for every job hpc-garage submitted, in any order."""
    for root in run_roots() if roots is None else roots:
        for file in root.glob(f"*/{SUBMIT_FILE}") if root.is_dir() else []:
            try:
                record = json.loads(file.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(record, dict) and record.get("job_id") == file.parent.name:
                yield file.parent, record


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
        roots = [run_root(site)]
    candidates = [
        (run_dir, rec) for root in (roots or run_roots()) if (run_dir := root / job_id).is_dir()
        for rec in [_read_json(run_dir / SUBMIT_FILE)] if rec and rec.get("job_id") == job_id
    ]
    if candidates:
        run_dir, record = max(candidates, key=lambda c: c[1].get("submitted") or 0)
        return JobView(job_id=job_id, record=record, run_dir=run_dir, batch=get(record.get("scheduler", "slurm")))
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
        state = _read_json(view.run_dir / STATE_FILE)
        submitted = record.get("submitted") or 0
        if state and (state.get("updated") or 0) >= submitted - CLOCK_SLACK:
            view.state = state
    return view


def status_all(roots: Sequence[Path] | None = None) -> list[JobView]:
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
    for root in run_roots():
        candidate = root / view.job_id
        if (candidate / holding).exists() if holding else candidate.is_dir():
            return candidate
    return None


def submitted_at(run_dir: Path) -> float | None:
    """When the job whose run directory this is was submitted (less CLOCK_SLACK), from its submit.json; None
    for a run hpc-garage did not submit. Files in it older than that are an earlier job's (a recycled id)."""
    submitted = (_read_json(run_dir / SUBMIT_FILE) or {}).get("submitted")
    return float(submitted) - CLOCK_SLACK if isinstance(submitted, (int, float)) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------------------ following a job


def wait(view: JobView, report: Callable[[str], None], *, interval: float = 0.5, limit: float = 1.0,
         note: Callable[[str], None] | None = None) -> int:
    """Report the job's summary whenever it changes until it ends, and (`note`) where to look once known;
    return its exit code (1 when unknown)."""
    shown = None
    noted: set[str] = set()
    sweep, sweep_read = None, 0.0
    while True:
        refresh(view)
        for line in progress_links((view.state or {}).get("progress") or {}) if note and not view.finished else ():
            if line not in noted:
                noted.add(line)
                note(line)
        text = f"job {view.job_id} {view.summary()}"
        if (view.record or {}).get("sweep") and (view.finished or time.monotonic() - sweep_read >= SWEEP_SECONDS):
            sweep, sweep_read = view.sweep(), time.monotonic()  # lists the results directory: not every poll
        if sweep and sweep.get("trials", {}).get("jobs", 0) > 1:  # the sweep spans jobs: its totals too
            text += f" | sweep: {sweep_text(sweep)}"
        if text != shown:
            report(text)
            shown = text
        if view.finished:
            follow_up = _follow_up(view)
            if follow_up is None:
                code = view.exit_code
                return 1 if code is None else code
            (note or report)(f"job {view.job_id}: the sweep continues in job {follow_up.job_id}")
            view, shown, interval, sweep_read = follow_up, None, 0.5, 0.0
            continue
        time.sleep(interval)
        interval = min(limit, interval * 1.5)


def _follow_up(view: JobView) -> JobView | None:
    """The job that carries this ended job's sweep on (walltime, warning signal), if `run` submitted one."""
    next_job = (view.state or {}).get("next_job")
    if not isinstance(next_job, str) or view.run_dir is None:
        return None
    run_dir = view.run_dir.parent / check_job_id(next_job)
    record = _read_json(run_dir / SUBMIT_FILE)
    return JobView(job_id=next_job, record=record, run_dir=run_dir if record else None, batch=view.batch)


@dataclass
class ProgressLine:
    """One line rewritten in place on a terminal; one line per change elsewhere (logs, pipes). `note` prints
    a line that stays (above the one rewritten)."""

    stream: IO[str]

    def __call__(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}" if self.stream.isatty() else f"{text}\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self.stream.write(f"\r\x1b[K{text}\n" if self.stream.isatty() else f"{text}\n")
        self.stream.flush()


def progress_line(stream: IO[str]) -> ProgressLine:
    return ProgressLine(stream)


# ------------------------------------------------------------------------------------ a sweep's progress


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
    return "; ".join(parts)


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
    return text


def progress_links(progress: dict[str, Any], login: str | None = None) -> list[str]:
    """Where to look while it runs: the Prefect flow run(s) in the UI, the Dask dashboard and the `ssh -L`
    line that reaches it from a laptop through this (login) node."""
    import getpass
    import socket

    lines = []
    prefect = progress.get("prefect") or {}
    for run in prefect.get("flow_runs") or []:
        where = run.get("url") or run.get("id")
        if prefect.get("ui") is False:
            lines.append(f"Prefect flow run {run.get('id')} (the Prefect server at {prefect.get('api')} runs "
                         "without its UI; set PREFECT_API_URL to a server with one to browse it)")
        else:
            lines.append(f"Prefect UI: {where}")
    if dashboard := progress.get("dashboard"):
        host, port = dashboard.get("host"), dashboard.get("port")
        login = login or f"{getpass.getuser()}@{socket.getfqdn()}"
        lines.append(f"Dask dashboard: http://{host}:{port}/status" + (
            "" if dashboard.get("bokeh", True) else " (the job's Python lacks bokeh: `pip install bokeh` there for the plots)"))
        lines.append(f"  from a laptop: ssh -N -L 8787:{host}:{port} {login}  then open http://localhost:8787/status")
    return lines


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return (f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s" if rest >= 60
            else f"{rest}s")


def cancel(view: JobView) -> str:
    """Cancel the job if it is still queued or running; say what was done."""
    refresh(view)
    status = view.status
    if status is None:
        raise UserError(f"job {view.job_id} is not in the {view.batch.name} queue (it ended, or never was); nothing to cancel")
    if status.phase == "finished":
        return f"job {view.job_id} already ended ({status.state}); nothing to cancel"
    view.batch.run(view.batch.cancel_argv(view.job_id))
    return f"cancelled job {view.job_id} (it was {status.phase}; `{' '.join(view.batch.cancel_argv(view.job_id))}`)"


def log_files(view: JobView) -> list[Path]:
    """The job's output file, and its error file when separate."""
    if view.record is None:
        raise UserError(
            f"job {view.job_id} has no run directory, so its log paths are unknown; "
            "its job script's output directive says where they are"
        )
    log = view.record.get("log") or {}
    return [Path(p) for p in (log.get("path"), log.get("error_path")) if p]


def logs(view: JobView, out: IO[bytes], *, follow: bool = False, poll: float = 0.5) -> None:
    """Copy the job's log to `out`; with `follow`, keep copying until the job has ended and the log is drained."""
    files = log_files(view)
    submitted = (view.record or {}).get("submitted") or 0
    if not follow:
        fresh = [f for f in files if _fresh(f, submitted)]
        if not fresh:
            refresh(view)
            raise UserError(f"job {view.job_id} ({view.summary()}) has no log yet at {files[0]}; "
                            f"`hpc-garage logs {view.job_id} --follow` waits for it")
        for f in fresh:
            if len(fresh) > 1:
                out.write(f"==> {f} <==\n".encode())
            out.write(f.read_bytes())
        out.flush()
        return
    offsets = {f: 0 for f in files}
    while True:
        ended = refresh(view).finished  # ask first: what is written before the job ends is read below
        for f, offset in offsets.items():
            if not _fresh(f, submitted):
                continue
            with f.open("rb") as handle:
                handle.seek(offset)
                chunk = handle.read()
            if chunk:
                out.write(chunk)
                out.flush()
                offsets[f] = offset + len(chunk)
        if ended:
            return
        time.sleep(poll)


def _fresh(path: Path, submitted: float) -> bool:
    """The file exists and was written by this job, not an older one with the same id."""
    try:
        return path.stat().st_mtime >= submitted - CLOCK_SLACK
    except OSError:
        return False

