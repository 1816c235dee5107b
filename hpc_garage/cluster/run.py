"""`hpc-garage run -- COMMAND`: bring a Dask cluster up for this job, hand it to COMMAND, take it down.

Inside a SLURM or PBS job the workers are hosted by one process per node of the allocation (launchers/mpi.py);
on a login node they are local processes shaped like one node of the site; on a `launcher: jobqueue` site they
are worker jobs of their own (launchers/jobqueue.py), wherever `run` runs. Either way the scheduler runs here,
in this process (so it never takes a GPU worker's place). COMMAND starts with the workers, so that its imports
overlap theirs, and finds the cluster through $HPC_GARAGE_SCHEDULER_FILE, which appears only once every worker
has registered; `run` exits with COMMAND's exit code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hpc_garage.compat import quiet_expected_closes
from hpc_garage.core.errors import UserError
from hpc_garage.cluster.handoff import Handoff
from hpc_garage.cluster.node_loss import NodeWatch
from hpc_garage.cluster import dask_scheduler
from hpc_garage.cluster.command import command_exit, end_command, on_signals, start_command, stop_on_signals
from hpc_garage.launchers.common import (Launcher, Preload, cluster_settings, dask_environment, listening_host,
                                        profiler_settings, worker_preload)
from hpc_garage.core.layout import Layout, layout
from hpc_garage.cluster.sweep import RunSweep, join_sweep
from hpc_garage.cluster.prefect_cancel import PrefectCancel
from hpc_garage.cluster.wind_down import WindDown
from hpc_garage.core.site import Site
from hpc_garage.prefect_api import PrefectApi, no_proxy_for, server_host
from hpc_garage import log
from hpc_garage.rundir import RunDir, RunRoot
from hpc_garage.variables import (JOB_ID_ENV, RUN_DIR_ENV, SCHEDULER_FILE_ENV, SITE_ENV, START_TIMEOUT,
                                  WORKER_PRELOAD)

logger = logging.getLogger(__name__)


@dataclass
class RunState:
    """`state.json` in the run directory: what `submit --wait` and `status` show while the job runs."""

    rundir: RunDir
    expected: int
    data: dict[str, Any] = field(default_factory=dict)

    def __call__(self, phase: str, **extra: Any) -> None:
        self.data |= {"phase": phase, "expected": self.expected, "updated": time.time(), **extra}
        self.rundir.write_state(self.data)

    def note(self, **extra: Any) -> None:
        """Record more of the run (progress, lost nodes, the wind-down) in the phase it is in, unless `phase=`."""
        self(extra.pop("phase", self.data["phase"]), **extra)


ApiForHost = Callable[[str], dict[str, str]]


def run(site: Site, command: list[str], *, insecure: bool = False, timeout: float = 180,
        env: Mapping[str, str] | None = None, api: ApiForHost | None = None, sweep: str | None = None,
        sweep_epoch: int | None = None, resume: bool = False, walltime: int | None = None,
        preload: Preload | None = None) -> int:
    """Run COMMAND against a cluster shaped by the site, in this job or here; COMMAND's exit code.

    `walltime` (seconds; `submit --time` for a jobqueue site whose driver runs on the login node): how long
    this run may last outside a batch job. Its worker jobs end before it, and it winds down as a job does at
    its walltime (no follow-up job: resume it).

    `api(host)` gives the environment that points the flow and every worker at one Prefect API listening
    where the scheduler does (the CLI passes `prefect.server.ensure_api`); None: no API is arranged.
    `preload`: what the workers and the scheduler import first (the CLI passes Prefect's, prefect/preload.py);
    None: $HPC_GARAGE_WORKER_PRELOAD, else distributed.
    """
    from hpc_garage.schedulers import allocation_from_env, in_job_of, job_id as batch_job_id
    from hpc_garage.schedulers.local import job_id as local_job_id

    log.setup()  # the job log's `hpc-garage: ...` lines (hpc_garage/log.py)
    env = dict(os.environ if env is None else env)
    env.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")  # workers' start-up chatter hides the flow's output
    os.environ["DASK_LOGGING__DISTRIBUTED"] = env["DASK_LOGGING__DISTRIBUTED"]  # local workers are our children
    # a module listed in $HPC_GARAGE_WORKER_PRELOAD that is not installed: refused now
    preload = preload or Preload(tuple(worker_preload(env)))
    if not command:
        raise UserError("no COMMAND given; write it after --, e.g. `hpc-garage run -- python sweep.py`")
    if shutil.which(command[0], path=env.get("PATH")) is None and not os.path.exists(command[0]):
        raise UserError(f"{command[0]!r}: command not found; check the command after --")
    if site.launcher == "jobqueue":
        from hpc_garage.launchers.jobqueue.launcher import JobqueueLauncher
        from hpc_garage.launchers.jobqueue.plan import initial_layout, run_end_time

        job_id = batch_job_id(env) or local_job_id()
        layout_, notes = initial_layout(site)
        launcher = JobqueueLauncher(site, job_id, run_end_time(site, env, walltime))  # worker jobs end before it
    elif in_job_of(site, env):
        allocation = allocation_from_env(site, env)
        layout_ = layout(site, allocation)
        if site.mpi.launch == "dask-mpi":  # one MPI rank per worker, dask-mpi's worker side (launchers/dask_mpi.py)
            from hpc_garage.launchers.dask_mpi import DaskMpiLauncher

            launcher: Launcher = DaskMpiLauncher(layout_, env)
        else:
            from hpc_garage.launchers.mpi import MpiLauncher

            launcher = MpiLauncher(layout_, env)
        job_id = str(allocation.job_id)
        notes = list(allocation.notes) + [f"unused: {x}" for x in layout_.leftovers]
    else:
        from hpc_garage.launchers.local import LocalLauncher, local_layout

        layout_, notes = local_layout(site)
        launcher = LocalLauncher(layout_)
        job_id = local_job_id()
        notes = [f"no batch job here: a local cluster shaped like one {site.name} node"] + notes
    in_job = in_job_of(site, env)
    swept = join_sweep(site, command, job_id, name=sweep, epoch=sweep_epoch, resume=resume, in_job=in_job)
    for note in notes:
        logger.info(note)
    if insecure:
        logger.info("--insecure: the cluster speaks plain tcp; anyone who can reach its ports can run code in it")
    logger.info(f"sweep {swept.key} (results in {swept.results})")
    rundir = RunRoot.of_site(site).run_dir(job_id)
    rundir.create(rundir.submitted_at())  # a recycled job id: what the earlier job left is cleared
    if not in_job:  # a job of this machine's: `status`, `cancel` and `resume` find it (schedulers/local.py)
        from hpc_garage.schedulers.submission import record_run_here

        record_run_here(rundir, site, command, swept.book.root, swept.key)
    ending = (_wind_down(site, env, job_id, rundir, Path(swept.results)) if in_job
              else _run_deadline(site, job_id, walltime, rundir, Path(swept.results)) if walltime is not None
              else None)
    try:
        return asyncio.run(_serve(site, layout_, launcher, rundir, job_id, command, env, insecure, timeout, api,
                                  swept, ending, preload))
    finally:
        launcher.abandon()


@dataclass
class _Run:
    """One run's parts: those fixed before start-up, and those up so far. Teardown ends exactly what is up,
    whichever step start-up stopped at (a signal, a launcher that failed, COMMAND exiting early)."""

    site: Site
    layout: Layout
    launcher: Launcher
    rundir: RunDir
    job_id: str
    state: RunState
    tls: dict[str, str] | None
    api_env: dict[str, str]
    ending: WindDown | None
    settings: dict[str, Any] = field(default_factory=dict)  # dask.config of scheduler and workers
    nodes: NodeWatch = field(default_factory=NodeWatch)  # lost nodes, for the whole run (cluster/node_loss.py)
    proc: asyncio.subprocess.Process | None = None  # COMMAND
    scheduler: Any = None
    progress: Any = None  # trials, GPU figures, the report (cluster/progress.py)
    preload: threading.Thread | None = None  # what the workers preload, imported here too
    code: int | None = None  # COMMAND's exit code, once it ended by itself


async def _serve(site: Site, layout_: Layout, launcher: Launcher, rundir: RunDir, job_id: str,
                 command: list[str], env: dict[str, str], insecure: bool, timeout: float,
                 api: ApiForHost | None, swept: RunSweep, ending: WindDown | None, preload_names: Preload) -> int:
    """Start COMMAND, the workers and the scheduler at once (their imports overlap), publish the scheduler
    file once every worker has registered (COMMAND's task runner waits for it), end when COMMAND does."""
    logging.getLogger("distributed").setLevel(env["DASK_LOGGING__DISTRIBUTED"].upper())
    quiet_expected_closes()
    expected = [w.name for w in layout_.workers]
    state = RunState(rundir, len(expected))
    state("starting", workers=0, job_id=job_id, site=site.name, sweep=swept.key.name, epoch=swept.key.epoch)
    started = time.monotonic()
    host = listening_host(launcher.scheduler_host)
    api_env = api(host) if api is not None else {}
    run = _Run(site, layout_, launcher, rundir, job_id, state, None if insecure else rundir.credential_paths(),
               api_env, ending, cluster_settings(layout_.worker_count) | profiler_settings(env))
    worker_env, child_env = _environments(run, env, swept, timeout, preload_names, host)
    interrupted = stop_on_signals()
    if ending is not None:
        ending.bind(note=state.note)
        ending.install_signals()  # the batch system's warning: wind down now (preemption, the site's signal)
    try:
        await launcher.prepare(run.tls, worker_env, rundir, timeout)
        # COMMAND first: it imports Prefect while the cluster starts
        run.proc = await start_command(command, child_env, interrupted, on_signal=run.nodes.job_ending)
        run.scheduler = dask_scheduler.new(launcher, rundir, run.tls,  # here, never in a GPU worker's place
                                           settings=run.settings)
        run.progress = await dask_scheduler.start(run.scheduler, site, rundir, api_env,
                                                  lambda figures: state.note(progress=figures))
        run.preload = dask_scheduler.import_beside(list(preload_names.scheduler))
        await launcher.start(run.scheduler.address, run.tls, worker_env, rundir)
        if await _wait(run.scheduler, expected, timeout, launcher, state, run.proc):
            _hand_over(run, expected, started)
        run.code = await _command_code(run)
    except asyncio.CancelledError:
        if not interrupted:
            raise
        logger.info(f"signal {interrupted[0]} before the workers were up: tearing down")
    finally:
        await _tear_down(run)
        if ending is not None:
            await ending.linger()  # preempted: the batch system ends (and requeues) the job, not `run`
    return run.code if run.code is not None else 128 + interrupted[0] if interrupted else 1


def _environments(run: _Run, env: dict[str, str], swept: RunSweep, timeout: float, preload_names: Preload,
                  host: str) -> tuple[dict[str, str], dict[str, str]]:
    """What every worker and COMMAND see: the site's variables, the Prefect API's and the sweep's, and how to
    find this run (COMMAND: the scheduler file it waits for, the run directory); the run's own hosts (the
    scheduler and its dashboard, the managed server) never go through a proxy."""
    worker_env = {**run.site.env, **run.api_env, **swept.env, SITE_ENV: run.site.name,
                  WORKER_PRELOAD: ",".join(preload_names.workers),  # each host's forkserver imports them
                  "DASK_LOGGING__DISTRIBUTED": env["DASK_LOGGING__DISTRIBUTED"]}
    child_env = {**env, **run.api_env, **swept.env, SCHEDULER_FILE_ENV: str(run.rundir.scheduler_file),
                 JOB_ID_ENV: run.job_id, RUN_DIR_ENV: str(run.rundir.path), SITE_ENV: run.site.name,
                 START_TIMEOUT: f"{timeout:g}", **run.launcher.command_env}
    own = [host, server_host(run.api_env)]
    worker_env |= no_proxy_for(own, {**env, **worker_env})
    worker_env |= dask_environment(run.settings)  # large clusters' timeouts, the profiler off
    child_env |= no_proxy_for(own, child_env)
    return worker_env, child_env


def _hand_over(run: _Run, expected: list[str], started: float) -> None:
    """Every worker is up: publish the scheduler file, which COMMAND's task runner waits for; only now watch
    for lost nodes and the job's end, since both act on a whole cluster."""
    logger.info(f"{len(expected)} workers registered in {time.monotonic() - started:.1f} s; "
                f"scheduler {run.scheduler.address}")
    handoff = Handoff(address=run.scheduler.address, job_id=run.job_id, tls=run.tls,
                      prefect_api_url=run.api_env.get("PREFECT_API_URL"), workers=expected, site=run.site.name)
    run.rundir.publish(handoff)
    run.state("running", workers=len(expected))
    run.nodes.start(run.scheduler, run.launcher, run.layout, run.state.note, run.proc)
    if run.ending is not None:
        if run.progress is not None:  # a Cancel in Prefect winds the job down too (cluster/prefect_cancel.py)
            run.ending.prefect = PrefectCancel(run.api_env, run.progress.known_flow_runs)
        run.ending.start(run.scheduler, run.proc)


async def _command_code(run: _Run) -> int:
    """COMMAND's exit code as `run` exits with it: never 0 when a lost node or the job's end stopped it."""
    assert run.proc is not None
    code = run.nodes.exit_code(await command_exit(run.proc))
    if run.ending is None:
        return code
    await run.ending.settled()  # a wind-down under way decides first (follow-up job, interrupted trials)
    return run.ending.exit_code(code)


async def _tear_down(run: _Run) -> None:
    """End what is up, in the order that loses least: COMMAND if it outlived a failed start-up, its flow runs
    marked Crashed while the batch system still waits, the watches, the handoff withdrawn, the report while
    the workers still answer, then the workers, the scheduler, the launcher's jobs. Signals are ignored from
    here on, so that teardown completes (no worker job is left in the queue)."""
    on_signals(lambda sig: logger.info(f"signal {sig} ignored: tearing down (stopping workers, cancelling jobs)"))
    if run.code is None and run.proc is not None:
        await end_command(run.proc)
    if run.progress is not None and run.code != 0:  # before the batch system's KillWait runs out
        await asyncio.get_running_loop().run_in_executor(None, _crash_open_flow_runs, run.progress, run.code)
    run.nodes.cancel()
    if run.ending is not None:
        run.ending.cancel()
    run.launcher.draining()
    run.rundir.clear_handoff()
    if run.progress is not None:  # report.json and its summary, while the workers are still there
        run.progress.interrupted = run.ending.interrupted if run.ending is not None else []
        for line in run.progress.finish(run.rundir):
            logger.info(f"report: {line}")
    if run.scheduler is not None:
        await dask_scheduler.retire(run.scheduler)
        await run.launcher.stop_workers()  # those this process holds end before the scheduler they beat into
        await run.scheduler.close(reason="hpc-garage run: command finished")
    await run.launcher.stop()
    if run.preload is not None:  # an interpreter exiting mid-import in a thread can crash (seen: SIGSEGV)
        await asyncio.get_running_loop().run_in_executor(None, run.preload.join, 60)
    cancelled = {"cancelled": True} if run.rundir.cancel_requested() else {}  # `hpc-garage cancel`, even --now
    run.state("done" if run.code is not None else "failed", exit_code=run.code, **cancelled)


def _crash_open_flow_runs(progress: Any, code: int | None) -> None:
    """COMMAND ended non-zero (cancelled, walltime, killed, its cluster lost): a flow run of it that Prefect
    still shows unfinished (the flow process was killed before it could say so) is set Crashed, so that no
    run shows Running for ever (progress knows them from their first submission). Bookkeeping: an API that
    does not answer is left alone."""
    client = PrefectApi.from_env(progress.api, timeout=3)
    if client is None:
        return
    how = f"exit code {code}" if code is not None else "interrupted"
    for flow_run in progress.known_flow_runs():
        try:
            if client.get(f"/flow_runs/{flow_run}").get("state_type") in ("COMPLETED", "FAILED", "CRASHED",
                                                                          "CANCELLED"):
                continue
            client.post(f"/flow_runs/{flow_run}/set_state", {
                "state": {"type": "CRASHED", "message": f"hpc-garage run: COMMAND ended ({how}) before the flow "
                          "run reached a final state"}, "force": True})
            logger.info(f"flow run {flow_run} set Crashed in Prefect's API (COMMAND ended, {how})")
        except (OSError, ValueError, AttributeError) as exc:
            logger.info(f"flow run {flow_run}: could not check its state in Prefect's API ({exc})")


def _wind_down(site: Site, env: Mapping[str, str], job_id: str, rundir: RunDir, results: Path) -> WindDown:
    """The watch on this job's end: its time left from the batch system; a follow-up job from its own
    script (`submit` saved it) where the site says `requeue: auto`, unless `hpc-garage cancel` asked for it."""
    from hpc_garage.schedulers import detect
    from hpc_garage.schedulers.submission import resubmit

    batch = detect(env, prefer=site.scheduler)
    assert batch is not None
    follow_up = None
    if site.requeue == "auto" and rundir.script_file.is_file():
        def follow_up() -> str:
            return resubmit(rundir.path, after=job_id, how="follow-up").job_id

    def cancel(other: str) -> None:
        with contextlib.suppress(Exception):
            batch.run(batch.cancel_argv(other))

    return WindDown(site, job_id, lambda: batch.time_left(job_id), follow_up, cancel, results,
                    cancel_requested=rundir.cancel_requested)  # `hpc-garage cancel`: no follow-up job


def _run_deadline(site: Site, job_id: str, walltime: int, rundir: RunDir, results: Path) -> WindDown:
    """The watch on a run outside a batch job that was given a walltime: its end is `walltime` from now;
    `hpc-garage cancel` winds it down as it does a job."""
    end = time.time() + walltime
    return WindDown(site, job_id, lambda: (end - time.time(), float(walltime)), None, lambda other: None, results,
                    cancel_requested=rundir.cancel_requested)


async def _wait(scheduler: Any, expected: list[str], timeout: float, launcher: Launcher, state: RunState,
                proc: asyncio.subprocess.Process) -> bool:
    """True once every worker has registered; False if COMMAND failed first (its error is the story then).
    A COMMAND that succeeds without the cluster (`run -- true`, a smoke test) still waits for the workers."""
    from hpc_garage.launchers.common import wait_for_workers

    waiting = asyncio.ensure_future(wait_for_workers(
        lambda: (ws.name for ws in scheduler.workers.values()),
        expected,
        timeout,
        alive=launcher.failure,
        progress=lambda k, n: state("workers", workers=k),
    ))
    exited = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait({waiting, exited}, return_when=asyncio.FIRST_COMPLETED)
        if waiting.done() or proc.returncode == 0:
            await waiting
            return True
        waiting.cancel()
        logger.info(f"COMMAND exited with code {proc.returncode} before the workers were up")
        return False
    finally:
        for task in (waiting, exited):
            if not task.done():
                task.cancel()


def site_for_run(name: str | None, env: Mapping[str, str]) -> Site:
    from hpc_garage.sites import load_site

    return load_site(name or env.get(SITE_ENV) or "local")

