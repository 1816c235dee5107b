"""Where jobs run: the run root (`RunRoot`, every job's run directory in it as `<run root>/<job id>/`) and one
job's run directory (`RunDir`, 0700): every name in it, what a new job clears, its JSON.

As submitit's `JobPaths` owns a job folder, `RunDir` owns this one: nobody else spells a name in it, so what a
job leaves there, who reads it, and what a later job with the same id must not see are decided in one place.
`RunRoot` owns the folder above: where a site puts it, how a job's directory is named, which are jobs', and
which of several roots holds a job; nobody else joins a root and a job id.

    name                  written by                                         read by
    submit.json           `submit`: what was asked, the log, when            status, wait, logs, resubmit, run
    job.sh                `submit`: the job script as submitted              the follow-up job, `--resume`
    state.json            `run`: phase, workers, progress, exit code         status, wait, COMMAND's wait
    scheduler.json        `run`, once the workers are up: the handoff        COMMAND (cluster/handoff.py)
    dask-scheduler.json   Dask's scheduler                                   node processes, dask-mpi ranks
    tls/cert.pem, key.pem `run`: this job's TLS credentials                  scheduler, workers, COMMAND
    ranks.json            the mpi and dask-mpi launchers                     node processes, ranks
    dask-mpi-ranks/       each dask-mpi rank: started/, failed/              the dask-mpi launcher
    jobqueue-<pool>.json  the jobqueue launcher (holds the API's secrets)    that pool's worker jobs
    worker-jobs.json      the jobqueue launcher: worker jobs and events      people
    worker-logs/          worker jobs: `<job name>-<job id>.out` (SLURM)     people, the jobqueue launcher
    flow-runs             the task runner: COMMAND's flow runs, one a line   run (crash marking), progress
    report.json           `run` as COMMAND ends                              `hpc-garage report`
    metrics/              the flow (prefect/metrics.py): trials.json, the    status, report, Prefect
                          trials' reports (`<trial>.jsonl`), 0700            artifacts (cluster/artifacts.py)
    search.json           `hpc_garage.search`: its best, counts, GPU-hours   status, report
    doctor.json           `doctor --job`'s probe: what it found in the job   `hpc-garage doctor`
    cancel-requested      `cancel`, before it signals the job (no follow-up) `run`'s wind-down
    unrecorded.json       the flow, when Prefect's API died: what it lacks   `hpc-garage replay`
    unrecorded/           the flow and each worker, when the API died:       `hpc-garage replay`
                          events-<host>-<pid>.jsonl, logs-<host>-<pid>.jsonl,
                          flow-runs.json (the flow runs' kept states),
                          replayed.json (what replay sent)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpc_garage.files import append_private, expand_path, read_json, write_json, write_private
from hpc_garage.variables import RUN_DIR_ENV

if TYPE_CHECKING:
    from hpc_garage.core.site import Site

SUBMIT_FILE = "submit.json"
SCRIPT_FILE = "job.sh"
STATE_FILE = "state.json"
SCHEDULER_FILE = "scheduler.json"
DASK_SCHEDULER_FILE = "dask-scheduler.json"
TLS_DIR = "tls"
CERT_FILE = "cert.pem"
KEY_FILE = "key.pem"
RANKS_FILE = "ranks.json"
RANK_RECORDS_DIR = "dask-mpi-ranks"
WORKER_FILE_PREFIX = "jobqueue-"
WORKER_JOBS_FILE = "worker-jobs.json"
WORKER_LOG_DIR = "worker-logs"
FLOW_RUNS_FILE = "flow-runs"
REPORT_FILE = "report.json"
METRICS_DIR = "metrics"  # private (0700): what the trials reported (prefect/metrics.py writes it)
METRICS_SUMMARY_FILE = "trials.json"  # in METRICS_DIR
SEARCH_SUMMARY_FILE = "search.json"  # hpc_garage.search: the study's best, counts, GPU-hours (tuning/leaderboard.py)
DOCTOR_FILE = "doctor.json"
CANCEL_FILE = "cancel-requested"  # private to `cancel` and `run`: this start of the job is being cancelled
UNRECORDED_FILE = "unrecorded.json"
UNRECORDED_DIR = "unrecorded"
KEPT_SUFFIX = ".jsonl"  # in UNRECORDED_DIR: <kind>-<host>-<pid>.jsonl, kind events or logs
KEPT_FLOW_STATES_FILE = "flow-runs.json"  # in UNRECORDED_DIR
REPLAYED_FILE = "replayed.json"  # in UNRECORDED_DIR

# One run's cluster (its address, its keys, what its nodes read): `run` removes it as it ends and a new run clears
# it as it starts (the last may have been killed), so COMMAND never reaches a cluster that is gone, nor anyone its keys.
HANDOFF = (SCHEDULER_FILE, DASK_SCHEDULER_FILE, TLS_DIR, RANKS_FILE)
# What one job's run wrote: kept across a requeue (replay needs its first start's), cleared where it predates the
# submission (an earlier job of a recycled id: ids wrap, or restart at 1 when a controller loses its state).
EARLIER_RUN = (FLOW_RUNS_FILE, UNRECORDED_FILE, UNRECORDED_DIR, REPORT_FILE, METRICS_DIR, SEARCH_SUMMARY_FILE,
               DOCTOR_FILE, WORKER_LOG_DIR)
# The rest stays: submit.json, job.sh (this job's); state.json, worker-jobs.json (rewritten; status skips an older one).

CLOCK_SLACK = 5.0  # seconds: a file older than the submission (minus this) is an older job's


def submission_time(record: Mapping[str, Any] | None) -> float | None:
    """When a job was submitted, less CLOCK_SLACK, from its submit.json `record`; None: hpc-garage did not."""
    submitted = (record or {}).get("submitted")
    return float(submitted) - CLOCK_SLACK if isinstance(submitted, (int, float)) else None


def since_submission(written: float | Path, submitted: float | None) -> bool:
    """Whether a file (by its mtime; False where it does not exist) or a record's own time stamp is this job's:
    written since `submitted` (submission_time's; None: anything is). The one check of a recycled job id."""
    try:
        stamp = written.stat().st_mtime if isinstance(written, Path) else written
    except OSError:
        return False
    return submitted is None or stamp >= submitted


class Published(Protocol):
    """What `publish` writes: cluster/handoff.py's Handoff (a layer up, so named by its shape)."""

    def to_json(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class RunRoot:
    """The folder of every job's run directory. Other things live beside them (the work pool's claims, the
    default results root): a job's directory is the one whose submit.json records its name as the job's id."""

    path: Path

    @classmethod
    def of(cls, run_directory: str | Path) -> RunRoot:
        """A site's `run_directory` as a path here: `~` and variables expanded."""
        return cls(expand_path(run_directory))

    @classmethod
    def of_site(cls, site: Site) -> RunRoot:
        return cls.of(site.run_directory)

    @classmethod
    def default(cls) -> RunRoot:
        """Where a site that names none keeps its runs."""
        from hpc_garage.core.site_values import DEFAULT_RUN_DIRECTORY

        return cls.of(DEFAULT_RUN_DIRECTORY)

    def run_dir(self, job_id: str) -> RunDir:
        """Job `job_id`'s run directory (whether it exists or not); an id that is not one name is refused."""
        if not job_id or job_id in (".", "..") or "/" in job_id or "\0" in job_id:
            raise ValueError(f"{job_id!r} is not a job id")
        return RunDir(self.path / job_id)

    def submitted(self, job_id: str) -> tuple[RunDir, dict[str, Any]] | None:
        """Job `job_id`'s run directory and submit.json, where hpc-garage submitted it from this root."""
        rundir = self.run_dir(job_id)
        record = rundir.submit_record()
        return (rundir, record) if record is not None and record.get("job_id") == job_id else None

    def jobs(self) -> Iterator[tuple[RunDir, dict[str, Any]]]:
        """(run directory, submit.json) of every job hpc-garage submitted from this root, in any order."""
        for file in self.path.glob(f"*/{SUBMIT_FILE}") if self.path.is_dir() else []:
            if (found := self.submitted(file.parent.name)) is not None:
                yield found


def newest_submitted(job_id: str, roots: Iterable[RunRoot]) -> tuple[RunDir, dict[str, Any]] | None:
    """Job `job_id` as hpc-garage submitted it from one of `roots`: the newest, where ids were recycled."""
    found = [hit for root in roots if (hit := root.submitted(job_id)) is not None]
    return max(found, key=lambda hit: hit[1].get("submitted") or 0) if found else None


def first_run_dir(job_id: str, roots: Iterable[RunRoot], holding: str | None = None) -> RunDir | None:
    """The first of `roots` with a run directory of `job_id` (holding the file `holding`, where given): a `run`
    on a login node or in a job written by hand has one, with no submit.json."""
    for root in roots:
        rundir = root.run_dir(job_id)
        if (rundir.path / holding).exists() if holding else rundir.path.is_dir():
            return rundir
    return None


@dataclass(frozen=True)
class RunDir:
    """The run directory of one job; every path in it."""

    path: Path

    @property
    def job_id(self) -> str:
        return self.path.name

    @property
    def root(self) -> RunRoot:
        """The run root it is in: where the job's follow-ups and the other jobs of its sweep have theirs."""
        return RunRoot(self.path.parent)

    @classmethod
    def of_this_run(cls, env: Mapping[str, str] | None = None) -> RunDir | None:
        """The one `run` gave COMMAND (and so its flow) through $HPC_GARAGE_RUN_DIR; None outside `run`."""
        path = (os.environ if env is None else env).get(RUN_DIR_ENV)
        return cls(Path(path)) if path else None

    # ---- its life

    def create(self, submitted: float | None = None) -> RunDir:
        """Make the directory private, and clear what an earlier job with the same id left: the handoff always,
        EARLIER_RUN where it predates `submitted` (a requeued job keeps what its first start left for replay)."""
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.path, 0o700)
        self.clear_handoff()
        _remove(self.path / CANCEL_FILE)  # asked of an earlier start of this job (or an earlier job of its id)
        for name in EARLIER_RUN:
            if not since_submission(self.path / name, submitted):
                _remove(self.path / name)
        return self

    def clear_handoff(self) -> None:
        """The run's cluster is gone (or about to be): nothing may find it, nor its keys."""
        for name in HANDOFF:
            _remove(self.path / name)

    def submitted_at(self) -> float | None:
        """submission_time of this job's submit.json: what in it is older is an earlier job's (since_submission)."""
        return submission_time(self.submit_record())

    # ---- what `submit` leaves

    @property
    def submit_file(self) -> Path:
        return self.path / SUBMIT_FILE

    @property
    def script_file(self) -> Path:
        return self.path / SCRIPT_FILE

    def submit_record(self) -> dict[str, Any] | None:
        return read_json(self.submit_file)

    def write_submit_record(self, record: dict[str, Any]) -> None:
        write_json(self.submit_file, record, indent=2)

    # ---- what `run` keeps up to date

    @property
    def state_file(self) -> Path:
        return self.path / STATE_FILE

    def state(self) -> dict[str, Any] | None:
        return read_json(self.state_file)

    def write_state(self, data: dict[str, Any]) -> None:
        write_json(self.state_file, data)

    @property
    def report_file(self) -> Path:
        return self.path / REPORT_FILE

    @property
    def doctor_file(self) -> Path:
        return self.path / DOCTOR_FILE

    # ---- what the trials report (trial.report)

    @property
    def metrics_dir(self) -> Path:
        return self.path / METRICS_DIR

    @property
    def metrics_summary(self) -> Path:
        """trials.json: each reporting trial's last and best values, state; the best trial; counts."""
        return self.metrics_dir / METRICS_SUMMARY_FILE

    @property
    def search_summary(self) -> Path:
        """search.json: the search's (hpc_garage.search) best trial, its counts, GPU-hours against its budget."""
        return self.path / SEARCH_SUMMARY_FILE

    def trial_metrics(self, trial_id: str) -> Path:
        """One trial's reports, a JSON line each; the id made a safe file name (a key or a task run id is one)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", trial_id).lstrip(".") or "_"
        return self.metrics_dir / f"{safe}.jsonl"

    # ---- `cancel` asks the running job to wind down first

    def request_cancel(self) -> None:
        """Mark this job as being cancelled, before the signal that winds it down: `run` then submits no
        follow-up job and ends as a cancelled job."""
        write_private(self.path / CANCEL_FILE, f"{time.time():.0f}\n")

    def cancel_requested(self) -> bool:
        return (self.path / CANCEL_FILE).exists()

    # ---- the handoff and its cluster

    @property
    def scheduler_file(self) -> Path:
        return self.path / SCHEDULER_FILE

    @property
    def dask_scheduler_file(self) -> Path:
        return self.path / DASK_SCHEDULER_FILE

    @property
    def ranks_file(self) -> Path:
        return self.path / RANKS_FILE

    @property
    def rank_records(self) -> Path:
        return self.path / RANK_RECORDS_DIR

    @property
    def tls_dir(self) -> Path:
        return self.path / TLS_DIR

    def write_credentials(self) -> dict[str, str]:
        """Fresh TLS credentials for this job only; returns the file paths as Security keyword arguments."""
        from distributed.security import Security

        temporary = Security.temporary()
        self.tls_dir.mkdir(mode=0o700, exist_ok=True)
        write_private(self.tls_dir / CERT_FILE, temporary.tls_ca_file)
        write_private(self.tls_dir / KEY_FILE, temporary.tls_client_key)
        return self.credential_paths()

    def credential_paths(self) -> dict[str, str]:
        """Where `write_credentials` puts them, as Security keyword arguments: known before they exist, so
        workers and COMMAND can be started while the credentials (and the scheduler) are made."""
        cert, key = str(self.tls_dir / CERT_FILE), str(self.tls_dir / KEY_FILE)
        return {"tls_ca_file": cert, "tls_client_cert": cert, "tls_client_key": key, "tls_scheduler_cert": cert,
                "tls_scheduler_key": key, "tls_worker_cert": cert, "tls_worker_key": key}

    def publish(self, handoff: Published) -> Path:
        """Write scheduler.json: the cluster is ready."""
        write_json(self.scheduler_file, handoff.to_json(), indent=2)
        return self.scheduler_file

    # ---- the jobqueue launcher's

    def worker_file(self, pool: str) -> Path:
        """What a worker job of `pool` reads at start-up."""
        return self.path / f"{WORKER_FILE_PREFIX}{pool}.json"

    def worker_files(self) -> Iterator[Path]:
        return self.path.glob(f"{WORKER_FILE_PREFIX}*.json")

    @property
    def worker_jobs_file(self) -> Path:
        return self.path / WORKER_JOBS_FILE

    @property
    def worker_logs(self) -> Path:
        return self.path / WORKER_LOG_DIR

    def worker_log(self, job_name: str, job_id: str) -> Path:
        """A worker job's log, as schedulers/slurm.py names it (`%x-%j.out` in worker_logs)."""
        return self.worker_logs / f"{job_name}-{job_id}.out"

    # ---- the flow's records

    @property
    def flow_runs_file(self) -> Path:
        return self.path / FLOW_RUNS_FILE

    def flow_runs(self) -> list[str]:
        """The flow runs COMMAND noted (`note_flow_run`), each once, in order."""
        try:
            lines = self.flow_runs_file.read_text().splitlines()
        except OSError:
            return []
        return list(dict.fromkeys(line.strip() for line in lines if line.strip()))

    @property
    def unrecorded_file(self) -> Path:
        return self.path / UNRECORDED_FILE

    @property
    def unrecorded_dir(self) -> Path:
        return self.path / UNRECORDED_DIR

    def kept_file(self, kind: str, process: str) -> Path:
        """Where process `process` (host-pid) keeps the `kind` ("events", "logs") the API did not get."""
        return self.unrecorded_dir / f"{kind}-{process}{KEPT_SUFFIX}"

    def kept_files(self) -> list[tuple[str, Path]]:
        """(kind, file) of every process's kept records, in name order."""
        return [(path.name.split("-", 1)[0], path) for path in sorted(self.unrecorded_dir.glob(f"*{KEPT_SUFFIX}"))]

    @property
    def kept_flow_states_file(self) -> Path:
        return self.unrecorded_dir / KEPT_FLOW_STATES_FILE

    @property
    def replayed_file(self) -> Path:
        return self.unrecorded_dir / REPLAYED_FILE


def note_flow_run(flow_run_id: str, env: Mapping[str, str] | None = None) -> None:
    """Under `hpc-garage run`: say which flow run COMMAND started, so that `run` can set it Crashed if COMMAND
    is killed before Prefect could (even before any trial finished). Bookkeeping: never fails the flow."""
    rundir = RunDir.of_this_run(env)
    if rundir is None:
        return
    with contextlib.suppress(OSError):
        append_private(rundir.flow_runs_file, [flow_run_id])


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
