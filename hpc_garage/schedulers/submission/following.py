"""Following a job found (`finding.py`): `wait` until it and the follow-up jobs that carry its sweep on have
ended, `cancel` it, copy its `logs`. What is reported goes to the caller's functions: the CLI decides how a
terminal shows it (`cli/status_text.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from hpc_garage.core.errors import UserError
from hpc_garage.rundir import CLOCK_SLACK, RunDir
from hpc_garage.schedulers.submission.finding import JobView, check_job_id, refresh, sweep_text

SWEEP_SECONDS = 2.0  # `--wait` reads a sweep's directory this often (run writes progress as often)


def wait(view: JobView, report: Callable[[str], None], *, interval: float = 0.5, limit: float = 1.0,
         note: Callable[[str], None] | None = None,
         links: Callable[[dict[str, Any]], Iterable[str]] | None = None) -> int:
    """Report the job's summary whenever it changes until it ends, and (`note`) where to look once known
    (`links`: from its progress, e.g. the Prefect UI), each line once; return its exit code (1 when unknown)."""
    shown = None
    noted: set[str] = set()
    sweep, sweep_read = None, 0.0
    while True:
        refresh(view)
        if note and links and not view.finished:
            for line in links((view.state or {}).get("progress") or {}):
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
            follow_up = next_job_of(view)
            if follow_up is None:
                code = view.exit_code
                return 1 if code is None else code
            (note or report)(f"job {view.job_id}: the sweep continues in job {follow_up.job_id}")
            view, shown, interval, sweep_read = follow_up, None, 0.5, 0.0
            continue
        time.sleep(interval)
        interval = min(limit, interval * 1.5)


def next_job_of(view: JobView) -> JobView | None:
    """The job that carries this ended job's sweep on (walltime, warning signal), if `run` submitted one."""
    next_job = (view.state or {}).get("next_job")
    if not isinstance(next_job, str) or view.run_dir is None:
        return None
    run_dir = view.run_dir.parent / check_job_id(next_job)
    record = RunDir(run_dir).submit_record()
    return JobView(job_id=next_job, record=record, run_dir=run_dir if record else None, batch=view.batch)


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


# ------------------------------------------------------------------------------------------ its log


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
