"""The Prefect task runner for hpc-garage: the job's Dask cluster, `dask-resource:` tags, one Prefect API.

`@flow(task_runner=hpc_garage.task_runner())` runs unchanged in three places:
- under `hpc-garage run` (a batch job, or a login node): $HPC_GARAGE_SCHEDULER_FILE names the cluster `run`
  started; the runner connects to it with the job's TLS credentials;
- anywhere else: the runner starts a local cluster shaped like one node of $HPC_GARAGE_SITE (default
  `local`), TLS on loopback too, since other users of a login node can reach its ports;
- either way the flow and every worker use one Prefect API (flow_api.py: the one Prefect's settings name,
  `prefect_test_harness()`'s included, else hpc-garage's server); without that, each worker process starts
  its own temporary server on one SQLite file.

`task_runner(pruner=..., metric=..., mode=...)` names a pruner for the trials' `hpc_garage.trial.report()`s;
with a run directory (under `hpc-garage run`) the reports are kept there with or without one (metrics.py).
A task may submit tasks (the runner's copy on the worker connects with that worker's credentials), and
prefect-dask's `cluster_kwargs` for its LocalCluster are honoured on the local cluster where they make sense
(`processes`, `dashboard_address`) and refused in one line where they do not (`n_workers`, ...).

prefect-dask 0.3.7 ignores `dask-resource:` tags, so a "GPU" task may land on a CPU worker. HpcTaskRunner
submits each tagged task under `dask.annotate(resources=...)`, merged with the caller's own annotation.
prefect-dask also spends ~190 ms of set-up per task (Settings re-validated, a Prefect client built twice,
the settings re-serialized in the flow). HpcTaskRunner submits through `prefect_fast`, which does that set-up
once per worker and still runs every task through Prefect's own engine; see that module for what and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Iterator

import dask
from prefect.context import FlowRunContext, TagsContext
from prefect_dask import DaskTaskRunner

from hpc_garage import log
from hpc_garage.compat import dask_futures, runner_has_cluster, runner_started
from hpc_garage.prefect import fast as prefect_fast
from hpc_garage.prefect import in_flight, outage, recorded, refusals
from hpc_garage.prefect.flow_api import local_address_towards, settle_api
from hpc_garage.prefect.metrics import TrialMetrics
from hpc_garage.pruning import check_settings
from hpc_garage.core.errors import UserError
from hpc_garage.cluster.handoff import announce_trials, handoff_from_env, workers_now
from hpc_garage.rundir import note_flow_run
from hpc_garage.prefect.sweep_cache import SweepTasks
from hpc_garage.prefect.tags import resources_from_tags
from hpc_garage.variables import POOL_RESOURCES_ENV, SITE_ENV

if TYPE_CHECKING:
    from hpc_garage.core.site import Site

__all__ = ["HpcTaskRunner", "task_runner", "worker_resources"]

LOCAL_CLUSTER = "hpc_garage.cluster.local.LocalSiteCluster"  # loaded by prefect-dask


def task_runner(*, site: str | Site | None = None, **kwargs: Any) -> HpcTaskRunner:
    """The runner for wherever this flow runs; keyword arguments go to DaskTaskRunner.

    `max_in_flight=N`: at most N tasks unfinished in Dask, `map`/`submit` wait past it (default 4 per worker
    thread, at least 1,000); a finished persisted task leaves Dask, `.result()` reads it back (in_flight.py).

    It is built when the flow is decorated, before the flow's first API call: the only moment at which
    the flow process can still be pointed at the shared Prefect API. `pruner=`, `metric=` and `mode=` are
    checked then too (pruning.py), before any API or cluster is started. A refusal ends the flow's process in
    one line (refusals.py), however it was started.
    """
    refusals.install()
    check_settings(kwargs.get("pruner"), kwargs.get("metric"), kwargs.get("mode", "min"))
    if kwargs.get("address") or kwargs.get("cluster") or kwargs.get("cluster_class"):
        settle_api()  # the caller chose the cluster; the API is still ours to settle
        return HpcTaskRunner(**kwargs)
    handoff = handoff_from_env()
    if handoff is not None:
        settle_api(host=local_address_towards(handoff.address))
        client_kwargs = {"security": handoff.security(), **kwargs.pop("client_kwargs", {})}
        return HpcTaskRunner(address=handoff.address, client_kwargs=client_kwargs, **kwargs)
    from distributed.security import Security

    site = site or os.environ.get(SITE_ENV) or "local"
    cluster_kwargs = local_cluster_kwargs(site, kwargs.pop("cluster_kwargs", None) or {})
    cluster_kwargs = {"site": site, "env": settle_api(), "security": Security.temporary(), **cluster_kwargs}
    return HpcTaskRunner(cluster_class=LOCAL_CLUSTER, cluster_kwargs=cluster_kwargs, **kwargs)


# distributed.LocalCluster's arguments (prefect-dask documents them for its default cluster) that the local
# cluster honours: processes=False makes its workers threads of the flow process, dashboard_address places
# (or, None, turns off) the dashboard. The others describe workers, which here are one node of the site.
LOCAL_CLUSTER_ARGS = frozenset({"processes", "dashboard_address"})


def local_cluster_kwargs(site: str | Site, given: dict[str, Any]) -> dict[str, Any]:
    """`cluster_kwargs` for the local cluster: LocalCluster's arguments it honours are kept, the others
    refused in one line that says why (Dask's TypeError said neither)."""
    import inspect

    from distributed import LocalCluster, SpecCluster

    local_only = set(inspect.signature(LocalCluster).parameters) - set(inspect.signature(SpecCluster).parameters)
    refused = sorted(set(given) & local_only - LOCAL_CLUSTER_ARGS)
    if refused:
        name = site if isinstance(site, str) else site.name
        raise UserError(
            f"task_runner(cluster_kwargs={{{refused[0]!r}: ...}}): hpc-garage's local cluster has the workers of "
            f"one node of site {name!r} (`hpc-garage show --site {name}`), not distributed.LocalCluster's "
            f"{', '.join(refused)}; choose another site (site=..., ${SITE_ENV}), or pass "
            "cluster_class=\"distributed.LocalCluster\" for prefect-dask's own cluster")
    return dict(given)


class HpcTaskRunner(DaskTaskRunner):
    """DaskTaskRunner that places tasks by their `dask-resource:` tags, runs them with per-worker set-up
    done once (`prefect_fast`), and refuses unguarded scripts."""

    RECORD_TIMEOUT = 120.0  # s the flow waits at its end for Prefect's API to record its finished tasks
    SETTLE_TIMEOUT = 30.0  # s the flow waits at its end for Dask's callbacks of its done tasks (in_flight.Ends)

    def __init__(self, *args: Any, pruner: Any = None, metric: str | None = None, mode: str = "min",
                 max_in_flight: int | None = None, **kwargs: Any) -> None:
        check_settings(pruner, metric, mode)
        self.max_in_flight = in_flight.check_limit(max_in_flight)  # tasks unfinished in Dask at once
        self._in_flight: in_flight.InFlight | None = None  # made at the first submission: the flow's runner is pickled
        self._releaser: in_flight.Releaser | None = None  # finished persisted tasks' Dask futures dropped
        super().__init__(*args, **kwargs)
        self.pruner, self.metric, self.mode = pruner, metric, mode  # the trials' reports (prefect/metrics.py)
        self._metrics: TrialMetrics | None = None  # started at the first submission, in the flow's process only
        self._metrics_asked = False
        self._placeable: set[frozenset[tuple[str, float]]] = set()  # resource sets some worker offers
        self._submitter: Any = None  # prefect_fast.Submitter, or False once the plain path was chosen
        self._ends = in_flight.Ends()  # ids of task runs whose dask future finished, and callbacks still to run
        self._sweep_tasks = SweepTasks()  # under `hpc-garage run`: trials cached across the sweep's jobs
        self._flow_run_noted = False
        self._given = 0  # trials this runner was given: its maps' lengths and its single submissions
        self._mapping = False

    def __enter__(self) -> HpcTaskRunner:
        if not (self.address or runner_has_cluster(self)):
            refusals.refuse_unguarded_flow_call()
        if "security" not in self.client_kwargs and (security := _running_worker_security()) is not None:
            # a task submitting tasks: Prefect entered this copy of the flow's runner on a Dask worker, and
            # prefect-dask connects it to the worker's scheduler with client_kwargs alone; on a TLS cluster
            # those must carry the credentials, which the local path keeps in cluster_kwargs
            self.client_kwargs = {**self.client_kwargs, "security": security}
        log.setup()  # the flow's process: hpc-garage's own lines (an API outage: outage.py) on its stderr
        outage.install()  # the flow run's states survive an API outage (prefect/outage.py)
        super().__enter__()
        return self

    @property
    def metrics(self) -> TrialMetrics | None:
        """The flow's trials' reports (prefect/metrics.py), from the first submission on (hpc_garage.search)."""
        return self._metrics

    def duplicate(self) -> HpcTaskRunner:
        """Prefect enters a duplicate of the flow's runner for each flow run: it keeps the pruner settings."""
        copy = super().duplicate()
        copy.pruner, copy.metric = getattr(self, "pruner", None), getattr(self, "metric", None)
        copy.mode = getattr(self, "mode", "min")
        copy.max_in_flight = getattr(self, "max_in_flight", None)
        return copy

    def __exit__(self, *exc: Any) -> None:
        try:
            if late := self._ends.settle(self.SETTLE_TIMEOUT):
                self.logger.warning(f"hpc-garage: Dask had not run the callbacks of {late} finished tasks after "
                                    f"{self.SETTLE_TIMEOUT:.0f} s; they may be missing from the flow's counts")
            in_flight.close(self._releaser)  # the last finished trials released while the client lives
            if self._metrics is not None:
                self._metrics.close()  # the last reports and the trials' ends, written while the client lives
            if self._ends.finished and outage.api_down():  # bookkeeping only: the work is done (outage.py)
                outage.report_at_flow_end(self._ends.finished,
                                          self._sweep_tasks.storage and str(self._sweep_tasks.storage),
                                          self.client)
            else:
                self._await_recorded()
        finally:
            self._submitter and self._submitter.close()  # its shared task parts leave the scheduler
            super().__exit__(*exc)

    def map(self, task: Any, parameters: dict[str, Any], wait_for: Any = None) -> Any:
        """Prefect's map, which the scheduler hears the length of first (the back-pressure holds most of it)."""
        if (n := in_flight.mapped_length(parameters)) is not None and runner_started(self):
            self._given += n
            announce_trials(self.client, f"{os.getpid()}-{id(self):x}", self._given)
        self._mapping = True
        try:
            return super().map(task, parameters, wait_for)
        finally:
            self._mapping = False

    def submit(self, task: Any, parameters: dict[str, Any], wait_for: Any = None,
               dependencies: Any = None) -> Any:  # map() submits through here too
        self._given += not self._mapping
        if not self._flow_run_noted:  # the flow run exists by its first submission (not yet at __enter__)
            self._flow_run_noted = True
            if (context := FlowRunContext.get()) is not None and context.flow_run is not None:
                note_flow_run(str(context.flow_run.id))
        if not self._metrics_asked:  # reports can only come from tasks submitted from here on
            self._metrics_asked = True
            if _running_worker_security() is None:  # the flow's process (a task's copy on a worker: not)
                self._metrics = TrialMetrics.for_runner(self.pruner, self.metric, self.mode)
                if self._metrics is not None:
                    self._metrics.start(self.client)
        task = self._sweep_tasks(task)
        resources = self._resources(task)
        with signals_unwrapped(), dask.annotate(resources=resources) if resources else contextlib.nullcontext():
            return self._submit(task, parameters, wait_for, dependencies)

    def _resources(self, task: Any) -> dict[str, float] | None:
        """What the task's tags ask for, merged under the caller's `dask.annotate`; None: leave it to Dask."""
        wanted = task_resources(task)
        current = dask.get_annotations().get("resources")
        if not wanted or callable(current):  # a per-key function from the caller decides on its own
            return None
        resources = {**wanted, **(current or {})}  # the caller's `dask.annotate` wins over the task's tags
        self._check_placeable(task, resources)
        return resources

    def _submit(self, task: Any, parameters: dict[str, Any], wait_for: Any, dependencies: Any) -> Any:
        """prefect-dask's submit, with its per-task set-up done once per worker (prefect_fast) where it can be."""
        call = self._fast_call(task, parameters, wait_for, dependencies)
        if self._in_flight is None:
            self._in_flight = in_flight.InFlight(self.max_in_flight, in_flight.client_threads(lambda: self.client),
                                                 unrecorded=recorded.for_flow_run(self._ends.count))
            self._releaser = in_flight.Releaser(lambda: self.client)
        (gate := self._in_flight).admit()  # back-pressure: waits while max_in_flight tasks are unfinished
        released = call is not None and in_flight.releases(task)
        try:
            if call is None:
                future = super().submit(task, parameters, wait_for, dependencies)
            else:
                first = {"priority": 1} if self._sweep_tasks.interrupted_first(task, parameters) else {}  # issue 24
                dask_future = self.client.submit(in_flight.run_released if released else prefect_fast.run_task,
                                                 key=call.key, pure=False, **first, **call.kwargs)
                # as prefect-dask does: Prefect finds upstream runs (and assets) by the task_run_id of argument futures
                dask_future.task_run_id = call.task_run_id
                future = in_flight.ReleasingFuture(wrapped_future=dask_future, task_run_id=call.task_run_id)
        except BaseException:
            gate.cancel()
            raise
        prefect_fast.forget_no_assets(future.task_run_id)  # either path noted an empty asset set per task run
        releaser = self._releaser if released else None
        done = in_flight.when_done(future, gate, self._ends, releaser, self._metrics)  # not self: no cycle
        future.wrapped_future.add_done_callback(done)
        return future

    def _fast_call(self, task: Any, parameters: dict[str, Any], wait_for: Any, dependencies: Any) -> Any:
        """run_task's arguments, or None for prefect-dask's own path (not started, or prefect_fast can't)."""
        if self._submitter is None:
            why = prefect_fast.problem()
            self._submitter = prefect_fast.Submitter(prefect_fast.Publisher(self.client)) if why is None else False
            if why is not None:
                self.logger.warning(f"hpc-garage: plain prefect-dask task submission ({why})")
        if not runner_started(self) or self._submitter is False:
            return None
        if not all(prefect_fast.is_plain(v) for v in parameters.values()):
            parameters = dask_futures(self, parameters)  # PrefectDaskFutures -> their dask futures
        wait_for = dask_futures(self, wait_for) if wait_for else None
        call = self._submitter.task_call(task, parameters, wait_for, dependencies)
        if call is None:
            self.logger.warning("hpc-garage: plain prefect-dask task submission (prefect's context differs)")
            self._submitter = False
        return call

    def _await_recorded(self) -> None:
        """Prefect records task runs from their workers' events, a little after they finish: wait for it, so
        that when the flow returns its API shows every task that finished (bounded by RECORD_TIMEOUT)."""
        finished = self._ends.finished
        if not finished:
            return
        try:
            missing = recorded.await_recorded(finished, self.RECORD_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - the flow's own outcome matters more than this check
            self.logger.warning(f"hpc-garage: could not confirm the task runs with Prefect's API: {exc}")
            return
        if missing:
            self.logger.warning(f"hpc-garage: Prefect's API had not recorded {missing} of {len(finished)} "
                                f"finished task runs after {self.RECORD_TIMEOUT:.0f} s; they appear as the server "
                                "catches up")

    def _check_placeable(self, task: Any, resources: dict[str, float]) -> None:
        """Dask keeps a task no worker can take waiting forever; a typo (`gpu`) must not burn an allocation."""
        key = frozenset(resources.items())
        if key in self._placeable or self.adapt_kwargs:  # an adaptive cluster may grow the worker later
            return
        offered = _offered(self.client)
        if not any(all(have.get(k, 0) >= v for k, v in resources.items()) for have in offered):
            kinds = sorted({_describe(have) for have in offered if have}) or ["nothing"]
            raise UserError(
                f"task {task.name!r} asks for {_describe(resources)} but no worker of this cluster has that "
                f"(workers offer {'; '.join(kinds)}); fix the task's dask-resource: tags or use a site whose "
                f"workers hold it ({SITE_ENV}, `hpc-garage show`)"
            )
        self._placeable.add(key)


@contextlib.contextmanager
def signals_unwrapped() -> Iterator[None]:
    """A termination signal (Prefect's TerminationSignal for SIGTERM, KeyboardInterrupt) that lands while
    a library runs Python code for it comes out wrapped: pydantic's serializers (the settings and contexts
    every submission serializes) turn it into a PydanticSerializationError caused by it. Prefect's engine
    takes that for the flow's own error (Failed, not Crashed), so a wind-down's follow-up job is never
    submitted (issue 31). Raise the signal itself instead."""
    try:
        yield
    except Exception as exc:
        if (stop := _signal_in(exc)) is None:
            raise
        raise stop from None


def _signal_in(exc: BaseException) -> BaseException | None:
    """The termination signal among `exc`'s causes, if any."""
    from prefect.exceptions import ExternalSignal

    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, (ExternalSignal, KeyboardInterrupt)):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def worker_resources() -> list[dict[str, float]]:
    """Each worker's resources, from inside a running flow: e.g. to drop GPU tags where no worker has one."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    runner = context.task_runner if context else None
    if not isinstance(runner, DaskTaskRunner):
        raise UserError("worker_resources() works inside a flow run whose task runner is hpc_garage.task_runner()")
    return _offered(runner.client)


def _offered(client: Any) -> list[dict[str, float]]:
    """What the workers offer, and what pools that can still grow (from zero) will offer (exported by `run`)."""
    running = [dict(w.get("resources") or {}) for w in workers_now(client).values()]
    return running + json.loads(os.environ.get(POOL_RESOURCES_ENV, "[]"))


def task_resources(task: Any) -> dict[str, float]:
    """Resources from the task's tags and any enclosing `prefect.tags(...)`; zero amounts ask for nothing."""
    tags = set(task.tags) | set(TagsContext.get().current_tags or ())
    try:
        resources = resources_from_tags(tags)
    except UserError as exc:
        raise UserError(f"task {task.name!r}: {exc}") from None
    return {k: v for k, v in resources.items() if v > 0}


def _running_worker_security() -> Any:
    """The credentials of the Dask worker running the current task, or None outside a task."""
    from distributed import get_worker

    try:
        return get_worker().security
    except ValueError:
        return None


def _describe(resources: dict[str, float]) -> str:
    from hpc_garage.core.units import format_bytes

    return ", ".join(f"{k}={format_bytes(v).replace(' ', '')}" if k == "MEMORY" else f"{k}={v:g}"
                     for k, v in sorted(resources.items()))


class _CallableModule(type(sys)):  # type: ignore[misc]
    """Before 0.1.0's restructure this module's place was hpc_garage/prefect.py, and `from hpc_garage.prefect
    import task_runner` gave the function: calling this module still does, with a DeprecationWarning."""

    def __call__(self, **kwargs: Any) -> HpcTaskRunner:
        import warnings

        warnings.warn("`from hpc_garage.prefect import task_runner` gives a module now; calling it is deprecated: "
                      "use hpc_garage.task_runner()", DeprecationWarning, stacklevel=2)
        return task_runner(**kwargs)


sys.modules[__name__].__class__ = _CallableModule
