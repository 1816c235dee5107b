"""Trials cached across the jobs of one sweep, with Prefect's own result persistence and cache policies.

Prefect's DEFAULT cache policy is task source + inputs + *flow run id*: a new job is a new flow run and
misses every cached result, so a resumed sweep would run everything again. Under `hpc-garage run` (which
exports the sweep and its results directory), a task that was given no cache policy of its own gets
`TASK_SOURCE + INPUTS + SweepScope(sweep@epoch)` instead, and persists its result on the sweep's shared
results directory; a finished trial is then read back, not run, by any later job of the same epoch, and by
a Dask recomputation after a worker holding its result was lost.

Honoured as Prefect defines them: `cache_policy=NO_CACHE` or `persist_result=False` (not cached),
`refresh_cache=True` (run again, result replaced), a task's own `cache_policy`/`cache_key_fn` (kept; its
result is still stored on the shared results directory unless it names a storage of its own). A task whose
source changed misses the cache: TASK_SOURCE is part of the key; `SweepPolicy` notes it (the epoch's
`.sources/` holds the sources each task name ran with), so `status` can say which trials ran again
because their source changed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from prefect.cache_policies import (INPUTS, NO_CACHE, TASK_SOURCE, CachePolicy, CompoundCachePolicy, Inputs,
                                     TaskSource)
from prefect.utilities.hashing import hash_objects

from hpc_garage.cluster.stopping import note_trial
from hpc_garage.cluster.stopping import trial as note_of
from hpc_garage.compat import cache_policy_unset
from hpc_garage.core.sweep import SOURCE_CHANGES, SOURCES_DIR, TRIALS_DIR
from hpc_garage.files import append_private
from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV

__all__ = ["SweepPolicy", "SweepScope", "SweepTasks", "sweep_policy", "trial_key"]


@dataclass
class SweepScope(CachePolicy):
    """The part of a cache key that says which sweep (and epoch) a result belongs to."""

    sweep: str = ""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        return self.sweep or None


@dataclass
class SweepPolicy(CompoundCachePolicy):
    """TASK_SOURCE + INPUTS + SweepScope, keyed as Prefect's compound policy keys them; with `results` (the
    epoch's results directory) it also notes a trial whose task source changed since it last ran there, from
    the source and inputs keys it computes anyway (a trial's inputs are hashed once, not twice)."""

    results: str = ""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        keys = [(policy, policy.compute_key(task_ctx=task_ctx, inputs=inputs, flow_parameters=flow_parameters,
                                            **kwargs)) for policy in self.policies]
        key = _combined(keys)
        if self.results and task_ctx is not None and key is not None:
            note_source(Path(self.results), task_ctx.task.name, keys, key)
        if key is not None and getattr(task_ctx, "task_run", None) is not None:  # its checkpoint dir, its record
            note_trial(task_ctx.task_run.id.hex, key, task_ctx.task.name)
        return key


def _combined(keys: list[tuple[Any, str | None]]) -> str | None:
    """The compound key of its policies' keys, as Prefect's CompoundCachePolicy combines them."""
    found = [key for _, key in keys if key is not None]
    return hash_objects(*found, raise_on_failure=True) if found else None


_known_sources: dict[tuple[Path, str], set[str]] = {}  # (results, task name) -> its sources in that epoch


def note_source(results: Path, task_name: str, keys: list[tuple[Any, str | None]], key: str) -> None:
    """Note a trial that runs again because its task's source changed: one line in SOURCE_CHANGES. The epoch's
    `.sources/` holds each task's sources (one file per task name, a line per source); while a task has had
    one source, a trial costs no file operation (a sweep of 100,000 trials wrote 100,000 files before). Once
    it has had several, a trial whose result under another source exists, and under this one does not, ran
    again because of it. Never fails the trial."""
    try:
        source = next((k for policy, k in keys if isinstance(policy, TaskSource)), None)
        if source is None:
            return
        known = _sources_of(results, task_name, source)
        if len(known) < 2 or (results / key).exists():
            return
        for other in known - {source}:
            before = _combined([(p, other if isinstance(p, TaskSource) else k) for p, k in keys])
            if before is not None and (results / before).exists():
                inputs = next((k for policy, k in keys if isinstance(policy, Inputs)), None)
                change = {"task": task_name, "trial": hash_objects(task_name, inputs), "at": time.time()}
                append_private(results / SOURCE_CHANGES, [json.dumps(change)])
                return
    except Exception:  # noqa: BLE001 - bookkeeping for `status`; the trial itself must not depend on it
        return


def _sources_of(results: Path, task_name: str, source: str) -> set[str]:
    """The sources `task_name` has run with in this epoch, `source` among them (read once per process, and
    again only when a source is new to it)."""
    known = _known_sources.get((results, task_name))
    if known is not None and source in known:
        return known
    path = results / SOURCES_DIR / f"task-{hash_objects(task_name)}"
    try:
        known = set(path.read_text().split())
    except FileNotFoundError:
        known = set()
    if source not in known:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        append_private(path, [source])
        known.add(source)
    _known_sources[(results, task_name)] = known
    return known


def task_context() -> Any:
    """The Prefect task run this thread runs, or None."""
    from prefect.context import TaskRunContext

    return TaskRunContext.get()


def trial_key(task_ctx: Any, sweep: str) -> str | None:
    """The key a trial's result has (or would have) in `sweep`, computed as SweepPolicy computes it: the
    trial's checkpoint directory is named by it, so a changed source or input never finds an old one."""
    known = note_of(task_ctx.task_run.id.hex)
    if known is not None:
        return str(known["key"])
    policy = SweepPolicy(policies=[TASK_SOURCE, INPUTS, SweepScope(sweep=sweep)])
    return policy.compute_key(task_ctx=task_ctx, inputs=task_ctx.parameters or {}, flow_parameters={})


def sweep_policy(sweep: str, results: Path | None = None) -> CachePolicy:
    return SweepPolicy(policies=[TASK_SOURCE, INPUTS, SweepScope(sweep=sweep)], results=str(results or ""))


def _interrupted_keys(results: Path) -> set[str]:
    """The epoch's trials interrupted and still to be continued: a record, no result, not given up."""
    found = set()
    for record in (results / TRIALS_DIR).glob("*.json") if (results / TRIALS_DIR).is_dir() else ():
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        key = str(data.get("trial", ""))
        if key and not key.startswith("task:") and "gave_up" not in data and not (results / key).exists():
            found.add(key)
    return found


class SweepTasks:
    """Gives each task the sweep's caching, once per task object (a flow submits one task many times)."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        self.sweep = env.get(SWEEP_ENV) or None
        self.storage = Path(env[RESULTS_ENV]) if self.sweep and env.get(RESULTS_ENV) else None
        self._done: dict[int, tuple[Any, Any]] = {}  # id(task) -> (task, its sweep version)
        self._interrupted: set[str] | None = None  # result keys of the epoch's interrupted trials, read once

    def interrupted_first(self, task: Any, parameters: dict[str, Any]) -> bool:
        """Whether this call continues a trial an earlier job of the epoch interrupted (cluster/wind_down.py's
        records): the follow-up job starts those first. Free where the epoch has none (one directory read per
        flow); else the trial's key, computed as its result's."""
        if self._interrupted is None:
            self._interrupted = _interrupted_keys(self.storage) if self.storage is not None else set()
        if not self._interrupted:
            return False
        ctx = SimpleNamespace(task=task, task_run=None, parameters=parameters)
        key = SweepPolicy(policies=[TASK_SOURCE, INPUTS, SweepScope(sweep=str(self.sweep))]).compute_key(
            task_ctx=ctx, inputs=parameters, flow_parameters={})
        return key in self._interrupted

    def __call__(self, task: Any) -> Any:
        if self.storage is None:
            return task
        known = self._done.get(id(task))
        if known is not None and known[0] is task:
            return known[1]
        swept = self._swept(task)
        self._done[id(task)] = (task, swept)
        return swept

    def _swept(self, task: Any) -> Any:
        if task.persist_result is False or task.cache_policy in (None, NO_CACHE):
            return task  # the task opted out (or Prefect's settings turned caching off)
        options: dict[str, Any] = {}
        if cache_policy_unset(task):
            options["cache_policy"] = sweep_policy(str(self.sweep), self.storage)
        if task.result_storage is None:
            options["result_storage"] = self.storage
        if task.persist_result is None:
            options["persist_result"] = True
        return task.with_options(**options) if options else task
