"""Prefect's side of the `hpc-garage` work pool: the job variables (the UI's run form), the job
configuration, and a worker that turns each flow run into one batch job and follows that job to its end.

The batch side (checking the variables as `submit` does, submitting once per flow run, asking the batch
system, cancelling) is `schedulers/flow_run_jobs.py`; `hpc_garage.work_pool` hands it to this worker as
`jobs` (this layer never imports the schedulers) and registers the type with Prefect.

Following: one loop for every job this worker follows asks the batch system once and Prefect's API once per
tick. A flow run that is Cancelling (Prefect's Cancel: the UI, the API, `prefect flow-run cancel`) has its job
wound down as `hpc-garage cancel` does: its running trials get their checkpoint grace, `on_stop` runs, no
follow-up job is submitted; the job is cancelled (scancel/qdel) if it has not ended CANCEL_MARGIN after that,
at once where it cannot wind down (not running yet) or where the flow run was set Cancelled outright (the
hard cancel, as `hpc-garage cancel --now`). Once the job is gone, a follow-up job an earlier wind-down
submitted is cancelled too and the flow run is set Cancelled. A job that ends while its flow run is not final (scancel from a shell, walltime, a lost node,
preemption) has the flow run set Crashed with a reason naming the job; a job that `run` followed up (walltime,
`requeue: auto`) is followed into its follow-up job, the flow run Pending meanwhile. The loop outlives an API
that does not answer: jobs are kept and followed; the API is asked again next tick.

A restarted worker takes up the flow runs of its pool that are Pending, Running or Cancelling: those with a
job (a claim noted its id) are followed again; those left Pending without one by a dead worker go back to
Scheduled and are submitted once.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Any, ClassVar
from uuid import UUID

import anyio
import anyio.abc
from pydantic import PrivateAttr
from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterId, FlowRunFilterState,
                                            FlowRunFilterStateType, WorkPoolFilter, WorkPoolFilterName)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import InfrastructureNotFound
from prefect.states import Cancelled, Crashed, Failed, Pending, Scheduled
from prefect.workers.base import BaseWorker, BaseWorkerResult

from hpc_garage.core.errors import UserError
from hpc_garage.prefect.job_variables import NOT_OURS, GarageVariables, JobVariableFields
from hpc_garage.variables import PREFECT_SERVER_ENV

logger = logging.getLogger(__name__)

ENGINE = "hpc_garage.prefect.flow_run"  # COMMAND: Prefect's engine, unless the flow run has ended (a stray job)
FOLLOW_SECONDS = 3.0  # a followed job and its flow run are looked at this often (one squeue, one API call)
ADOPT_AFTER = 30.0  # s a flow run may stay Pending with no job before a restarted worker submits it again
FINAL = (StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED)


class GarageJobConfiguration(JobVariableFields):
    """The templated variables as they reach the worker, one field per job variable (prefect/job_variables.py).
    Loosely typed on purpose: each value is checked by hpc-garage's own rules (schedulers/flow_run_jobs.py), so a
    bad one fails the flow run in one line."""

    _workdir: str = PrivateAttr(default="")
    _default_sweep: str = PrivateAttr(default="prefect")

    def prepare_for_flow_run(self, flow_run: Any, deployment: Any = None, flow: Any = None, work_pool: Any = None,
                             worker_name: str | None = None, worker_id: UUID | None = None) -> None:
        super().prepare_for_flow_run(flow_run, deployment=deployment, flow=flow, work_pool=work_pool,
                                     worker_name=worker_name, worker_id=worker_id)
        if os.environ.get(PREFECT_SERVER_ENV):  # which managed server: a flow that outlives it keeps it
            self.env.setdefault(PREFECT_SERVER_ENV, os.environ[PREFECT_SERVER_ENV])
        self._workdir = deployment_dir(deployment) or os.getcwd()
        parts = [getattr(flow, "name", None), getattr(deployment, "name", None)]
        self._default_sweep = sweep_name("-".join(p for p in parts if p) or "prefect")


def deployment_dir(deployment: Any) -> str | None:
    """A path-based deployment's directory: its `path`, else its pull step's `set_working_directory`."""
    path = getattr(deployment, "path", None)
    if path and os.path.isabs(path) and os.path.isdir(path):
        return path
    for step in getattr(deployment, "pull_steps", None) or []:
        for name, args in step.items():
            if name.endswith("set_working_directory") and isinstance(args, dict):
                directory = str(args.get("directory") or "")
                if os.path.isabs(directory) and os.path.isdir(directory):
                    return directory
    return None


def sweep_name(text: str) -> str:
    """A sweep name (core/sweep.py's rules) from a flow and deployment name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("._-")[:64]
    return name or "prefect"


class GarageResult(BaseWorkerResult):
    """How a followed job ended for Prefect: 0 once hpc-garage has set the flow run's final state."""


async def _keep_job_as_pid(client: Any, run: Any, job_id: str) -> None:
    """The job as the flow run's infrastructure pid, where its worker died before Prefect kept it there (Prefect's
    cancel needs it); the API away: a warning, and the job is followed anyway."""
    if str(run.infrastructure_pid or "") == job_id:
        return
    try:
        await client.update_flow_run(flow_run_id=run.id, infrastructure_pid=job_id)
    except Exception as exc:  # noqa: BLE001 - kept the next time a worker takes it up
        logger.warning("hpc-garage worker: flow run %s: could not record job %s (%s)", run.id, job_id, exc)


@dataclass
class _Followed:
    flow_run: Any
    job_id: str
    site: str
    done: asyncio.Future[None]
    cancelled: bool = False  # scancel/qdel sent for a Cancelling flow run
    winding: float | None = None  # a Cancelling flow run's job winds down: scancel/qdel at this time.monotonic()
    quiet_ticks: int = 0  # ticks since the job ended with the flow run not final


class PoolWorker(BaseWorker[GarageJobConfiguration, GarageVariables, GarageResult], abc.ABC):
    """The worker; `hpc_garage.work_pool.HpcGarageWorker` is it with the batch side (`jobs`) and a type."""

    job_configuration = GarageJobConfiguration
    job_configuration_variables = GarageVariables
    jobs: ClassVar[Any]  # schedulers/flow_run_jobs.py

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._followed: dict[str, _Followed] = {}
        self._mine: set[str] = set()  # flow runs inside run() (submitting or followed)
        self._loop_task: asyncio.Task[None] | None = None
        self._taken_up: set[asyncio.Task[None]] = set()  # following jobs of earlier workers
        self._once = False  # --run-once: each job looked at once, not followed

    @classmethod
    def get_description(cls) -> str:
        return ("Each flow run becomes one SLURM or PBS job that starts Dask across its allocation (as hpc-garage "
                "submit), followed until it ends; cancelling the flow run cancels the job.")

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        template = super().get_default_base_job_template()
        for name in NOT_OURS:
            template["job_configuration"].pop(name, None)
        return template

    async def start(self, run_once: bool = False, with_healthcheck: bool = False, printer: Any = print) -> None:
        """`run_once` (cron, scrontab: sites that end long login-node processes): submit what is due and look
        at every job once, then exit; the next call takes up where this one left."""
        self._once = run_once
        await super().start(run_once=run_once, with_healthcheck=with_healthcheck, printer=printer)

    # ------------------------------------------------------------------------------------- one flow run

    async def run(self, flow_run: Any, configuration: GarageJobConfiguration,
                  task_status: anyio.abc.TaskStatus[Any] | None = None) -> GarageResult:
        run_logger = self.get_flow_run_logger(flow_run)
        flow_run_id = str(flow_run.id)
        self._mine.add(flow_run_id)
        try:
            job = self.jobs.FlowRunJob(
                flow_run_id=flow_run_id, flow_run_name=flow_run.name,
                values={name: getattr(configuration, name) for name in self.jobs.VARIABLES},
                env=dict(configuration.env), workdir=configuration._workdir,
                default_sweep=configuration._default_sweep, module=ENGINE)
            try:
                prepared = await anyio.to_thread.run_sync(self.jobs.prepare_flow_run, job)
                taken = await anyio.to_thread.run_sync(self.jobs.take, job, prepared)
            except self.jobs.Busy as exc:  # a worker process beside this one submits it right now
                run_logger.info(f"not submitted here: {exc}")
                if task_status is not None:
                    task_status.started(None)
                return GarageResult(identifier="", status_code=0)
            except UserError as exc:  # hpc-garage's one line: the flow run fails, nothing was submitted
                run_logger.error(f"hpc-garage: {exc}")
                await self._set_state(flow_run, Failed(message=f"hpc-garage: {exc}"))
                if task_status is not None:
                    task_status.started(None)
                return GarageResult(identifier="", status_code=0)
            if task_status is not None:
                task_status.started(taken.job_id)  # Prefect records it as the infrastructure pid
            if taken.fresh:
                run_logger.info(f"submitted job {taken.job_id} (site {prepared.site.name}); log: {taken.log}; "
                                f"`hpc-garage status {taken.job_id}`, `hpc-garage logs {taken.job_id} -f`")
            else:
                run_logger.info(f"job {taken.job_id} was submitted for this flow run already: following it")
            await self._follow(flow_run, taken.job_id, taken.site)
            return GarageResult(identifier=taken.job_id, status_code=0)
        finally:
            self._mine.discard(flow_run_id)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: GarageJobConfiguration,
                                  grace_seconds: int = 30) -> None:
        """Prefect's cancel of a flow run that never started: scancel/qdel its job."""
        try:
            await anyio.to_thread.run_sync(self.jobs.cancel, infrastructure_pid, configuration.site)
        except UserError as exc:
            raise InfrastructureNotFound(str(exc)) from None

    # ------------------------------------------------------------------------------------ following

    async def _follow(self, flow_run: Any, job_id: str, site: str) -> None:
        followed = _Followed(flow_run, job_id, site, asyncio.get_running_loop().create_future())
        self._followed[str(flow_run.id)] = followed
        if self._once:  # one look; the next run-once call looks again
            try:
                await self._tick()
            finally:
                self._followed.pop(str(flow_run.id), None)
            if not followed.done.done():
                return
        else:
            if self._loop_task is None or self._loop_task.done():
                self._loop_task = asyncio.ensure_future(self._follow_loop())
            try:
                await followed.done
            finally:
                self._followed.pop(str(flow_run.id), None)
        await anyio.to_thread.run_sync(self.jobs.drop_secrets, str(flow_run.id))  # followed to its end

    async def _follow_loop(self) -> None:
        while self._followed:
            try:
                await self._tick()
            except Exception as exc:  # noqa: BLE001 - the batch system or the API did not answer: next tick
                logger.warning("hpc-garage worker: following %d job(s): %s (trying again in %g s)",
                               len(self._followed), exc, FOLLOW_SECONDS)
            await asyncio.sleep(FOLLOW_SECONDS)

    async def _tick(self) -> None:
        followed = [f for f in self._followed.values() if not f.done.done()]  # a done one leaves at once
        if not followed:
            return
        views = await anyio.to_thread.run_sync(self.jobs.views, {f.job_id: f.site for f in followed})
        runs = await self.client.read_flow_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[f.flow_run.id for f in followed])))
        states = {str(r.id): r for r in runs}
        for f in followed:
            run = states.get(str(f.flow_run.id))
            if run is None:  # deleted in the UI: its job goes too
                await anyio.to_thread.run_sync(self.jobs.cancel, f.job_id, f.site)
                f.done.set_result(None)
                continue
            f.flow_run = run
            await self._look(f, run, views[f.job_id])

    async def _look(self, f: _Followed, run: Any, view: Any) -> None:
        state = run.state.type if run.state else None
        run_logger = self.get_flow_run_logger(run)
        if state in (StateType.CANCELLING, StateType.CANCELLED) and not view.finished and not f.cancelled:
            await self._cancel(f, state, run_logger)
            return
        if not view.finished:
            return
        if f.cancelled or f.winding is not None or state == StateType.CANCELLING:
            follow_up = self.jobs.next_job_of(view)  # submitted by a wind-down before the cancel
            if follow_up is not None and await anyio.to_thread.run_sync(self.jobs.cancel, follow_up.job_id, f.site):
                run_logger.info(f"flow run cancelled: follow-up job {follow_up.job_id} cancelled too")
            if state != StateType.CANCELLED:
                await self._set_state(run, Cancelled(message=f"Cancelled: job {f.job_id} was cancelled"))
            f.done.set_result(None)
            return
        follow_up = self.jobs.next_job_of(view) if state not in FINAL or state == StateType.CRASHED else None
        if follow_up is not None:  # walltime or preemption: `run` handed the sweep to a follow-up job
            run_logger.info(f"job {f.job_id} reached its end; the flow run continues in job {follow_up.job_id}")
            f.job_id = follow_up.job_id
            await self._set_state(run, Pending(message=f"continues in job {follow_up.job_id} (job {view.job_id} "
                                                       "reached its end)"))
            await self.client.update_flow_run(flow_run_id=run.id, infrastructure_pid=follow_up.job_id)
            return
        if state in FINAL and (state != StateType.CRASHED or f"job {f.job_id}" in (run.state.message or "")):
            f.done.set_result(None)
            return
        f.quiet_ticks += 1
        if f.quiet_ticks < 2 and state not in FINAL and not self._once:  # its last state may be on its way
            return
        why = self.jobs.ended(view)
        if state == StateType.CRASHED:  # the flow said why it stopped; the job says what stopped it
            message = f"{why}: {(run.state.message or 'crashed').rstrip('.')}; `hpc-garage logs {f.job_id}`"
        else:
            message = f"{why} before the flow run reached a final state; `hpc-garage logs {f.job_id}`"
        await self._set_state(run, Crashed(message=message))
        run_logger.error(f"flow run crashed: {message}")
        f.done.set_result(None)

    async def _cancel(self, f: _Followed, state: Any, run_logger: Any) -> None:
        """A Cancelling flow run's job winds down first (its trials' checkpoint grace); Cancelled outright, a
        job that cannot wind down, or one still running CANCEL_MARGIN after its grace, is cancelled now."""
        if state == StateType.CANCELLING and f.winding is None:
            grace = await anyio.to_thread.run_sync(self.jobs.wind_down, f.job_id, f.site)
            if grace is not None:
                f.winding = time.monotonic() + grace + self.jobs.CANCEL_MARGIN
                run_logger.info(f"flow run cancelled: job {f.job_id} winds down; its running trials get {grace:.0f} s "
                                f"(checkpoint_grace) to checkpoint (`hpc-garage cancel --now {f.job_id}` cancels it "
                                "at once)")
                return
        if state == StateType.CANCELLING and f.winding is not None and time.monotonic() < f.winding:
            return
        f.cancelled = await anyio.to_thread.run_sync(self.jobs.cancel, f.job_id, f.site) or True
        run_logger.info(f"flow run cancelled: job {f.job_id} cancelled")

    async def _set_state(self, flow_run: Any, state: Any) -> None:
        try:
            await self.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception as exc:  # noqa: BLE001 - deleted meanwhile, or the API is away: nothing to keep
            logger.warning("hpc-garage worker: flow run %s: could not set %s (%s)", flow_run.id, state.type, exc)

    # ------------------------------------------------------------------------------ after a restart

    async def sync_with_backend(self) -> None:
        await super().sync_with_backend()
        try:
            pool = self.work_pool.name
        except RuntimeError:  # not synced yet
            return
        try:
            await self._take_up(pool)
        except Exception as exc:  # noqa: BLE001 - next heartbeat tries again
            logger.warning("hpc-garage worker: looking for flow runs of earlier workers: %s", exc)

    async def _take_up(self, pool: str) -> None:
        """Follow the jobs of this pool's unfinished flow runs that no run() here follows (an earlier worker
        submitted them); give back to the pool a Pending flow run whose worker died before submitting."""
        runs = await self.client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.PENDING, StateType.RUNNING, StateType.CANCELLING]))))
        roots = await anyio.to_thread.run_sync(self.jobs.run_roots) if runs else []
        for run in runs:
            flow_run_id = str(run.id)
            if flow_run_id in self._mine or flow_run_id in self._followed:
                continue
            claim = await anyio.to_thread.run_sync(self.jobs.claim_of, flow_run_id, roots)
            if not (claim and claim.get("job_id")) and run.infrastructure_pid:  # its claim is out of sight
                claim = {"job_id": run.infrastructure_pid}
            if claim and not claim.get("job_id") and run.state_type != StateType.PENDING \
                    and claim.get("claimed", 0) <= time.time() - ADOPT_AFTER:  # its job runs the flow already
                claim = await anyio.to_thread.run_sync(self.jobs.job_of_dead_claim, flow_run_id, claim, roots) or claim
            if claim and claim.get("job_id"):
                self._mine.add(flow_run_id)
                if self._once:
                    await self._take_up_one(run, claim)
                    continue
                task = asyncio.ensure_future(self._take_up_one(run, claim))
                self._taken_up.add(task)
                task.add_done_callback(self._taken_up.discard)
                continue
            if claim and claim.get("pid") and claim.get("claimed", 0) > time.time() - ADOPT_AFTER:
                continue  # being submitted by a worker right now (or just died: next heartbeat)
            entered = run.state.timestamp.timestamp() if run.state and run.state.timestamp else time.time()
            if run.state_type == StateType.PENDING and time.time() - entered > ADOPT_AFTER:
                self.get_flow_run_logger(run).info("its worker stopped before submitting a job: back to the work pool")
                await self._set_state(run, Scheduled(message="hpc-garage: its worker stopped before submitting "
                                                             "a job; submitted again"))

    async def _take_up_one(self, run: Any, claim: dict[str, Any]) -> None:
        try:
            self.get_flow_run_logger(run).info(f"worker {self.name!r} follows job {claim['job_id']}")
            await _keep_job_as_pid(self.client, run, str(claim["job_id"]))
            await self._follow(run, str(claim["job_id"]), str(claim.get("site") or ""))
        finally:
            self._mine.discard(str(run.id))

    async def teardown(self, *exc_info: Any) -> None:
        for task in [self._loop_task, *self._taken_up]:
            if task is not None:
                task.cancel()
        await super().teardown(*exc_info)
