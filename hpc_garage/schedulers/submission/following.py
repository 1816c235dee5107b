"""Following a job found (`finding.py`): `wait` until it and the follow-up jobs that carry its sweep on have
ended, `cancel` it, copy its `logs`. What is reported goes to the caller's functions: the CLI decides how a
terminal shows it (`cli/status_text.py`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

from hpc_garage.core.errors import UserError
from hpc_garage.rundir import RunDir, since_submission, submission_time
from hpc_garage.core.progress_text import sweep_text
from hpc_garage.schedulers.submission.finding import JobView, check_job_id, other_host, refresh

SWEEP_SECONDS = 2.0  # `--wait` reads a sweep's directory this often (run writes progress as often)
CANCEL_MARGIN = 60.0  # `cancel` waits this beyond the checkpoint grace: the wind-down decides, `run` tears down
CANCEL_POLL = 2.0  # ... asking the batch system this often whether the job has ended


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
    rundir = RunDir(view.run_dir).root.run_dir(check_job_id(next_job))
    record = rundir.submit_record()
    return JobView(job_id=next_job, record=record, run_dir=rundir.path if record else None, batch=view.batch)


def cancel(view: JobView, report: Callable[[str], None] | None = None, *, now: bool = False,
           poll: float = CANCEL_POLL) -> str:
    """Cancel the job if it is still queued or running; say what was done. A running sweep is wound down
    first (`wind_down_grace`): its trials see `should_stop()` and get their checkpoint grace, no follow-up job
    is submitted; the job is cancelled if it has not ended by then. `report`: the lines said on the way."""
    refresh(view)
    status = view.status
    if status is None:
        where = f"in the {view.batch.name} queue" if view.batch.takes_jobs else "running (its process is gone)"
        raise UserError(f"job {view.job_id} is not {where} (it ended, or never was); nothing to cancel")
    if status.phase == "finished":
        return f"job {view.job_id} already ended ({status.state}); nothing to cancel"
    if host := other_host(view):
        raise UserError(f"job {view.job_id} runs on {host}, not on this host: cancel it there "
                        f"(`ssh {host} hpc-garage cancel {view.job_id}`)")
    say = report or (lambda line: None)
    grace = start_wind_down(view, now)
    if grace is not None:
        say(f"job {view.job_id}: winding down; giving its running trials {grace:.0f} s (checkpoint_grace) to "
            "checkpoint before it is cancelled (`--now` cancels at once)")
        try:
            ended = _ended_within(view, grace + CANCEL_MARGIN, poll)
        except KeyboardInterrupt:
            say(f"job {view.job_id}: interrupted: cancelling it now")
            ended = False
        follow_up = cancel_follow_up(view)  # one submitted before the cancel was seen
        if follow_up is not None:
            say(f"job {view.job_id}: its follow-up job {follow_up} cancelled too")
        if ended:
            return (f"job {view.job_id} wound down and ended ({view.summary()}); no follow-up job; "
                    f"`hpc-garage resume {view.job_id}` continues its sweep")
    argv = view.batch.cancel_argv(view.job_id)
    if view.run_dir is not None:  # its `run` submits no follow-up job and notes the cancel in state.json
        with contextlib.suppress(OSError):
            RunDir(view.run_dir).request_cancel()
    view.batch.run(argv)
    return f"cancelled job {view.job_id} (it was {status.phase}; `{' '.join(argv)}`)"


def start_wind_down(view: JobView, now: bool = False) -> float | None:
    """Start the wind-down of a cancel (`cancel`, and a Prefect cancel through the work pool's worker): the job
    is marked as being cancelled and its `run` signalled; the seconds its trials get to checkpoint, or None
    where it cannot wind down (see wind_down_grace) and is cancelled at once instead."""
    grace = wind_down_grace(view, now)
    if grace is None or view.run_dir is None or not _wind_down(view, RunDir(view.run_dir)):
        return None
    return grace


def wind_down_grace(view: JobView, now: bool = False) -> float | None:
    """Seconds `cancel` gives a job's running trials to checkpoint before it cancels the job, from the
    grace its `run` noted in state.json; None: cancel at once (`--now`; a job not running yet, or not
    hpc-garage's; a run with no trials started yet, or ended, or one that does not wind down for a cancel
    (it notes no grace); a batch system that cannot signal the batch shell)."""
    state = view.state or {}
    grace = state.get("checkpoint_grace")
    if (now or view.status is None or view.status.phase != "running" or view.record is None or view.run_dir is None
            or state.get("phase") not in ("running", "winding down") or state.get("exit_code") is not None
            or not isinstance(grace, (int, float)) or isinstance(grace, bool)
            or view.batch.wind_down_argv(view.job_id) is None):
        return None
    return float(grace)


def _wind_down(view: JobView, rundir: RunDir) -> bool:
    """Mark the job as being cancelled, then signal its batch shell; False where it could not be told."""
    argv = view.batch.wind_down_argv(view.job_id)
    if argv is None:
        return False
    try:
        rundir.request_cancel()
        view.batch.run(argv)
    except (OSError, UserError):
        return False  # it ended meanwhile, or its directory is gone: cancelled as before
    return True


def _ended_within(view: JobView, seconds: float, poll: float) -> bool:
    """Whether the job leaves the running state within `seconds` (asked every `poll`)."""
    deadline = time.monotonic() + seconds
    while True:
        if refresh(view).finished:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll)


def cancel_follow_up(view: JobView) -> str | None:
    """Cancel the follow-up job a wind-down of this job submitted (state.json's `next_job`) if it has not
    ended: a cancelled sweep goes on in no job. Its id, or None where there was none to cancel."""
    job_id = (view.state or {}).get("next_job")
    if not isinstance(job_id, str):
        return None
    status = view.batch.status(check_job_id(job_id))
    if status is None or status.phase == "finished":
        return None
    view.batch.run(view.batch.cancel_argv(job_id))
    return job_id


# ------------------------------------------------------------------------------------------ its log


def log_files(view: JobView) -> list[Path]:
    """The job's output file, and its error file when separate."""
    if view.record is None:
        raise UserError(
            f"job {view.job_id} has no run directory, so its log paths are unknown; "
            "its job script's output directive says where they are"
        )
    log = view.record.get("log") or {}
    files = [Path(p) for p in (log.get("path"), log.get("error_path")) if p]
    if not files:
        raise UserError(f"job {view.job_id} ran on {view.record.get('host') or 'this machine'} outside a batch job "
                        "(`hpc-garage run`): its output went to the terminal that started it, not to a log file")
    return files


def logs(view: JobView, out: IO[bytes], *, follow: bool = False, poll: float = 0.5) -> None:
    """Copy the job's log to `out`; with `follow`, keep copying until the job has ended and the log is drained."""
    files = log_files(view)
    submitted = submission_time(view.record)  # a log older than that is an earlier job's, of the same id
    if not follow:
        fresh = [f for f in files if since_submission(f, submitted)]
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
            if not since_submission(f, submitted):
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
