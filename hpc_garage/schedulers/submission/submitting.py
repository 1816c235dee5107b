"""Submitting: a job checked and rendered (`prepare`, what `--dry-run` prints), then handed to the batch system
all or nothing (`submit`, `resubmit`, `resume`).

The job script is written to a private temporary file in the site's run root and handed to sbatch/qsub; once
the id is known, the job's run directory `<run root>/<id>/` gets `job.sh` (that script) and `submit.json` (what
was asked, where the log goes). If anything fails after the batch system took the job, the job is cancelled and
what was created is removed.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.request import Request
from hpc_garage.core.sweep import SweepKey, script_of
from hpc_garage.files import read_secrets, write_private
from hpc_garage.rundir import RunDir, RunRoot
from hpc_garage.schedulers.base import JOB_ID, BatchSystem
from hpc_garage.schedulers.submission.finding import find, refresh, results_roots
from hpc_garage.sweeps import SweepBook, add_job, next_epoch, sweep_of
from hpc_garage.variables import SECRETS_ENV

if TYPE_CHECKING:
    from hpc_garage.core.layout import Layout
    from hpc_garage.core.site import Site
    from hpc_garage.schedulers.jobscript import JobSpec


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
    from hpc_garage.schedulers import get
    from hpc_garage.schedulers.jobscript import job_name_for, job_spec, render
    from hpc_garage.sites import load_site

    site = load_site(site_name)
    if request.container:
        from hpc_garage.sites import with_container

        site = with_container(site, request.container)
    batch = get(site.scheduler)
    if not batch.takes_jobs:
        raise UserError(
            f"site {site.name} is local (no batch system); run it here with "
            f"`hpc-garage run --site {site.name} -- python {script}`"
        )
    workdir = os.path.abspath(cwd or os.getcwd())
    script_path = os.path.join(workdir, os.path.expanduser(script))
    if must_exist:
        _check_script(script_path)
    root = RunRoot.of_site(site).path
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


def submit(prepared: Prepared, *, hidden: Collection[str] = ()) -> Submitted:
    """Hand the job to the batch system and record it; on any failure, leave no job and no files. `hidden`:
    variables of this environment that sbatch/qsub must not hand the job (they reach it from a private file)."""
    from hpc_garage.schedulers import get

    batch = get(prepared.spec.scheduler)
    return _hand_over(batch, prepared.root, prepared.script, lambda temp: batch.submit_argv(temp, prepared.spec),
                      _record_of(prepared), prepared.how, hidden)


def adopt(prepared: Prepared, job_id: str) -> Submitted:
    """Give a job the batch system took for `prepared` its run directory (job.sh, submit.json) and its place in
    its sweep, as `submit` would have: its submitter died between sbatch and that (a work-pool worker killed
    mid-submission, whose restart finds the job by its name), with the script as this process renders it.
    What is there already is kept."""
    from hpc_garage.schedulers import get

    batch = get(prepared.spec.scheduler)
    rundir = RunRoot(prepared.root).run_dir(job_id)
    if (record := rundir.submit_record()) is not None:
        return Submitted(job_id, rundir.path, record["log"].get("path") or "", record["log"].get("error_path"),
                         record)
    rundir.path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for stray in prepared.root.glob(".submit-*.sh"):  # the dead submitter's temporary copy of this same script
        if stray.read_text(errors="replace") == prepared.script:
            stray.unlink(missing_ok=True)
    write_private(rundir.script_file, prepared.script)
    return _record_job(batch, prepared.root, job_id, _record_of(prepared), prepared.how)


def _record_of(prepared: Prepared) -> dict[str, Any]:
    """What submit.json says of a job before its id is known: what was asked, where its logs go, its sweep."""
    spec = prepared.spec
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
    return record


def record_run_here(rundir: RunDir, site: Site, command: Sequence[str], sweep_root: Path, sweep: SweepKey) -> None:
    """submit.json for a `run` outside a batch job (a login node, a laptop): no script to submit again and no
    log file (its output is the terminal's), but its site, command, host and sweep, so that `status` lists it
    and `cancel`, `resume` and `report` find it (schedulers/local.py says whether it still runs)."""
    script, args = script_of(list(command))
    rundir.write_submit_record({
        "job_id": rundir.job_id, "site": site.name, "scheduler": "local", "script": script, "args": list(args),
        "cwd": os.getcwd(), "job_name": Path(script).name, "command": list(command), "host": socket.gethostname(),
        "pid": os.getpid(), "log": {}, "submitted": time.time(),
        "sweep": {"name": sweep.name, "epoch": sweep.epoch, "root": str(sweep_root)},
    })


def resubmit(previous: Path, *, after: str | None, how: str) -> Submitted:
    """Submit a job's saved script again: same site, script, arguments, request and sweep epoch. `after`:
    the new job starts once that job has ended, however it ended (a walltime follow-up); None: now (resume)."""
    from hpc_garage.schedulers import get

    earlier = RunDir(previous)
    record = earlier.submit_record()
    if record is None or not earlier.script_file.is_file():
        raise UserError(f"{previous} holds no job script of hpc-garage's ({earlier.script_file.name}, "
                        f"{earlier.submit_file.name}); "
                        "submit the script again with `hpc-garage submit --resume`")
    batch = get(record.get("scheduler", "slurm"))
    root = earlier.root.path
    output = batch.follow_up_output(record["log"]["output"], root, record["job_name"])
    record = {**record, "log": {**record["log"], "output": output}, "follows": record["job_id"]}
    for stale in ("job_id", "submitted"):
        record.pop(stale, None)
    return _hand_over(batch, root, earlier.script_file.read_text(),
                      lambda temp: batch.follow_up_argv(temp, after, output), record, how)


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
    scripts = [v.run_dir for v in views if v.run_dir is not None and RunDir(v.run_dir).script_file.is_file()]
    if not scripts:
        identity = record.get("identity") or {}
        raise UserError(f"sweep {book.name} ran on this machine, not as a submitted job; continue it with "
                        f"`hpc-garage run --site {identity.get('site', 'SITE')} --sweep {book.name} --resume -- "
                        f"python {identity.get('script', 'SCRIPT')}`")
    return book, resubmit(scripts[-1], after=None, how="resume")


# ------------------------------------------------------------------------------------ all or nothing


def _hand_over(batch: BatchSystem, root: Path, script: str, submit_argv: Callable[[Path], list[str]],
               record: dict[str, Any], how: str, hidden: Collection[str] = ()) -> Submitted:
    """Submit `script` from a private temporary file, then give the job its run directory (job.sh,
    submit.json) and its place in its sweep; anything that fails undoes the rest, the job first."""
    undo: list[Callable[[], None]] = []
    try:
        _make_dirs(root, undo)
        fd, temp = tempfile.mkstemp(dir=root, prefix=".submit-", suffix=".sh")
        undo.append(lambda: Path(temp).unlink(missing_ok=True))
        with os.fdopen(fd, "w") as f:
            f.write(script)
        env = _environ(hidden)
        argv = submit_argv(Path(temp))
        job_id = batch.parse_job_id(batch.run(argv) if env is None else batch.run(argv, env=env))
        # undone in reverse: the job is cancelled first, then its log and run directory go
        rundir = RunRoot(root).run_dir(job_id)
        if not rundir.path.exists():
            undo.append(lambda: shutil.rmtree(rundir.path, ignore_errors=True))
        logs = record["log"]
        new_logs = [Path(p) for p in (batch.log_path(logs["output"], job_id, record["job_name"]),
                                      batch.log_path(logs["error"], job_id, record["job_name"]) if logs.get("error")
                                      else None) if p and not os.path.exists(p)]  # never a user's old file
        undo.append(lambda: [p.unlink(missing_ok=True) for p in new_logs])
        undo.append(lambda: _cancel_quietly(batch, job_id))
        rundir.path.mkdir(mode=0o700, exist_ok=True)
        os.replace(temp, rundir.script_file)
        return _record_job(batch, root, job_id, record, how)
    except BaseException:
        for step in reversed(undo):
            try:
                step()
            except Exception:  # noqa: BLE001 - undoing is best effort; the first error is the one to show
                pass
        raise


def _record_job(batch: BatchSystem, root: Path, job_id: str, record: dict[str, Any], how: str) -> Submitted:
    """The job's run directory (its job.sh in place) gets submit.json, and its sweep the job."""
    rundir = RunRoot(root).run_dir(job_id)
    logs = record["log"]
    log = batch.log_path(logs["output"], job_id, record["job_name"])
    error_log = batch.log_path(logs["error"], job_id, record["job_name"]) if logs.get("error") else None
    record = {"job_id": job_id, **record, "log": {**logs, "path": log, "error_path": error_log},
              "submitted": time.time()}
    rundir.write_submit_record(record)
    if sweep := record.get("sweep"):
        book = SweepBook(Path(sweep["root"]), sweep["name"])
        add_job(book, SweepKey(book.name, sweep["epoch"]), job_id, how,
                {k: record[k] for k in ("site", "script", "args", "cwd")})
    return Submitted(job_id=job_id, run_dir=rundir.path, log=log, error_log=error_log, record=record)


def _environ(hidden: Collection[str]) -> dict[str, str] | None:
    """The environment sbatch/qsub hand the job (Slurm keeps it in its state, and in accounting with
    `AccountingStoreFlags=job_env`): this one without the secrets that reach the job through a private file
    instead, `hidden` and those of the file $HPC_GARAGE_SECRETS names (a deployment job's follow-up);
    None: this environment as it is."""
    names = set(hidden)
    if path := os.environ.get(SECRETS_ENV):
        names |= set(read_secrets(path, SECRETS_ENV))
    return {k: v for k, v in os.environ.items() if k not in names} if names else None


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
