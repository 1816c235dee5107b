"""A Prefect flow run as one batch job (the `hpc-garage` work pool), through `submit`'s own code.

The job variables are `submit`'s flags (`gpus_per_node` is `--gpus-per-node`), checked by the same rules:
a bad one is refused in one line before anything is created. The job is `submit`'s job script and run
directory, with COMMAND `python -m prefect.engine <flow run id>` (the worker names hpc-garage's guard around
it, prefect/flow_run.py, which runs nothing for a flow run that has ended) from the deployment's directory, and
the environment the worker hands the flow run (the API's address) exported in the script, so a follow-up
job (walltime, preemption) carries it too. Its secrets (the API's auth string or key, any variable named like
a password or token) are not: a job script is kept by the batch system (`scontrol write batch_script`,
accounting) and read by its staff. They go to a private file beside the flow run's claim, written before
sbatch/qsub; the script names the file ($HPC_GARAGE_SECRETS) and `run` reads it at its start into the
environment of the flow and its workers.

A flow run is submitted once, however often its worker dies: before sbatch/qsub the worker claims the flow
run in `<run root>/prefect-flow-runs/<flow run id>.json` (under a lock), and notes the job id there once
known. A worker that finds a claim with a job id follows that job; a claim without one whose worker is gone
(it died inside sbatch) is settled by asking the batch system for a job of the claimed name, which carries
the flow run's id. Nothing here imports Prefect: ids and names are plain strings.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.request import Request
from hpc_garage.core.request_options import OPTIONS as REQUEST_OPTIONS
from hpc_garage.files import locked, pid_alive, read_json, write_json
from hpc_garage.rundir import RunRoot
from hpc_garage.variables import SECRETS_ENV
from hpc_garage.schedulers.submission import (CANCEL_MARGIN, JobView, Prepared, adopt, find, next_job_of, prepare,
                                              refresh, run_roots, start_wind_down, submit)

__all__ = ["VARIABLES", "FlowRunJob", "Taken", "Busy", "request_of", "prepare_flow_run", "secrets_of",
           "secrets_file", "drop_secrets", "take", "claim_of", "job_of_dead_claim", "views", "cancel", "wind_down",
           "CANCEL_MARGIN", "ended", "next_job_of", "run_roots"]

logger = logging.getLogger(__name__)

CLAIMS = "prefect-flow-runs"  # under a site's run root: one <flow run id>.json per flow run taken on
MODULE = "prefect.engine"  # COMMAND: Prefect's own engine, given the flow run's id (unless the worker names another)
VARIABLES = tuple(option.name for option in REQUEST_OPTIONS)  # the work pool's job variables
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_NAME = re.compile(r"AUTH|KEY|PASSWORD|PASSWD|SECRET|TOKEN|CREDENTIAL|CONNECTION_URL", re.IGNORECASE)
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass(frozen=True)
class FlowRunJob:
    """What the worker knows of one flow run: its id and name, its job variables (already templated), the
    environment it hands the flow, the directory it runs in, and the sweep it belongs to by default."""

    flow_run_id: str
    flow_run_name: str
    values: Mapping[str, Any]
    env: Mapping[str, str | None]
    workdir: str
    default_sweep: str
    module: str = MODULE  # run as `python -m MODULE <flow run id>`

    @property
    def key(self) -> str:
        """The short id in the job's name: what finds a job whose id its dead submitter never noted. The id's
        last 12 hex digits: random in a UUIDv4 and a UUIDv7 alike, where the first 12 are a UUIDv7's
        millisecond clock, the same for the runs a schedule makes at once (two jobs of one name)."""
        return self.flow_run_id.replace("-", "")[-12:]


@dataclass(frozen=True)
class Taken:
    """The flow run's job: submitted now, or found (a restarted worker, a second poll)."""

    job_id: str
    site: str  # the site file (or name), for `find`
    fresh: bool  # submitted by this call
    log: str | None = None


class Busy(Exception):
    """Another live worker process is submitting this flow run right now."""


# ------------------------------------------------------------------------------------ the job variables


def request_of(values: Mapping[str, Any]) -> tuple[str, Request, str | None, bool]:
    """(site, request, sweep, resume) from the job variables, each checked; the rest is `prepare`'s."""
    unknown = sorted(set(values) - set(VARIABLES))
    if unknown:  # the configuration class lists exactly VARIABLES; a stray key means a template edited by hand
        raise UserError(f"job variable {unknown[0]!r} is not one of hpc-garage's ({', '.join(VARIABLES)}); "
                        "remove it from the work pool's template or the deployment's job_variables")
    site = values.get("site")
    if not isinstance(site, str) or not site.strip():
        raise UserError(f"job variable site is {'not set' if site in (None, '') else repr(site)}; give a site name "
                        "or file in the work pool's template or the deployment's job_variables, e.g. "
                        '{"site": "lab-gpu"} (`hpc-garage sites` lists them)')
    read: dict[str, Any] = {}
    for option in REQUEST_OPTIONS:  # each read as its row says (core/request_options.py)
        value = values.get(option.name)
        try:
            read[option.name] = option.read(value)
        except (TypeError, ValueError) as exc:
            raise UserError(f"job variable {option.name} {value!r}: {exc}") from None
    fields = {option.field: read[option.name] for option in REQUEST_OPTIONS
              if option.field and read[option.name] is not None}
    sweep, resume = read["sweep"], bool(read["resume"])
    return site.strip(), Request(**fields), sweep or None, resume


def job_name(job: FlowRunJob, asked: str | None) -> str:
    """The user's name (or `prefect`) and the flow run's short id: squeue shows whose job it is, and a
    restarted worker finds it by that name."""
    return f"{asked or 'prefect'}-{job.key}"


def prepare_flow_run(job: FlowRunJob) -> Prepared:
    """`submit`'s checks and job script, for COMMAND `python -m MODULE <id>`. Reads, never writes."""
    if not _UUID.fullmatch(job.flow_run_id):
        raise UserError(f"flow run id {job.flow_run_id!r} is not a UUID")
    site, request, sweep, resume = request_of(job.values)
    request = replace(request, job_name=job_name(job, request.job_name))
    if not os.path.isdir(job.workdir):
        raise UserError(f"the flow run's directory {job.workdir} does not exist here; deploy from a directory on "
                        "the shared filesystem (a path-based deployment)")
    prepared = prepare(site, os.path.join(job.workdir, "prefect-flow-run"), (), request, cwd=job.workdir,
                       must_exist=False, sweep=sweep or job.default_sweep, resume=resume)
    exports = []
    for key, value in sorted(job.env.items()):
        if value is None:
            continue
        if not _ENV_NAME.fullmatch(key):
            raise UserError(f"job variable env: {key!r} is not an environment variable name; use letters, digits "
                            "and _ (not first a digit)")
        if not _SECRET_NAME.search(key):
            exports.append(f"export {key}={shlex.quote(str(value))}")
    if secrets_of(job):
        exports.append(f"export {SECRETS_ENV}={shlex.quote(str(secrets_file(prepared.root, job.flow_run_id)))}")
    spec = replace(prepared.spec, script="-m", args=(job.module, job.flow_run_id),
                   setup=(*prepared.spec.setup, *exports))
    from hpc_garage.schedulers.jobscript import render

    return replace(prepared, spec=spec, script=render(spec))


def secrets_of(job: FlowRunJob) -> dict[str, str]:
    """The variables of the flow run's environment that no job script may hold."""
    return {k: str(v) for k, v in job.env.items() if v is not None and _SECRET_NAME.search(k)}


def secrets_file(root: Path, flow_run_id: str) -> Path:
    """Where the flow run's secrets wait for its jobs (a follow-up job too): beside its claim, private."""
    return root / CLAIMS / f"{flow_run_id}.secrets.json"


def drop_secrets(flow_run_id: str, roots: Sequence[RunRoot] | None = None) -> None:
    """The flow run is final and its last job has ended: its secrets leave the disk (no later job reads them)."""
    if _UUID.fullmatch(flow_run_id):
        for root in run_roots() if roots is None else roots:
            secrets_file(root.path, flow_run_id).unlink(missing_ok=True)


def _write_secrets(job: FlowRunJob, prepared: Prepared) -> None:
    if secrets := secrets_of(job):
        write_json(secrets_file(prepared.root, job.flow_run_id), secrets)


# ---------------------------------------------------------------------------------- submitting once


def claims_dir(prepared: Prepared) -> Path:
    return RunRoot.of_site(prepared.site).path / CLAIMS


def take(job: FlowRunJob, prepared: Prepared) -> Taken:
    """Submit the flow run's job, unless it was submitted already (then that job); see the module's text."""
    from hpc_garage.schedulers import get

    site = str(prepared.site.path or prepared.site.name)
    claims = claims_dir(prepared)
    claims.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = claims / f"{job.flow_run_id}.json"
    with locked(claims / ".lock"):
        claim = read_json(path)
        if claim and claim.get("job_id"):
            return Taken(str(claim["job_id"]), claim.get("site") or site, fresh=False)
        if claim:
            if _claimer_alive(claim):
                raise Busy(f"flow run {job.flow_run_id} is being submitted by process {claim['pid']}")
            found = get(prepared.spec.scheduler).jobs_named(str(claim.get("job_name")))
            if found:  # its submitter died after sbatch took the job, before it noted the id (or recorded it)
                _write_secrets(job, prepared)
                adopted = adopt(prepared, found[0])
                write_json(path, {**claim, "job_id": found[0], "run_dir": str(adopted.run_dir), "found": time.time()})
                logger.info("flow run %s: job %s of its dead worker found in the queue", job.flow_run_id, found[0])
                return Taken(found[0], claim.get("site") or site, fresh=False, log=adopted.log)
        _write_secrets(job, prepared)  # before sbatch: the job may start at once
        write_json(path, {"flow_run": job.flow_run_id, "job_name": prepared.spec.job_name, "site": site,
                          "host": socket.gethostname(), "pid": os.getpid(), "claimed": time.time()})
        try:
            done = submit(prepared, hidden=secrets_of(job))
        except BaseException:
            path.unlink(missing_ok=True)  # nothing was submitted (submit undoes a job it took)
            raise
        write_json(path, {**(read_json(path) or {}), "job_id": done.job_id, "run_dir": str(done.run_dir),
                          "submitted": time.time()})
    return Taken(done.job_id, site, fresh=True, log=done.log)


def job_of_dead_claim(flow_run_id: str, claim: Mapping[str, Any],
                      roots: Sequence[RunRoot] | None = None) -> dict[str, Any] | None:
    """A claim whose worker died after sbatch took the job and before it noted the job's id, while the job
    already runs the flow (so no `take` comes to settle it): the claim with that job, found in the queue by
    the claim's job name, and noted in the claim's file. None while its worker lives, or with no such job."""
    from hpc_garage.schedulers import get
    from hpc_garage.sites import load_site

    if _claimer_alive(claim) or not claim.get("job_name"):
        return None  # its worker notes the job itself
    found = get(load_site(str(claim.get("site") or "")).scheduler).jobs_named(str(claim["job_name"]))
    if not found:
        return None
    for root in run_roots() if roots is None else roots:
        if (path := root.path / CLAIMS / f"{flow_run_id}.json").exists():
            with locked(path.parent / ".lock"):
                write_json(path, {**(read_json(path) or claim), "job_id": found[0], "found": time.time()})
            break
    logger.info("flow run %s: job %s of its dead worker found in the queue, running the flow", flow_run_id, found[0])
    return {**claim, "job_id": found[0]}


def _claimer_alive(claim: Mapping[str, Any]) -> bool:
    """The worker (another process of this host) that wrote the claim still lives: it notes the job itself."""
    pid = int(claim.get("pid") or 0)
    return bool(pid) and pid != os.getpid() and claim.get("host") == socket.gethostname() and pid_alive(pid)


def claim_of(flow_run_id: str, roots: Sequence[RunRoot] | None = None) -> dict[str, Any] | None:
    """The claim a worker left for this flow run, under any visible site's run root."""
    if not _UUID.fullmatch(flow_run_id):
        return None
    for root in run_roots() if roots is None else roots:
        if (claim := read_json(root.path / CLAIMS / f"{flow_run_id}.json")) is not None:
            return claim
    return None


# ------------------------------------------------------------------------------------ following jobs


def views(jobs: Mapping[str, str]) -> dict[str, JobView]:
    """{job id: site} to refreshed JobViews, each batch system asked once for all its jobs."""
    found = {job_id: find(job_id, site) for job_id, site in jobs.items()}
    for scheduler in {v.batch.name for v in found.values()}:
        mine = [v for v in found.values() if v.batch.name == scheduler]
        answers = mine[0].batch.statuses([v.job_id for v in mine])
        for v in mine:
            refresh(v, answers.get(v.job_id))
    return found


def cancel(job_id: str, site: str) -> bool:
    """scancel/qdel the job if it is still queued or running; whether it was."""
    view = refresh(find(job_id, site))
    if view.finished:
        return False
    view.batch.run(view.batch.cancel_argv(job_id))
    return True


def wind_down(job_id: str, site: str) -> float | None:
    """A Prefect cancel of a running flow run: wind its job down as `hpc-garage cancel` does; the seconds its
    trials get (the worker cancels the job CANCEL_MARGIN after them), or None where it cannot wind down."""
    return start_wind_down(refresh(find(job_id, site)))


def ended(view: JobView) -> str:
    """How a job ended, for a flow run's Crashed message: `job 12 ended (CANCELLED, exit 0)`."""
    status = view.status
    state = status.state if status is not None else "left the queue"
    code = view.exit_code
    return f"job {view.job_id} ended ({state}{f', exit {code}' if code is not None else ''})"
