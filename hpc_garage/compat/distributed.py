"""distributed's private names: the scheduler and the clusters hpc-garage drives without a public hook for it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from hpc_garage.compat import versions
from hpc_garage.compat.versions import uses


@uses("distributed", "distributed.utils._forkserver_preload_set")
def skip_forkserver_optional_preload() -> bool:
    """distributed, when a Nanny first uses the forkserver, preloads every optional package it knows
    (pandas, numpy, ...) into it. Ours is preloaded already; mark it done. Fallback where the flag is gone:
    nothing (distributed then imports those packages, which only costs start-up time)."""
    import distributed.utils

    if not versions.in_range("distributed") or not hasattr(distributed.utils, "_forkserver_preload_set"):
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


@uses("distributed", "Worker.state.executing / Worker.state.long_running / TaskState.key")
def executing_now(dask_worker: Any) -> list[str]:
    """Run on each worker (run_on_workers): the keys it executes now, as its own state machine has them. The
    scheduler's `WorkerState.executing` is what the last heartbeat said (under load, seconds late: a trial
    that just started is not there, and one that is about to finish a result looks already done)."""
    state = dask_worker.state
    return [str(ts.key) for ts in (*state.executing, *state.long_running)]


@uses("distributed", "WorkerMemoryManager.memory_pause_fraction / Worker.status")
def hold_pause(dask_worker: Any) -> bool:
    """Run on each worker (run_on_workers) once `pause_workers` paused it: keep it paused. distributed's memory
    monitor resumes a paused worker whose memory is below its pause fraction within 0.1 s (it cannot tell this
    pause from its own; measured: a cancelled sweep of 3-s trials ran on to its end), and the scheduler then
    hands it new trials. So the monitor stops pausing (the job is ending) and the worker pauses itself."""
    from distributed.core import Status

    manager = getattr(dask_worker, "memory_manager", None)
    if manager is not None:
        manager.memory_pause_fraction = False
    if dask_worker.status == Status.running:
        dask_worker.status = Status.paused  # told to the scheduler, as the monitor's own pause is
    return True


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


class _NoTracebackBelowWarning(logging.Filter):
    """distributed.batched logs a stream that closed while the cluster ends ("Batched Comm Closed") at INFO with
    its traceback: an expected end, so the line is kept and the traceback dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING and record.exc_info:
            record.exc_info, record.exc_text = None, None
        return True


HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat"  # Worker.heartbeat's logger.exception


class _HeartbeatAsTheWorkerCloses(logging.Filter):
    """A worker whose heartbeat was in flight as the scheduler closed its streams logs it at ERROR with the
    traceback, also when the worker itself is closing (the cluster ends: seen under load, after a flow's last
    line). Then it is an expected end: the line is kept at INFO, without the traceback. A heartbeat that fails
    while a worker of this process still runs keeps its ERROR and traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith(HEARTBEAT_FAILED) and workers_closing():
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
            record.exc_info, record.exc_text = None, None
        return True


_QUIET = _NoTracebackBelowWarning()
_HEARTBEAT = _HeartbeatAsTheWorkerCloses()


@uses("distributed", "Worker._instances / Status.closing (a worker's own close under way)")
def workers_closing() -> bool:
    """Whether this process has workers and every one of them is closing or closed (False outside the verified
    range: a traceback is then kept rather than hidden)."""
    from distributed import Worker
    from distributed.core import Status

    if not versions.in_range("distributed"):
        return False
    workers = list(Worker._instances)
    ending = {Status.closing, Status.closing_gracefully, Status.closed, Status.failed}
    return bool(workers) and all(worker.status in ending for worker in workers)


def quiet_expected_closes() -> None:
    """In a process that runs a scheduler or workers: their expected closes say one line, not a traceback (once
    per process; a worker process calls it from its preload, launchers/worker_setup.py)."""
    logging.getLogger("distributed.batched").addFilter(_QUIET)  # a filter already there is not added again
    logging.getLogger("distributed.worker").addFilter(_HEARTBEAT)


@uses("distributed", "SpansSchedulerExtension.spans / Span._metadata (the scheduler's \"spans\" extension)")
def trim_span_metadata(scheduler: Any) -> int:
    """Each `Client.submit` adds `{"type": "Future"}` to its span's metadata on the scheduler, which keeps them
    all (distributed 2026.8: a 300,000-trial sweep, 300,000 dicts). Keep each kind once (what the metadata
    says: which collections ran); how many entries were dropped. Fallback where the names are gone: nothing."""
    extension = scheduler.extensions.get("spans")
    if extension is None or not versions.in_range("distributed"):
        return 0
    dropped = 0
    for span in list(extension.spans.values()):
        collections = (span._metadata or {}).get("collections")
        if collections and len(collections) > 1:
            kinds = list({repr(c): c for c in collections}.values())
            dropped += len(collections) - len(kinds)
            collections[:] = kinds
    return dropped
