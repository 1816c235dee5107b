"""`hpc-garage doctor --job`: one short job of one node, submitted as `hpc-garage submit` submits, whose
COMMAND (doctor/probe.py) looks from inside the allocation; then its findings, judged here.

Before submitting, a token file is written in the site's results directory; the probe reads it on the
compute node and writes a reply beside it, so that both directions of the shared storage are checked. The
job's sweep is always `hpc-garage-doctor` (one folder in the results directory, an epoch per doctor run).
`judge` is pure: the findings (doctor.json), what the login node knows, and the job's end give the lines.
"""

from __future__ import annotations

import json
import secrets
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core.errors import UserError
from hpc_garage.doctor.checks import Check, judge_versions, site_file
from hpc_garage.doctor.probe import REPLY_SUFFIX, TOKEN_PREFIX, versions
from hpc_garage.rundir import RunDir

if TYPE_CHECKING:
    from hpc_garage.core.site import Site

SWEEP = "hpc-garage-doctor"
JOB_NAME = "hpc-garage-doctor"
WALLTIME = 600  # seconds; less where the site allows less
RUN_ERROR = "hpc-garage: error:"  # how `hpc-garage run` (any command) says why it refused, in the job's log


def probe_script() -> Path:
    """The job's SCRIPT: jobscripts/doctor_probe.py, shipped with hpc-garage."""
    from hpc_garage.sites.files import packaged_dir

    return packaged_dir("jobscripts") / "doctor_probe.py"


@dataclass(frozen=True)
class JobEnd:
    """How the probe's job ended, as the login node learns it."""

    job_id: str
    exit_code: int
    log: str  # the log's path
    said: str = ""  # the log's last word from `hpc-garage run` (why the workers did not come, say)


def job_checks(site: Site, say: Callable[[str], None]) -> Iterator[Check]:
    """Submit the probe, follow it until it ends, and give one line per thing it checked."""
    from hpc_garage.core.request import Request
    from hpc_garage.files import write_private
    from hpc_garage.schedulers import submission
    from hpc_garage.sweeps import results_root

    root = results_root(site.results_directory, site.run_directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)  # the default one: the first sweep would make it anyway
    token = secrets.token_hex(8)
    token_file = root / f"{TOKEN_PREFIX}{token}"
    reply = token_file.with_name(token_file.name + REPLY_SUFFIX)
    write_private(token_file, token)
    try:
        where = str(site.path or site.name)
        walltime = min(WALLTIME, site.walltime, site.limits.max_walltime or WALLTIME)
        jobqueue = site.launcher == "jobqueue"  # its driver job is one node; its worker jobs are the site's shape
        prepared = submission.prepare(where, str(probe_script()), ["--site", where, "--token", token],
                                      Request(nodes=None if jobqueue else 1, walltime=walltime, job_name=JOB_NAME),
                                      sweep=SWEEP)
        done = submission.submit(prepared)
        say(f"doctor: submitted job {done.job_id} (one node of site {site.name}); log: {done.log}")
        view = submission.find(done.job_id, where)
        try:
            code = submission.wait(view, lambda text: say(f"doctor: {text}"))
        except KeyboardInterrupt:
            say(submission.cancel(view, now=True))  # a probe has no trials to checkpoint
            raise
        findings = _read(RunDir(done.run_dir).doctor_file)
        end = JobEnd(done.job_id, code, done.log, _run_said(Path(done.log)))
        seen_reply = _text(reply) is not None
        yield from judge(site, findings, end, versions(), login_root=str(root), reply_seen=seen_reply)
    finally:
        token_file.unlink(missing_ok=True)
        reply.unlink(missing_ok=True)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _run_said(log: Path) -> str:
    """The last error `hpc-garage run` wrote to the job's log, else its last line of its own, else the log's
    last line (a traceback's last line says what failed)."""
    every = [ln.strip() for ln in (_text(log) or "").splitlines() if ln.strip()]
    lines = [ln for ln in every if ln.startswith("hpc-garage:")]
    errors = [ln for ln in lines if ln.startswith(RUN_ERROR)]
    return (errors or lines or every or [""])[-1][:400]


# ------------------------------------------------------------------------------------------- judging


def judge(site: Site, findings: dict[str, Any] | None, end: JobEnd, here: Mapping[str, str | None], *,
          login_root: str, reply_seen: bool) -> Iterator[Check]:
    """One line per thing the probe checked (pure)."""
    logs = f"`hpc-garage logs {end.job_id}`"
    if findings is None:
        refused = end.said.removeprefix(RUN_ERROR).strip() if end.said.startswith(RUN_ERROR) else None
        if refused is not None:  # `run` refused in one line, with its fix (its own check of the results directory)
            name = "results directory" if "results_directory" in refused else "job"
            yield Check.fail(name, f"job {end.job_id} stopped before the probe ran: {refused}")
            return
        said = f": {end.said}" if end.said else ""
        yield Check.fail("job", f"job {end.job_id} ended (exit {end.exit_code}) before the probe ran{said}",
                         f"read its log ({logs}): the job script, the site's setup lines or `hpc-garage run` failed")
        return
    host = findings.get("host") or "the compute node"
    yield Check("job", f"job {end.job_id} ran the probe on {host}")
    yield _results(site, findings.get("results") or {}, findings.get("worker_facts") or [], host, login_root,
                   reply_seen)
    yield judge_versions("job python", f"the job's python ({findings.get('python')} on {host})",
                         findings.get("versions"), here, str(findings.get("python")), site)
    if (iface := findings.get("interface")) is not None:
        yield _interface(site, iface, host)
    workers = _workers(findings.get("workers") or {}, end, logs)
    yield workers
    if workers.failed:
        return
    facts = findings.get("worker_facts") or []
    expected = findings.get("expected") or {}
    if any(s.node.gpus for s in site.pool_sites().values()):
        yield gpu_pins(facts, expected, site)
        yield _libraries(facts, site.node.gpu_vendor)
    if site.mpi.launch == "dask-mpi" and site.launcher != "jobqueue":
        yield mpi_ranks(findings.get("mpi") or [], len(facts))


def _results(site: Site, results: Mapping[str, Any], facts: list[dict[str, Any]], host: str, login_root: str,
             reply_seen: bool) -> Check:
    """The token the login node wrote is seen on the compute node (by the probe and every worker), and the
    reply the probe wrote is seen here."""
    root = results.get("root") or "?"
    fix = f"point results_directory in {site_file(site)} at storage that every node shares"
    there = root if root == login_root else f"{root} (here: {login_root})"
    if not results.get("seen"):
        seen = (f"{there} on {host} does not hold the file the doctor wrote in it here" if results.get("exists")
                else f"{there} does not exist on {host}")
        return Check.fail("results directory", f"{seen}: the compute node does not see this storage", fix)
    blind = sorted({f"{f.get('name')} on {f.get('host')}" for f in facts if f.get("token_seen") is None})
    if blind:
        return Check.fail("results directory", f"{there} does not hold the doctor's file for worker "
                          f"{', '.join(blind)}: not every node sees this storage", fix)
    if not results.get("wrote"):
        return Check.fail("results directory", f"{there} is visible on {host} but not writable there "
                          f"({results.get('write_error')})", fix)
    if not reply_seen:
        return Check.fail("results directory", f"the file the job wrote in {there} on {host} is not seen here: "
                          "the login node does not see what the compute node writes", fix)
    return Check("results directory", f"{there} is shared: {host} sees what this node writes, and back")


def _interface(site: Site, iface: Mapping[str, Any], host: str) -> Check:
    if iface.get("present"):
        return Check("interface", f"{iface.get('name')} exists on {host}")
    have = ", ".join(iface.get("have") or []) or "none"
    return Check.fail("interface", f"{iface.get('name')} does not exist on {host} (it has {have})",
                      f"set interface in {site_file(site)} to one of them")


def _workers(workers: Mapping[str, Any], end: JobEnd, logs: str) -> Check:
    if error := workers.get("error"):
        said = f"; `hpc-garage run` said: {end.said.removeprefix(RUN_ERROR).strip()}" if end.said else ""
        return Check.fail("workers", f"{error}{said}", f"read the job's log ({logs}) for why")
    expected, registered = list(workers.get("expected") or []), list(workers.get("registered") or [])
    missing = sorted(set(expected) - set(registered))
    if missing:
        return Check.fail("workers", f"{len(registered)} of {len(expected)} workers registered; missing "
                          f"{', '.join(missing)}", f"read the job's log ({logs}) for why")
    waited = workers.get("waited")
    took = f" within {waited:.1f} s of the probe's start" if isinstance(waited, (int, float)) else ""
    return Check("workers", f"{len(registered)} of {len(expected)} registered{took}")


def gpu_pins(facts: list[dict[str, Any]], expected: Mapping[str, Any], site: Site) -> Check:
    """Each worker sees exactly the GPUs its layout gives it: no more, none of another worker's on its node,
    only GPUs the job was given."""
    fix = (f"take CUDA_VISIBLE_DEVICES and the like out of the env and setup lines of {site_file(site)}; "
           "if they hold none, report it with this line")
    plans = expected.get("workers") or {}
    job = list(expected.get("job_gpus") or [])
    problems = []
    for f in facts:
        name, ids = str(f.get("name")), list(f.get("gpus") or [])
        plan = plans.get(name) or {}
        if plan.get("gpus") is not None and ids != plan["gpus"]:
            problems.append(f"worker {name} sees GPU {','.join(ids) or 'none'}, its pin is "
                            f"{','.join(plan['gpus']) or 'none'}")
        elif plan and len(ids) != plan.get("slots"):
            problems.append(f"worker {name} sees {len(ids)} GPUs, its layout gives it {plan.get('slots')}")
        elif job and expected.get("host") == f.get("host") and not set(ids) <= set(job):
            problems.append(f"worker {name} sees GPU {','.join(ids)}, which the job was not given "
                            f"({','.join(job)})")
    shared = Counter((f.get("host"), gpu) for f in facts for gpu in f.get("gpus") or [])
    problems += [f"GPU {gpu} on {host} is seen by {n} workers" for (host, gpu), n in sorted(shared.items()) if n > 1]
    if problems:
        return Check.fail("gpu pins", "; ".join(problems), fix)
    pins = ", ".join(f"{f.get('name')}={','.join(f.get('gpus') or []) or 'none'}"
                     for f in sorted(facts, key=lambda f: str(f.get("name"))))
    given = f" (the job was given {','.join(job)})" if job else ""
    return Check("gpu pins", f"each worker sees its own GPUs: {pins}{given}")


def _libraries(facts: list[dict[str, Any]], vendor: str) -> Check:
    """What the workers' GPU library could read: informative (the report's GPU figures come from it)."""
    said = Counter(str((f.get("library") or {}).get("text")) for f in facts)
    text = "; ".join(f"{t}" + (f" ({n} workers)" if n > 1 else "") for t, n in said.items()) or "no worker said"
    return Check.note("gpu library", f"{vendor} in the workers: {text}")


def mpi_ranks(ranks: list[dict[str, Any]], workers: int) -> Check:
    """dask-mpi: each worker's rank (its Nanny's process) has MPI initialised, ranks distinct, one world."""
    fix = "read the job's log; MPI_Init failing under srun means mpi.srun_args needs --mpi=pmix (or the like)"
    down = [f"{r.get('name') or r.get('host')} ({r.get('why') or 'not initialised'})"
            for r in ranks if not r.get("initialised")]
    if not ranks:
        return Check.fail("mpi", "no dask-mpi rank answered", fix)
    if down:
        return Check.fail("mpi", f"MPI is not initialised in {', '.join(down)}", fix)
    numbers = [int(r.get("rank", -1)) for r in ranks]
    sizes = {int(r.get("size", -1)) for r in ranks}
    if len(set(numbers)) != len(numbers) or len(sizes) != 1:
        return Check.fail("mpi", f"the ranks do not form one world (ranks {numbers}, sizes {sorted(sizes)}): "
                          "each was started as a world of its own", fix)
    if len(ranks) != workers:
        return Check.fail("mpi", f"{len(ranks)} ranks answered for {workers} workers", fix)
    return Check("mpi", f"{len(ranks)} ranks initialised MPI (ranks {', '.join(map(str, sorted(numbers)))} "
                 f"of a world of {sizes.pop()})")


def probe_site(site: Site) -> None:
    """Refuse a site no job can be submitted to (before anything is written)."""
    from hpc_garage.schedulers import get

    if not get(site.scheduler).takes_jobs:
        raise UserError(f"site {site.name} is local: --job submits a batch job; give a SLURM or PBS site "
                        "(`hpc-garage sites` lists them)")
    if site.launcher == "jobqueue" and site.jobqueue.driver == "login":
        raise UserError(f"site {site.name} runs its driver on the login node (jobqueue.driver: login): --job "
                        "checks a job's own allocation; run it on a site with driver: job")
