"""Resource-aware placement on the Dask scheduler: a task that asks for resources (`GPU=1`, `MEMORY=…`) is
handed to a worker only when that worker has them *free*; until then it waits on the scheduler.

Why. distributed (checked up to 2026.8) assigns a resource-restricted task to a worker the moment it is
ready: among the workers that *have* the resource, the one with the least estimated work per thread. It
does not look at what is in use (`WorkerState.used_resources` is kept but never read), so a worker whose
only GPU is busy gets more GPU tasks, which wait there; scheduler-side queuing (`worker-saturation`) skips
restricted tasks, and work stealing rarely moves them (and, when it does, leaves `used_resources` wrong).
So the assignment made at submit time is final, and it rests on duration estimates that are often wrong
(a warm-up of short tasks with the same name; tasks of one name that differ in length). Measured in the
packing benchmark (issue 5; 8 one-GPU workers, 48 GPU trials of 1 s): every trial was assigned within
0.1-0.7 s of the sweep's start, then sat on its worker a median 4-6 s (up to 15 s); GPUs ran 2 to 11
trials each while others idled. The same problem is dask/distributed #6467, #9108 (open).

What. `install(scheduler)` adds a SchedulerPlugin that
- narrows `valid_workers` for a task with (strict) resource restrictions to the workers that have those
  resources free now: in use = the restrictions of the tasks the scheduler has processing there. Dask's
  own placement (`decide_worker`: dependencies, occupancy) then chooses among those, and with none the task
  goes to Dask's `no-worker` state: held on the scheduler, no worker assigned;
- hands held tasks out, in priority order, as soon as a task leaves a worker (finished, erred, released,
  its worker gone), plus a sweep every second as a safety net (a steal, a worker's resources changed);
- keeps held tasks from tripping `distributed.scheduler.no-workers-timeout`, which is meant for tasks no
  worker can ever take, not for tasks waiting their turn.
Workers joining, tags and restrictions, retries, `allow_other_workers=True` (left to Dask), unrestricted
tasks (Dask's queuing), and plain Dask clients of the same cluster are unchanged: the plugin lives on the
scheduler, so it applies to every client.

HPC_GARAGE_PLACEMENT=0 (in the environment of `hpc-garage run`, or of the flow for its own local cluster)
leaves placement to Dask. The cost: a freed resource waits one scheduler round trip for its next task
instead of finding it queued on its worker; meanwhile an unrestricted task queued there may take the
worker's free thread first (measured: ~1 s once per GPU in the packing benchmark, whose CPU-only trials
share the GPU workers' threads).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from distributed.diagnostics.plugin import SchedulerPlugin

from hpc_garage.compat import replace_valid_workers
from hpc_garage.variables import PLACEMENT as DISABLE_ENV, switch  # 0: Dask's own placement

from hpc_garage.core.pools import fits

if TYPE_CHECKING:
    from distributed import Scheduler
    from distributed.scheduler import TaskState, WorkerState

__all__ = ["DISABLE_ENV", "NAME", "FreeResourcePlacement", "enabled", "fits", "in_use", "install"]

NAME = "hpc-garage-placement"
SWEEP_SECONDS = 1.0  # the safety-net sweep over held tasks

Signature = tuple[Any, ...]  # tasks with equal signatures have the same eligible workers


def install(scheduler: Scheduler) -> FreeResourcePlacement:
    """Resource-aware placement on this scheduler, before or after it started (idempotent)."""
    plugin = scheduler.plugins.get(NAME)
    if not isinstance(plugin, FreeResourcePlacement):
        plugin = FreeResourcePlacement()
        scheduler.add_plugin(plugin, name=NAME)
    plugin.attach(scheduler)
    return plugin


def enabled(env: Mapping[str, str] | None = None) -> bool:
    return switch(os.environ if env is None else env, DISABLE_ENV, True, also_no=("dask",))




def in_use(ws: WorkerState) -> dict[str, float]:
    """Resources held on a worker by the tasks the scheduler has processing there (incl. seceded ones,
    which keep theirs). Computed, not read from `used_resources`, which work stealing leaves stale."""
    used: dict[str, float] = {}
    for ts in ws.processing:
        for r, amount in (ts.resource_restrictions or {}).items():
            used[r] = used.get(r, 0.0) + amount
    return used


def _strict(ts: TaskState) -> bool:
    """Restricted by resources, and neither `allow_other_workers=True` (Dask may place those anywhere) nor
    an actor (which Dask never holds in no-worker)."""
    return bool(ts.resource_restrictions) and not ts.loose_restrictions and not ts.actor


def _signature(ts: TaskState) -> Signature:
    return (tuple(sorted((ts.resource_restrictions or {}).items())), frozenset(ts.worker_restrictions or ()),
            frozenset(ts.host_restrictions or ()))


class FreeResourcePlacement(SchedulerPlugin):
    """See the module docstring. One instance per scheduler."""

    name = NAME
    idempotent = True

    def __init__(self) -> None:
        self.scheduler: Any = None
        self._dask_valid_workers: Any = None  # the scheduler's own method
        self._held: dict[Signature, list[tuple[Any, int, TaskState]]] = {}  # heaps by priority
        self._order = itertools.count()
        self._pending = False

    async def start(self, scheduler: Scheduler) -> None:
        self.attach(scheduler)

    def attach(self, scheduler: Scheduler) -> None:
        """Take over `valid_workers` and start the sweep; inert under HPC_GARAGE_PLACEMENT=0 (Dask's own
        placement: to compare, or should this ever misbehave)."""
        if self.scheduler is scheduler or not enabled():
            return
        from tornado.ioloop import PeriodicCallback

        self.scheduler = scheduler
        self._dask_valid_workers = replace_valid_workers(scheduler, self.valid_workers)
        timeout = getattr(scheduler, "no_workers_timeout", None)
        period = min(SWEEP_SECONDS, timeout / 4) if timeout else SWEEP_SECONDS
        sweep = PeriodicCallback(self.sweep, period * 1000)
        scheduler.periodic_callbacks[NAME] = sweep
        if scheduler.status.name == "running":  # else the scheduler starts it with the others
            sweep.start()

    # ------------------------------------------------------------------------------------ placement

    def valid_workers(self, ts: TaskState) -> set[WorkerState] | None:
        """Dask's eligible workers, less those without the task's resources free (strict restrictions)."""
        valid = self._dask_valid_workers(ts)
        if valid is None or not _strict(ts):
            return valid
        wanted = ts.resource_restrictions
        return {ws for ws in valid if fits(wanted, ws.resources, in_use(ws))}

    def transition(self, key: Any, start: str, finish: str, *args: Any, **kwargs: Any) -> None:
        if self.scheduler is None:
            return
        if finish == "no-worker" and start != "no-worker":
            ts = self.scheduler.tasks.get(key)
            if ts is not None and _strict(ts):
                self._hold(ts)
        elif start == "processing" and self._held:
            self._soon()  # a task left a worker: its resources are free

    def _hold(self, ts: TaskState) -> None:
        heapq.heappush(self._held.setdefault(_signature(ts), []), (ts.priority or (), next(self._order), ts))

    def _soon(self) -> None:
        """Admit after the current stimulus is processed (a plugin must not transition inside one)."""
        if self._pending:
            return
        try:
            asyncio.get_running_loop().call_soon(self.admit)
        except RuntimeError:
            return  # no loop (a scheduler driven by hand): the sweep admits
        self._pending = True

    def admit(self) -> int:
        """Hand held tasks to workers with their resources free, best priority first; how many."""
        self._pending = False
        s = self.scheduler
        if not s.unrunnable:
            self._held.clear()  # every held task left no-worker by another path
            return 0
        admitted = 0
        stimulus_id = f"hpc-garage-placement-{time.time()}"
        for signature, heap in list(self._held.items()):
            while heap:
                ts = heap[0][2]
                if ts.state != "no-worker" or s.tasks.get(ts.key) is not ts:
                    heapq.heappop(heap)  # admitted, released or forgotten meanwhile
                    continue
                if _signature(ts) != signature:  # restrictions changed (resubmitted with new annotations)
                    heapq.heappop(heap)
                    self._hold(ts)
                    continue
                if not s.running or not self.valid_workers(ts):
                    break  # none free for this signature: the same holds for the rest of its heap
                s.transitions({ts.key: "processing"}, stimulus_id)
                if ts.state == "no-worker":
                    break
                heapq.heappop(heap)
                admitted += 1
            if not heap:
                self._held.pop(signature, None)
        return admitted

    def sweep(self) -> None:
        """Every SWEEP_SECONDS: admit what an unnoticed event freed; keep waiting tasks off the timeout."""
        if self._held:
            self.admit()
        self._refresh_no_worker_times()

    def _refresh_no_worker_times(self) -> None:
        """`no-workers-timeout` fails a task that stays `no-worker` longer than that while workers run; a
        task only waiting for a worker's resources to free is re-dated, so it fails only if no worker that
        could ever run it is left. (Re-inserted with now: `unrunnable` stays ordered by time.)"""
        s = self.scheduler
        timeout = getattr(s, "no_workers_timeout", None)
        if not timeout or not s.running or not s.unrunnable:
            return
        now = time.monotonic()
        waiting = [ts for ts, since in s.unrunnable.items()
                   if now - since > timeout / 4 and _strict(ts) and self._dask_valid_workers(ts)]
        for ts in waiting:
            del s.unrunnable[ts]
            s.unrunnable[ts] = now
