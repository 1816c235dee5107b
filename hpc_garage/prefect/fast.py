"""Prefect's fixed cost per task on a Dask worker, cut without changing what Prefect records.

Why this module exists. prefect-dask 0.3.7 + Prefect 3.8 spend ~190 ms per trivial task, nearly all of it
set-up that is the same for every task of a flow (py-spy, 2 workers x 1 thread, issue 5):
- on the worker, `hydrated_context` re-validates the whole Settings model from the serialized settings
  (pydantic-settings reads the environment, profiles and .env files: 60 % of the context set-up), and a
  Prefect client is built twice per task, each time loading the CA bundle in
  `ssl.create_default_context(cafile=certifi.where())` (50 % of a task's samples, even for http://);
- in the flow process, `serialize_context` re-serializes the same Settings for every submit (94 % of it),
  then the flow run context, whose result store costs a JSON schema per block per call; and dask tokenizes
  the arguments to make a key that is unique anyway (each call has a fresh task run id).

What this module does instead, with Prefect's own engine (`run_task_sync`/`run_task_async`) still running
every task and emitting every state event, log and result as under prefect-dask:
- flow side (`Submitter`): the context is `serialize_context()`'s, composed from the same parts, but the
  settings are serialized and hashed once per settings object (sent as a SettingsPayload) and the flow run
  context once per flow run (and its state), pickled once. The first task's context is compared with
  Prefect's own. The dask key is `<task name>-<task run id hex>`: nothing to tokenize.
- worker side (`run_task`): a SettingsContext is validated once per distinct settings hash per process,
  and a sync Prefect client is built and opened once per worker thread and settings hash; both are set as
  the current contexts before Prefect's engine starts, so `hydrated_context` uses them.
- tag concurrency: before each task Prefect asks the API whether its tags (`dask-resource:GPU=1`...) have
  concurrency limits, caching "none" for only 5 s per process. On a busy server that call stalled GPU
  trials for seconds while they held their GPU (the packing benchmark: 28-70 GPU-seconds lost per sweep
  of 48 s of work). Workers keep "no limits for these tags" for TAG_LIMITS_TTL (60 s) instead, and then ask
  again in the background while trials go on with that answer (up to TAG_LIMITS_STALE): asked in the trial,
  the question stalled every thread of a worker for up to 38 s on a busy server (a 2-node job: the last 1,000
  of 10,000 trials took 43 s where each 1,000 before took 4.5). What differs is that a tag limit created
  during a run binds this run's tasks within a minute and the API's answer, not within 5 s.

It relies on Prefect internals (`serialize_context`'s parts and the private deployment context variables,
`hydrated_context` skipping an empty `settings_context` and taking its client from `SyncClientContext`,
the contexts' `__var__`). `problem()` checks them and the version (compat.VERIFIED: 3.8 and 3.9), the first task
checks the composed context; where either differs HpcTaskRunner uses prefect-dask's own path, with a
warning. HPC_GARAGE_PREFECT_FAST=0 forces that path.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import inspect
import json
import logging
import os
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import prefect
import prefect.context
from prefect.context import SettingsContext, SyncClientContext, serialize_context

from hpc_garage.compat import (VERIFIED, answer_cached_tag_limits_in_thread, context_var, deployment_context,
                               has_context_vars, has_deployment_context, in_range, stretch_no_tag_limits_cache,
                               tag_limits_survive_outages)
from hpc_garage import log
from hpc_garage.prefect.shared import Pickled, Publisher, Shared, value
from hpc_garage.variables import PREFECT_FAST, switch

__all__ = ["SettingsPayload", "Submitter", "TaskCall", "problem", "run_task", "worker_stats"]

DISABLE_ENV = PREFECT_FAST
TAG_LIMITS_TTL = 60.0  # s a worker trusts "these tags have no concurrency limits" (Prefect's own: 5 s)
TAG_LIMITS_STALE = 600.0  # s past it that answer still stands while the API is asked again in the background
CONTEXT_KEYS = frozenset({"flow_run_context", "task_run_context", "tags_context", "settings_context",
                          "asset_context", "deployment_id", "deployment_parameters"})

logger = logging.getLogger(__name__)  # a worker's stderr (the job log): tag limits kept through an API outage


def problem() -> str | None:
    """Why the fast path cannot be used with this Prefect, or None. Cheap; checked once per runner."""
    if not switch(os.environ, DISABLE_ENV, True):  # a value that is neither on nor off is refused in one line
        return f"{DISABLE_ENV}={os.environ[DISABLE_ENV]}"
    if not in_range("prefect", prefect.__version__):  # the releases these hooks were verified on (compat.VERIFIED)
        low, high = VERIFIED["prefect"]
        return f"prefect {prefect.__version__} is outside the verified range >={low},<{high}"
    from prefect.context import hydrated_context

    if not has_context_vars(SettingsContext, SyncClientContext):
        return "prefect's context classes no longer carry their ContextVar"
    if "client" not in SyncClientContext.model_fields:
        return "SyncClientContext has no `client` field"
    if not has_deployment_context() or not hasattr(prefect.context, "AssetContext"):
        return "prefect.context lacks the deployment context variables or AssetContext"
    if list(inspect.signature(hydrated_context).parameters) != ["serialized_context", "client"]:
        return "prefect.context.hydrated_context changed its signature"
    return None


# ------------------------------------------------------------------------------------------ flow side


@dataclass(frozen=True)
class SettingsPayload:
    """Prefect's serialized settings and their content hash: the worker validates each hash once."""

    key: str
    data: dict[str, Any] | Shared  # Shared: published once to the scheduler (prefect/shared.py)


@dataclass(frozen=True)
class TaskCall:
    key: str  # the dask key
    task_run_id: uuid.UUID
    kwargs: dict[str, Any]  # for run_task


@dataclass
class Submitter:
    """Flow side of one task runner: builds run_task's arguments for each submitted task.

    The context is Prefect's `serialize_context()`, composed here from the same parts, with the two parts
    that are the same for every task of a flow run serialized once: the settings (per settings object;
    they travel as a SettingsPayload) and the flow run context (per flow run context object and flow run
    state). The first task's context is compared with Prefect's own; if they differ, None: plain path.
    """

    publisher: Publisher | None = None  # None: every task carries the shared parts itself
    _settings_key: Any = None  # the SettingsContext the payload was made from (held: compared by identity)
    _payload: SettingsPayload | None = None
    _flow_key: tuple[Any, ...] | None = None
    _flow_data: dict[str, Any] = field(default_factory=dict)
    _flow_pickled: Any = None
    _verified: bool = False

    def task_call(self, task: Any, parameters: dict[str, Any], wait_for: Any,
                  dependencies: dict[str, set[Any]] | None) -> TaskCall | None:
        """run_task's arguments, or None when this Prefect's context differs from what run_task expects."""
        from distributed import Future
        from prefect.utilities.engine import collect_task_run_inputs_sync

        task_run_id = uuid.uuid4()
        inputs = {k: set() if is_plain(v) else collect_task_run_inputs_sync(v, future_cls=Future)
                  for k, v in parameters.items()}
        if dependencies:  # as prefect_dask.client.PrefectDaskClient.submit merges them
            inputs = {k: v.union(dependencies.get(k, set())) for k, v in inputs.items()}
        asset = {"task": task, "task_run_id": task_run_id, "task_inputs": inputs, "copy_to_child_ctx": True}
        context = self._context(asset)
        if not self._verified:
            if context != {**serialize_context(asset_ctx_kwargs=asset), "settings_context": {}}:
                self.close()  # what it published for this flow run is not needed: the plain path carries it
                return None
            self._verified = True
        if context["flow_run_context"]:
            context["flow_run_context"] = self._flow_pickled  # published (or pickled) once per flow run state
        task_ref = task if self.publisher is None else self.publisher.task(task)
        kwargs = {"task": task_ref, "task_run_id": task_run_id, "parameters": parameters, "wait_for": wait_for,
                  "return_type": "state", "dependencies": inputs, "context": context,
                  "settings": self._settings()}
        return TaskCall(key=f"{task.name}-{task_run_id.hex}", task_run_id=task_run_id, kwargs=kwargs)

    def _context(self, asset_ctx_kwargs: dict[str, Any]) -> dict[str, Any]:
        """`serialize_context(asset_ctx_kwargs)` of prefect 3.8, less the settings (sent separately)."""
        from prefect.context import AssetContext, TagsContext, TaskRunContext

        task_run_context, tags_context = TaskRunContext.get(), TagsContext.get()
        deployment_id, deployment_parameters = deployment_context()
        return {
            "flow_run_context": self._flow_run_context(),
            "task_run_context": task_run_context.serialize() if task_run_context else {},
            "tags_context": tags_context.serialize() if tags_context else {},
            "settings_context": {},
            "asset_context": AssetContext.from_task_and_inputs(**asset_ctx_kwargs).serialize(),
            "deployment_id": str(deployment_id) if deployment_id else None,
            "deployment_parameters": deployment_parameters,
        }

    def _flow_run_context(self) -> dict[str, Any]:
        """The flow run context serialized once per flow run: its result store alone costs ~20 ms to dump
        (a JSON schema per block per call). Re-done if the context, its flow run or that run's state change."""
        from prefect.context import EngineContext

        context = EngineContext.get()
        if context is None:
            return {}
        flow_run = context.flow_run
        key = (context, flow_run, getattr(flow_run, "state_id", None), context.parameters, context.result_store)
        if self._flow_key is None or any(a is not b for a, b in zip(key, self._flow_key)):
            self._flow_key, self._flow_data = key, context.serialize()
            self._flow_pickled = self._share(self._flow_data)
        return self._flow_data

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()

    def _share(self, value: Any) -> Any:
        """`value` as a Shared reference to it, published once; without a publisher, pickled once."""
        import cloudpickle

        return Pickled(value) if self.publisher is None else self.publisher.share(cloudpickle.dumps(value))

    def _settings(self) -> SettingsPayload | None:
        current = SettingsContext.get()
        if current is None:
            return None
        if current is not self._settings_key:
            data = current.serialize()
            digest = hashlib.sha256(json.dumps(_named_keys(data), sort_keys=True, default=str).encode()).hexdigest()
            self._settings_key = current
            self._payload = SettingsPayload(digest, data if self.publisher is None else self._share(data))
        return self._payload


def _named_keys(value: Any) -> Any:
    """`value` with every mapping key a string, for its hash: Prefect 3.8.0 serializes an active profile's
    settings keyed by `Setting` objects (later 3.8 releases by their names), which json can neither sort nor
    write. The payload itself keeps Prefect's own keys: it travels pickled."""
    if isinstance(value, dict):
        return {str(getattr(k, "name", k)): _named_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_named_keys(v) for v in value]
    return value


def is_plain(value: Any) -> bool:
    """A value that holds no futures or states: Prefect's visit_collection need not walk it."""
    return type(value) in (int, float, str, bool, bytes, type(None))


def forget_no_assets(task_run_id: uuid.UUID) -> None:
    """Prefect notes each submitted task run's assets in the flow run context for its downstream tasks, an empty
    set for a task that has none (a flow held one per task: ~0.3 KB each). An empty one tells nothing: dropped."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is not None and not context.task_run_assets.get(task_run_id, True):
        del context.task_run_assets[task_run_id]


# ---------------------------------------------------------------------------------------- worker side


class _WorkerState(threading.local):
    clients: dict[str, Any]

    def __init__(self) -> None:
        self.clients = {}  # settings hash -> open SyncClientContext, for this worker thread


_local = _WorkerState()
_settings: OrderedDict[str, SettingsContext] = OrderedDict()  # settings hash -> validated context
_lock = threading.Lock()
_stats = {"settings_validated": 0, "clients_built": 0, "tasks": 0}
_open_clients: list[Any] = []
MAX_SETTINGS = 8


def run_task(*, task: Any, task_run_id: uuid.UUID, parameters: dict[str, Any], wait_for: Any,
             return_type: str, dependencies: Any, context: dict[str, Any],
             settings: SettingsPayload | None) -> Any:
    """Run one task through Prefect's engine, inside this worker's cached settings and client."""
    from prefect.task_engine import run_task_async, run_task_sync

    if not _tuned:
        trust_no_tag_limits_longer()
    task = value(task)  # a Shared part: a fresh copy from the blob fetched once per worker (prefect/shared.py)
    if isinstance(context.get("flow_run_context"), Shared):
        context = {**context, "flow_run_context": value(context["flow_run_context"])}
    with _entered(SettingsContext, _settings_for(settings) if settings else None):
        client_context = _client_for(settings.key) if settings else None
        with _entered(SyncClientContext, client_context):
            with _lock:
                _stats["tasks"] += 1
            call = dict(task=task, task_run_id=task_run_id, parameters=parameters, wait_for=wait_for,
                        return_type=return_type, dependencies=dependencies, context=context)
            if task.isasync:
                return asyncio.run(run_task_async(**call))
            return run_task_sync(**call)


_tuned: list[bool] = []


def trust_no_tag_limits_longer(ttl: float = TAG_LIMITS_TTL) -> bool:
    """Stretch Prefect's per-process "no tag concurrency limits" cache (see the module docstring), and keep
    its last answer while the API does not answer (prefect/outage.py); False where this Prefect has no such
    cache, which leaves its behaviour as it is."""
    from hpc_garage.prefect.outage import api_answers, bypassed, is_outage_error

    _tuned.append(True)
    log.setup()  # once per worker process, at its first task: its lines reach the job log
    tag_limits_survive_outages(is_outage_error, api_answers, logger.info, bypassed)
    answer_cached_tag_limits_in_thread(bypassed, stale_for=TAG_LIMITS_STALE)
    return stretch_no_tag_limits_cache(ttl)


def worker_stats() -> dict[str, int]:
    """How often this process validated settings, built a Prefect client, and ran a task here."""
    return dict(_stats)


def _settings_for(payload: SettingsPayload) -> SettingsContext:
    with _lock:
        context = _settings.get(payload.key)
        if context is None:
            context = SettingsContext(**value(payload.data))  # what hydrated_context does for every task
            _stats["settings_validated"] += 1
            _settings[payload.key] = context
            while len(_settings) > MAX_SETTINGS:
                _settings.popitem(last=False)
        else:
            _settings.move_to_end(payload.key)
        return context


def _client_for(key: str) -> Any:
    """An open sync client for this thread and these settings (the settings context is entered)."""
    context = _local.clients.get(key)
    if context is None:
        context = SyncClientContext()  # get_client(sync_client=True): reads the API URL from the settings
        context.client.__enter__()
        if SettingsContext.get().settings.client.server_version_check_enabled:
            try:
                context.client.raise_for_api_version_mismatch_once()
            except Exception as exc:  # noqa: BLE001 - bookkeeping: the API being away must not fail a trial
                from hpc_garage.prefect.outage import is_outage_error

                if not is_outage_error(exc):
                    raise
        with _lock:
            _stats["clients_built"] += 1
            _open_clients.append(context.client)
        _local.clients[key] = context
    return context


class _entered:
    """Make `value` the current context of its kind for the block (a cached context is shared by
    successive tasks, so it is set through the ContextVar rather than entered, which Prefect forbids twice)."""

    def __init__(self, kind: Any, value: Any) -> None:
        self.var, self.value, self.token = context_var(kind), value, None

    def __enter__(self) -> None:
        if self.value is not None:
            self.token = self.var.set(self.value)

    def __exit__(self, *exc: Any) -> None:
        if self.token is not None:
            self.var.reset(self.token)


@atexit.register
def _close_clients() -> None:
    for client in _open_clients:
        try:
            client.__exit__(None, None, None)
        except Exception:  # noqa: BLE001 - the process is exiting; a half-closed socket is harmless
            pass
