"""Every use of another package's private names, in one place, each with the versions it was verified on.

hpc-garage reaches into distributed, dask-jobqueue, Prefect and prefect-dask where they have no public hook
for what it needs (the reason is given at each use). Those names can change in any release, so:
- each use is declared here with `@uses(package, what, verified)`; `VERIFIED` is the range of each package
  the uses were checked against, and `pyproject.toml`'s bounds are the same ranges (a test holds them equal);
- outside its range, or where the name is gone, a use either falls back (said where) or raises
  `CompatError`, one line naming the package, its version and the range, never an AttributeError.
`uses_outside_range()` lists what the installed versions put at risk; `hpc-garage --version` does not import
this module (it imports the packages it names, lazily, per use).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from hpc_garage.core.errors import UserError

# package → [lowest verified, first unverified): the installed versions were checked by the test suite
VERIFIED: dict[str, tuple[str, str]] = {
    "distributed": ("2026.8.0", "2026.9.0"),
    "dask-jobqueue": ("0.9.0", "0.10.0"),
    "prefect": ("3.8.0", "3.10.0"),
    "prefect-dask": ("0.3.7", "0.4.0"),
}


class CompatError(UserError):
    """An installed package lacks a private name hpc-garage needs: install a verified version."""


@dataclass(frozen=True)
class Use:
    package: str
    what: str  # the private name, as the package spells it
    function: str  # the function here that touches it


USES: list[Use] = []
F = TypeVar("F", bound=Callable[..., Any])


def uses(package: str, what: str) -> Callable[[F], F]:
    """Declare that the decorated function touches `what` of `package`; an AttributeError or ImportError
    from it becomes a CompatError naming the package, its version and the verified range."""

    def decorate(function: F) -> F:
        USES.append(Use(package, what, function.__name__))

        def explain(exc: BaseException) -> CompatError:
            return CompatError(f"{package} {version(package)} has no {what} (hpc-garage uses it, verified on "
                               f"{package}>={VERIFIED[package][0]},<{VERIFIED[package][1]}: {exc}); "
                               f"install {package}>={VERIFIED[package][0]},<{VERIFIED[package][1]}")

        if asyncio.iscoroutinefunction(function):
            @functools.wraps(function)
            async def guarded_async(*args: Any, **kwargs: Any) -> Any:
                try:
                    return await function(*args, **kwargs)
                except (AttributeError, ImportError) as exc:
                    raise explain(exc) from None

            return guarded_async  # type: ignore[return-value]

        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except (AttributeError, ImportError) as exc:
                raise explain(exc) from None

        return guarded  # type: ignore[return-value]

    return decorate


@functools.cache
def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _key(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def in_range(package: str, installed: str | None = None) -> bool:
    low, high = VERIFIED[package]
    installed = version(package) if installed is None else installed
    return bool(re.match(r"\d", installed)) and _key(low) <= _key(installed) < _key(high)


def uses_outside_range() -> list[str]:
    """One line per private use whose package is installed outside the verified range."""
    return [f"{u.package} {version(u.package)}: {u.what} ({u.function}; verified {VERIFIED[u.package][0]}.."
            f"<{VERIFIED[u.package][1]})" for u in USES if not in_range(u.package)]


def installed_versions() -> list[str]:
    """`hpc-garage --version`'s line per package: installed version, and whether it is in the verified range
    (read from the installed metadata: nothing is imported)."""
    lines = []
    for package, (low, high) in VERIFIED.items():
        installed, wanted = version(package), f">={low},<{high}"
        if in_range(package, installed):
            lines.append(f"{package} {installed}: in the verified range {wanted}")
        else:
            lines.append(f"{package} {installed}: OUTSIDE the verified range {wanted} (hpc-garage's uses of its "
                         f"private names fall back or refuse); pip install '{package}{wanted}'")
    return lines


# --------------------------------------------------------------------------- the registry's newest releases


def newest_release(releases: list[str]) -> str | None:
    """The newest final release (no a/b/rc/dev/post suffix: pip does not pick those either), or None."""
    final = [r for r in releases if re.fullmatch(r"\d+(\.\d+)*", r.strip())]
    return max(final, key=lambda r: tuple(int(x) for x in r.split(".")), default=None)


def release_news(newest: dict[str, str | None]) -> list[tuple[bool, str]]:
    """(still verified, line) per package of VERIFIED, from its newest release on the registry (None: none
    found). A release at or past the range's first unverified version is news: verify it, then widen."""
    news = []
    for package, (low, high) in VERIFIED.items():
        release, wanted = newest.get(package), f">={low},<{high}"
        if release is None:
            news.append((False, f"{package}: no release found on the registry (verified {wanted})"))
        elif _key(release) >= _key(high):
            news.append((False, f"{package} {release} is released, past the verified range {wanted}: run the "
                                f"tests on it (the fast path, every private name in hpc_garage/compat.py), then widen "
                                "VERIFIED there and pyproject.toml's bound"))
        else:
            news.append((True, f"{package} {release} (newest): in the verified range {wanted}"))
    return news


def registry_releases(package: str) -> list[str]:
    """Every version of `package` on the package index, as `pip index versions` lists them (the user's pip
    configuration holds: index, mirror, proxy)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package], capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired:
        raise UserError(f"`pip index versions {package}` did not answer within 120 s; check the network or "
                        "pip's index configuration (pip config list)") from None
    listed = next((line for line in done.stdout.splitlines() if line.startswith("Available versions:")), None)
    if done.returncode != 0 or listed is None:
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"`pip index versions {package}` failed ({said}); check the network or pip's index "
                        "configuration (pip config list)")
    return [v.strip() for v in listed.split(":", 1)[1].split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    """`python -m hpc_garage.compat [--latest]`: the installed versions against the verified ranges; with
    --latest also each package's newest release on the index. Exit 1 where one is past its range."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m hpc_garage.compat", description=main.__doc__)
    parser.add_argument("--latest", action="store_true", help="also ask the package index for the newest releases")
    args = parser.parse_args(argv)
    for line in installed_versions():
        print(line)
    if not args.latest:
        return 0 if all(in_range(p) for p in VERIFIED) else 1
    try:
        news = release_news({p: newest_release(registry_releases(p)) for p in VERIFIED})
    except UserError as exc:
        print(f"hpc-garage: error: {exc}", file=sys.stderr)
        return 2
    for _, line in news:
        print(line)
    return 0 if all(ok for ok, _ in news) else 1


# --------------------------------------------------------------------------------------------- distributed


@uses("distributed", "distributed.utils._forkserver_preload_set")
def skip_forkserver_optional_preload() -> bool:
    """distributed, when a Nanny first uses the forkserver, preloads every optional package it knows
    (pandas, numpy, ...) into it. Ours is preloaded already; mark it done. Fallback where the flag is gone:
    nothing (distributed then imports those packages, which only costs start-up time)."""
    import distributed.utils

    if not in_range("distributed") or not hasattr(distributed.utils, "_forkserver_preload_set"):
        return False
    distributed.utils._forkserver_preload_set = True
    return True


@uses("distributed", "Scheduler.handle_worker_status_change / Scheduler.stream_comms / op worker-status-change")
def pause_workers(scheduler: Any) -> int:
    """Pause every running worker, as distributed does for memory pressure: a paused worker finishes the
    tasks it is executing and starts no other, and the scheduler hands it none. (No public call pauses a
    worker; retire_workers moves work elsewhere instead of stopping it, which is not what a job about to
    end needs.) How many were paused."""
    from distributed.core import Status

    paused = 0
    stimulus_id = f"hpc-garage-wind-down-{time.time()}"
    for ws in list(scheduler.workers.values()):
        if ws.status != Status.running:
            continue
        scheduler.handle_worker_status_change(Status.paused, ws, stimulus_id)
        scheduler.stream_comms[ws.address].send(
            {"op": "worker-status-change", "status": "paused", "stimulus_id": stimulus_id})
        paused += 1
    return paused


@uses("distributed", "op run (Client.run's message to workers) / Scheduler.broadcast / Serialized")
async def run_on_workers(scheduler: Any, function: Any, *args: Any, timeout: float = 10.0) -> dict[str, Any]:
    """`function(*args)` on every worker, from the scheduler's own process, as Client.run does it (the
    scheduler has no client of its own): {worker address: its answer}; a worker that fails or does not
    answer within `timeout` is left out. `function` is pickled by reference: it must be importable there."""
    import asyncio

    from distributed.protocol import deserialize, pickle
    from distributed.protocol.serialize import Serialized

    msg = {"op": "run", "function": pickle.dumps(function), "args": pickle.dumps(args),
           "kwargs": pickle.dumps({}), "wait": True}
    try:
        answers = await asyncio.wait_for(scheduler.broadcast(msg=msg, on_error="ignore"), timeout)
    except (asyncio.TimeoutError, OSError):
        return {}
    found: dict[str, Any] = {}
    for address, answer in answers.items():
        if not isinstance(answer, dict) or answer.get("status") != "OK":
            continue
        result = answer.get("result")
        if isinstance(result, Serialized):
            result = deserialize(result.header, result.frames)
        found[address] = result
    return found


@uses("distributed", "Scheduler._instances")
def scheduler_at(address: str) -> Any:
    """The Scheduler object in this process listening at `address`, or None. (The jobqueue launcher
    attaches dask-jobqueue's clusters to `run`'s own scheduler; distributed keeps no public registry.)"""
    from distributed import Scheduler

    return next((s for s in Scheduler._instances if s.address == address), None)


@uses("distributed", "Scheduler.valid_workers")
def replace_valid_workers(scheduler: Any, valid_workers: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Install `valid_workers` as the scheduler's worker filter; return the scheduler's own. (No plugin hook
    decides which workers may take a task: dask/distributed #6467, #9108.)"""
    own = scheduler.valid_workers
    scheduler.valid_workers = valid_workers
    return own


@uses("distributed", "SpecCluster._correct_state")
async def correct_state(cluster: Any) -> None:
    """Make a SpecCluster start the jobs its worker_spec gained now, so a refusal is seen by the caller
    (SpecCluster.scale only schedules it)."""
    await cluster._correct_state()


@uses("distributed", "SpecCluster._new_worker_name / SpecCluster._i / Cluster._update_worker_status")
def attached_spec_cluster(base: type) -> type:
    """A dask-jobqueue cluster class that never reuses a job name (an old job's workers may linger under it)
    and that does not itself replace workers that leave (the launcher does, by its own policy)."""
    from distributed.deploy.cluster import Cluster

    class Attached(base):  # type: ignore[misc, valid-type]
        def new_worker_spec(self) -> dict[str, Any]:
            name = self._new_worker_name(self._i)
            self._i += 1
            return {name: self.new_spec}

        def _update_worker_status(self, op: str, msg: Any) -> None:
            Cluster._update_worker_status(self, op, msg)

    Attached.__name__ = Attached.__qualname__ = f"Attached{base.__name__}"
    return Attached


# ------------------------------------------------------------------------------------------- dask-jobqueue


@uses("dask-jobqueue", "Job._call / Job._submit_job / Job._job_id_from_submit_output")
def hooked_job(base: type) -> type:
    """A dask-jobqueue Job class whose batch commands run with `call_options()` (the subclass says: a clean
    environment, their own session) and whose every submission is reported to `submitted(future, parse)`
    and finished even if its caller is cancelled (so a job submitted by an interrupted start-up is known and
    cancelled)."""

    class Hooked(base):  # type: ignore[misc, valid-type]
        @staticmethod
        def call_options() -> dict[str, Any]:
            return {}

        def submitted(self, submission: asyncio.Future[str], parse: Callable[[str], str]) -> None:
            """Called with each submission under way and the parser of its output into a job id."""

        @classmethod
        async def _call(cls, cmd: list[str], **kwargs: Any) -> str:
            return await base._call(cmd, **{**cls.call_options(), **kwargs})

        async def _submit_job(self, script_filename: str) -> str:
            inner = asyncio.ensure_future(base._submit_job(self, script_filename))
            self.submitted(inner, self._job_id_from_submit_output)
            return await asyncio.shield(inner)

    Hooked.__name__ = Hooked.__qualname__ = f"Hooked{base.__name__}"
    return Hooked


# ------------------------------------------------------------------------------------------------ prefect


@uses("prefect", "prefect._internal.result_records.ResultRecordMetadata / BaseModel.model_rebuild(_types_namespace)")
def rebuild_context_models() -> None:
    """Rebuild Prefect's run-context models once per worker forkserver: `hydrated_context` does it before
    every task otherwise (a no-op once done), and the first task on each worker pays for it."""
    from prefect._internal.result_records import ResultRecordMetadata
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.flows import Flow
    from prefect.tasks import Task

    types = {"Flow": Flow, "Task": Task, "ResultRecordMetadata": ResultRecordMetadata}
    FlowRunContext.model_rebuild(_types_namespace=types)
    TaskRunContext.model_rebuild(_types_namespace=types)


@uses("prefect", "prefect.context._deployment_id / _deployment_parameters")
def deployment_context() -> tuple[Any, Any]:
    """(deployment id, deployment parameters) of the current context: `serialize_context`'s parts."""
    from prefect.context import _deployment_id, _deployment_parameters

    return _deployment_id.get(), _deployment_parameters.get()


@uses("prefect", "prefect.context._deployment_id / _deployment_parameters")
def has_deployment_context() -> bool:
    """Whether `deployment_context()` can read them (else the fast path is not taken)."""
    import prefect.context

    return all(hasattr(prefect.context, n) for n in ("_deployment_id", "_deployment_parameters"))


@uses("prefect", "ContextModel.__var__")
def has_context_vars(*kinds: Any) -> bool:
    """Whether `context_var()` can read each context class's ContextVar (else the fast path is not taken)."""
    return all(hasattr(kind, "__var__") for kind in kinds)


@uses("prefect", "Task._user_cache_policy")
def cache_policy_unset(task: Any) -> bool:
    """Whether the task was given no cache policy (nor key function): Prefect then applies DEFAULT, which
    keys on the flow run, and hpc-garage may key it on the sweep instead. (Task keeps only the resolved
    policy in public; an explicit `cache_policy=DEFAULT` is the user's choice and stays.)"""
    from prefect.utilities.annotations import NotSet

    return task._user_cache_policy is NotSet and task.cache_key_fn is None


@uses("prefect", "ContextModel.__var__")
def context_var(kind: Any) -> Any:
    """The ContextVar behind a Prefect context class (set directly: a cached context is shared)."""
    return kind.__var__


@uses("prefect", "prefect.concurrency.services._no_limits_cache / _cache_lock")
def stretch_no_tag_limits_cache(ttl: float) -> bool:
    """Keep Prefect's per-process "no concurrency limits for these tags" answer `ttl` seconds. Fallback
    where the cache is gone or changed: False, and Prefect's own behaviour."""
    try:
        import cachetools
        from prefect.concurrency import services
    except ImportError:
        return False
    cache = getattr(services, "_no_limits_cache", None)
    if not in_range("prefect") or not isinstance(cache, cachetools.TTLCache):
        return False
    with services._cache_lock:
        if cache.ttl < ttl:
            services._no_limits_cache = cachetools.TTLCache(maxsize=cache.maxsize, ttl=ttl)
    return True


# ------------------------------------------------------------------------------------------- prefect-dask


@uses("prefect-dask", "DaskTaskRunner._started / _cluster")
def runner_started(runner: Any) -> bool:
    """Whether a DaskTaskRunner has entered (its client exists)."""
    return bool(runner._started)


@uses("prefect-dask", "DaskTaskRunner._cluster")
def runner_has_cluster(runner: Any) -> bool:
    """Whether a DaskTaskRunner was given a cluster object (rather than an address or a class to start)."""
    return runner._cluster is not None


@uses("prefect-dask", "DaskTaskRunner._optimize_futures")
def dask_futures(runner: Any, values: Any) -> Any:
    """`values` with every PrefectDaskFuture replaced by its dask future, as prefect-dask submits them."""
    return runner._optimize_futures(values)


@uses("prefect", "prefect.flow_engine.propose_state_sync / propose_state (the engine's module-level names)")
def keep_flow_states(wrap: Callable[[Any, bool], Any]) -> bool:
    """Route the flow engine's state proposals through `wrap(propose, is_async)` once per process: while
    Prefect's API does not answer, hpc-garage keeps the flow run's state locally (prefect/outage.py). The
    engine has no hook around its API calls. Fallback where the names are gone: False, Prefect's own
    behaviour (the flow fails after the client's retries)."""
    import prefect.flow_engine as engine

    if getattr(engine, "_hpc_garage_keeps_states", False):
        return True
    if not in_range("prefect") or not callable(getattr(engine, "propose_state_sync", None)) \
            or not callable(getattr(engine, "propose_state", None)):
        return False
    engine.propose_state_sync = wrap(engine.propose_state_sync, False)
    engine.propose_state = wrap(engine.propose_state, True)
    engine._hpc_garage_keeps_states = True
    return True


def before_exit_drains(callback: Callable[[], None]) -> bool:
    """Run `callback` as the interpreter begins to exit, before Prefect's queue services drain: they drain from
    CPython's threading exit hooks (`threading._register_atexit`, run last-registered first, before `atexit`),
    so a hook registered after them runs before them. False where CPython lacks it (nothing is done then)."""
    import threading

    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    register(callback)
    return True


def _running_instances(service: type) -> list[Any]:
    """The running instances of a Prefect queue service in this process ([] where the names are gone)."""
    if not in_range("prefect") or not hasattr(service, "_instances"):
        return []
    with service._instance_lock:
        return [i for i in service._instances.values() if isinstance(i, service)]  # one dict for all kinds


@uses("prefect", "QueueService._instances / _instance_lock / _queue; EventsWorker._context_cache")
def take_queued(service: type) -> list[tuple[Any, Any]]:
    """Take the items out of the queues of every running instance of a Prefect queue service (EventsWorker,
    APILogWorker) in this process: (item, the `contextvars.Context` the service kept to finish it with, or
    None). Used once the API is known gone: each queued item would otherwise be retried against it at exit;
    the caller keeps them for replay. Fallback where the names are gone: [], nothing taken."""
    import queue

    taken: list[tuple[Any, Any]] = []
    for instance in _running_instances(service):
        items = getattr(instance, "_queue", None)
        if not isinstance(items, queue.Queue):
            continue
        contexts = getattr(instance, "_context_cache", None)  # EventsWorker: the emitter's run context per event
        stop = False
        while True:
            try:
                item = items.get_nowait()
            except queue.Empty:
                break
            items.task_done()
            if item is None:
                stop = True  # the service's own stop marker stays
                continue
            context = contexts.pop(getattr(item, "id", None), None) if isinstance(contexts, dict) else None
            taken.append((item, context))
        if stop:
            items.put_nowait(None)
    return taken


def queued_log(item: Any) -> dict[str, Any] | None:
    """One item `take_queued(APILogWorker)` took, as the log's `LogCreate` dict: Prefect 3.8 queues that dict
    (its size under `__payload_size__`), 3.9 the log's JSON as bytes. None for anything else (not kept)."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        try:
            item = json.loads(bytes(item))
        except ValueError:
            return None
    if not isinstance(item, dict):
        return None
    return {k: v for k, v in item.items() if k != "__payload_size__"}


@uses("prefect", "EventsWorker._client / PrefectEventsClient._unconfirmed_events")
def unconfirmed_events(service: type) -> list[Any]:
    """The events each running EventsWorker's client sent, or failed to send, without the server confirming
    them yet (the client resends them only when it reconnects): a server killed meanwhile may have lost
    them. Fallback where the names are gone: []."""
    events: list[Any] = []
    for instance in _running_instances(service):
        unconfirmed = getattr(getattr(instance, "_client", None), "_unconfirmed_events", None)
        if isinstance(unconfirmed, list):
            events += list(unconfirmed)
    return events


@uses("prefect", "prefect.concurrency.services.ConcurrencySlotAcquisitionWithLeaseService.acquire / "
                 "_create_empty_limits_response / _should_use_cache / _no_limits_cache / _cache_lock")
def tag_limits_survive_outages(is_outage: Callable[[BaseException], bool], answers: Callable[[], bool],
                               warn: Callable[[str], None], bypassed: Callable[[], bool] = lambda: False) -> bool:
    """Before every tagged task Prefect asks the API for the tags' concurrency slots; an unreachable or
    overloaded API then fails the trial before its function runs (seen: a 503 left a trial Pending and
    failed the flow). Where this process already saw those tags limit-free, the last answer stands while the
    API does not answer (a limit created meanwhile cannot be known anyway); otherwise Prefect's error stands.
    Fallback where the names are gone: False, Prefect's own behaviour. `bypassed()` true (the bench's switch):
    Prefect's own acquire, straight through."""
    from prefect.concurrency import services

    cls = getattr(services, "ConcurrencySlotAcquisitionWithLeaseService", None)
    if cls is None or getattr(cls, "_hpc_garage_survives", False):
        return cls is not None
    if not in_range("prefect") or not callable(getattr(services, "_create_empty_limits_response", None)) \
            or not callable(getattr(services, "_should_use_cache", None)) \
            or not hasattr(getattr(services, "_no_limits_cache", None), "get") or not hasattr(services, "_cache_lock"):
        return False
    own = cls.acquire
    limit_free: set[frozenset[str]] = set()
    down: list[bool] = [False]

    async def acquire(self: Any, slots: int, mode: Any, timeout_seconds: Any = None, max_retries: Any = None,
                      lease_duration: float = 300, strict: bool = False, holder: Any = None) -> Any:
        if bypassed():
            return await own(self, slots, mode, timeout_seconds, max_retries, lease_duration, strict, holder)
        names = frozenset(self.concurrency_limit_names)
        known_free = names in limit_free and services._should_use_cache(self.concurrency_limit_names, holder)
        if known_free:
            with services._cache_lock:
                cached = services._no_limits_cache.get(names, False)
            if cached:  # Prefect answers from its own cache, asking the API nothing: no probe (one per
                # tagged task cost 70% of tasks/s, bench/fault_cost.py)
                return await own(self, slots, mode, timeout_seconds, max_retries, lease_duration, strict, holder)
        if known_free and not await asyncio.to_thread(answers):  # Prefect's own cache missed: one short
            # probe first, or a dead API holds the trial (and its GPU) for the client's retries (measured: 76 s)
            if not down[0]:
                warn(f"Prefect's API does not answer; tags {sorted(names)} were limit-free when last asked, and "
                     "trials run on that answer")
            down[0] = True
            return services._create_empty_limits_response()
        try:
            response = await own(self, slots, mode, timeout_seconds, max_retries, lease_duration, strict, holder)
        except Exception as exc:
            if not (known_free and is_outage(exc)):
                raise
            if not down[0]:
                warn(f"Prefect's API does not answer ({type(exc).__name__}); tags {sorted(names)} were limit-free "
                     "when last asked, and the trial runs on that answer")
            down[0] = True
            return services._create_empty_limits_response()
        down[0] = False
        try:
            if not response.json().get("limits"):
                limit_free.add(names)
        except Exception:  # noqa: BLE001 - an answer that is not JSON says nothing about limits
            pass
        return response

    acquire.__wrapped__ = own  # type: ignore[attr-defined]  # inspect.unwrap finds Prefect's own
    cls.acquire = acquire
    cls._hpc_garage_survives = True
    return True


if __name__ == "__main__":
    raise SystemExit(main())
