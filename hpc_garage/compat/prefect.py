"""Prefect's private names: the run contexts the fast path sets, the task's cache policy, the tag-limit cache,
and what the flow keeps while the API is down (its state proposals, the queue services' items)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from hpc_garage.compat import versions
from hpc_garage.compat.versions import uses


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
    if not versions.in_range("prefect") or not isinstance(cache, cachetools.TTLCache):
        return False
    with services._cache_lock:
        if cache.ttl < ttl:
            services._no_limits_cache = cachetools.TTLCache(maxsize=cache.maxsize, ttl=ttl)
    return True


def _cached_no_limits(services: Any, names: Any, holder: Any) -> bool:
    """Prefect's own per-process cache says a task run's tags `names` have no concurrency limits."""
    if not services._should_use_cache(list(names), holder):
        return False
    with services._cache_lock:
        return bool(services._no_limits_cache.get(frozenset(names), False))


@uses("prefect", "prefect.concurrency._sync.acquire_concurrency_slots_with_lease (the module-level name the sync "
                 "concurrency() calls) / release_concurrency_slots_with_lease / services._should_use_cache / "
                 "_no_limits_cache / _cache_lock")
def answer_cached_tag_limits_in_thread(bypassed: Callable[[], bool] = lambda: False, stale_for: float = 0.0) -> bool:
    """Before each tagged task Prefect's sync `concurrency()` hops to its event-loop thread and on into the
    acquisition service's, only to read "no limits for these tags" from its own cache there: two thread hops
    per trial, about 5 % of a worker's CPU on trivial trials. Where that cache holds the answer, it is read
    in the task's own thread and the same empty response returned (not the DEBUG line "do not exist -
    skipping acquisition"); otherwise Prefect's path runs. Fallback where the names are gone: False.

    With `stale_for`: once the cache's answer expires, the task does not wait for the API's next one (a busy
    server took up to 38 s, and every thread of a worker waited at once). Tags the cache called limit-free
    within `stale_for` s are answered so again while one thread per tag set asks Prefect's own question in the
    background; its answer refills the cache, and a slot it took because limits exist now is given back at once
    (the next trials then take Prefect's path and honour them)."""
    import threading

    from prefect.concurrency import _sync, services

    if getattr(_sync, "_hpc_garage_in_thread", False):
        return True
    own = getattr(_sync, "acquire_concurrency_slots_with_lease", None)
    if not versions.in_range("prefect") or not callable(own) \
            or not callable(getattr(services, "_should_use_cache", None)) \
            or not hasattr(getattr(services, "_no_limits_cache", None), "get") or not hasattr(services, "_cache_lock"):
        return False
    try:
        from prefect.client.schemas.responses import ConcurrencyLimitWithLeaseResponse
    except ImportError:
        return False
    seen_free: dict[frozenset[str], float] = {}  # tag set -> when the cache last said "no limits" here
    asking: set[frozenset[str]] = set()  # tag sets whose question is being asked in the background
    lock = threading.Lock()

    def empty() -> Any:
        return ConcurrencyLimitWithLeaseResponse.model_validate({"lease_id": str(uuid.uuid4()), "limits": []})

    def ask_again(key: frozenset[str], names: list[str], slots: int, kwargs: dict[str, Any]) -> None:
        try:
            answer = own(names, slots, **kwargs)
            if answer.limits:  # limits exist now: this slot was taken for nothing
                with lock:
                    seen_free.pop(key, None)
                _sync.release_concurrency_slots_with_lease(answer.lease_id)
        except Exception:  # noqa: BLE001 - asked again at the next miss; past stale_for, Prefect's path decides
            pass
        finally:
            with lock:
                asking.discard(key)

    def acquire(names: list[str], slots: int, *args: Any, **kwargs: Any) -> Any:  # concurrency() passes keywords
        if args or kwargs.get("strict") or bypassed():
            return own(names, slots, *args, **kwargs)
        key, now, holder = frozenset(names), time.monotonic(), kwargs.get("holder")
        if _cached_no_limits(services, names, holder):
            if stale_for:
                with lock:
                    seen_free[key] = now
            return empty()
        if not stale_for or not services._should_use_cache(list(names), holder):  # Prefect's cache would not either
            return own(names, slots, *args, **kwargs)
        with lock:
            stale = now - seen_free.get(key, -stale_for) < stale_for
            if stale and key not in asking:
                asking.add(key)
                threading.Thread(target=ask_again, args=(key, list(names), slots, kwargs), daemon=True,
                                 name="hpc-garage-tag-limits").start()
        return empty() if stale else own(names, slots, *args, **kwargs)

    acquire.__wrapped__ = own  # type: ignore[attr-defined]
    _sync.acquire_concurrency_slots_with_lease = acquire
    _sync._hpc_garage_in_thread = True
    return True


@uses("prefect", "prefect.flow_engine.propose_state_sync / propose_state (the engine's module-level names)")
def keep_flow_states(wrap: Callable[[Any, bool], Any]) -> bool:
    """Route the flow engine's state proposals through `wrap(propose, is_async)` once per process: while
    Prefect's API does not answer, hpc-garage keeps the flow run's state locally (prefect/outage.py). The
    engine has no hook around its API calls. Fallback where the names are gone: False, Prefect's own
    behaviour (the flow fails after the client's retries)."""
    import prefect.flow_engine as engine

    if getattr(engine, "_hpc_garage_keeps_states", False):
        return True
    if not versions.in_range("prefect") or not callable(getattr(engine, "propose_state_sync", None)) \
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
    if not versions.in_range("prefect") or not hasattr(service, "_instances"):
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
                               warn: Callable[[str], None], bypassed: Callable[[], bool] = lambda: False,
                               patience: float = 600.0) -> bool:
    """Before every tagged task Prefect asks the API for the tags' concurrency slots; an unreachable or
    overloaded API then fails the trial before its function runs (seen: a 503 left a trial Pending and
    failed the flow). Where this process already saw those tags limit-free, the last answer stands while the
    API does not answer (a limit created meanwhile cannot be known anyway); otherwise, while the API is up but
    too busy to answer (its /health answers), the trial waits, asking again for up to `patience` seconds, and
    where it is down Prefect's error stands at once, as before.
    Fallback where the names are gone: False, Prefect's own behaviour. `bypassed()` true (the bench's switch):
    Prefect's own acquire, straight through."""
    from prefect.concurrency import services

    cls = getattr(services, "ConcurrencySlotAcquisitionWithLeaseService", None)
    if cls is None or getattr(cls, "_hpc_garage_survives", False):
        return cls is not None
    if not versions.in_range("prefect") or not callable(getattr(services, "_create_empty_limits_response", None)) \
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
        if known_free and _cached_no_limits(services, names, holder):  # Prefect answers from its own cache,
            # asking the API nothing: no probe (one per tagged task cost 70% of tasks/s, bench/fault_cost.py)
            return await own(self, slots, mode, timeout_seconds, max_retries, lease_duration, strict, holder)
        if known_free and not await asyncio.to_thread(answers):  # Prefect's own cache missed: one short
            # probe first, or a dead API holds the trial (and its GPU) for the client's retries (measured: 76 s)
            if not down[0]:
                warn(f"Prefect's API does not answer; tags {sorted(names)} were limit-free when last asked, and "
                     "trials run on that answer")
            down[0] = True
            return services._create_empty_limits_response()

        def ask() -> Any:
            return own(self, slots, mode, timeout_seconds, max_retries, lease_duration, strict, holder)

        try:
            response = await ask()
        except Exception as exc:
            if not is_outage(exc) or not known_free and not await asyncio.to_thread(answers):
                raise  # nothing known of these tags and no API to wait for: Prefect's error stands, at once
            if not down[0]:
                warn(f"Prefect's API does not answer ({type(exc).__name__}); tags {sorted(names)} " + (
                    "were limit-free when last asked, and the trial runs on that answer" if known_free else
                    f"were not yet seen limit-free here and it is up, so the trial waits for its answer (<= "
                    f"{patience:g} s)"))
            down[0] = True
            if known_free:
                return services._create_empty_limits_response()
            response = await _asked_again(ask, lambda e: is_outage(e) and answers(), patience)  # Prefect's to say
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


async def _asked_again(ask: Callable[[], Any], busy: Callable[[BaseException], bool], patience: float,
                       first: float = 1.0) -> Any:
    """Ask again, backing off, while the API is up but busy (`busy(error)`; Prefect's client has retried already:
    a 503 from a server whose database is busy outlasted its retries in a 2-node, 16-thread job): the trial waits
    for the answer instead of failing before it starts, for `patience` seconds at most."""
    deadline, delay = time.monotonic() + patience, first
    while True:
        await asyncio.sleep(delay)
        try:
            return await ask()
        except Exception as exc:
            delay = min(2 * delay, 30.0)
            if time.monotonic() + delay > deadline or not await asyncio.to_thread(busy, exc):
                raise
