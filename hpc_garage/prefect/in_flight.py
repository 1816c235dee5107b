"""A flow's tasks in bounded memory, however many it submits (issue 32).

Why. prefect-dask hands every submitted task to the scheduler at once and keeps each finished task's Dask
future for as long as the flow holds its Prefect future (a `.map` over 100,000 trials: all of them). The
scheduler then holds every task (~50 KB each: its arguments, Prefect's context) and each worker every result it
computed: 100,000 trivial trials took 6 GB in the scheduler and 7 GB in two workers.

What this module does, with every trial still one Prefect task run that Prefect's engine runs and records:
- back-pressure (`InFlight`): before each submission the flow's thread waits while `limit` of the runner's
  tasks are unfinished in Dask (and while Prefect's server is far behind recording them: recorded.py).
  `task_runner(max_in_flight=N)` sets it; the default is sized to the workers (PER_THREAD per worker thread, at
  least MINIMUM), re-asked as workers join;
- release (`Releaser`): a finished task whose result Prefect persists (under `hpc-garage run`, the sweep's
  results directory, sweep_cache.py) is gathered as its final State, and its Dask future dropped, so the
  scheduler and its worker forget it. The worker sends the State with the result's record metadata in place
  of the value (`run_released`): the value stays in the results store, and `.result()` reads it back from
  there (Prefect's own path for a State that came from its API). A task whose result is not persisted keeps
  its Dask future, as under prefect-dask: its result lives nowhere else.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable

from hpc_garage.compat import at_least, release_future, releasing_future_class
from hpc_garage.core.errors import UserError
from hpc_garage.prefect import fast as prefect_fast

__all__ = ["Ends", "InFlight", "Releaser", "ReleasingFuture", "check_limit", "client_threads", "close", "default_limit",
           "mapped_length", "read_back", "releases", "run_released", "when_done", "RELEASE_FROM"]

MINIMUM = 1000  # tasks in flight at least: ~50 MB in the scheduler; enough queued for an adaptive pool to grow on
PER_THREAD = 4  # tasks in flight per worker thread: each has its next task queued beside it
RECHECK = 2.0  # s between asks for the workers' threads while the flow waits at the default limit
BATCH = 1000  # finished tasks gathered in one call

logger = logging.getLogger(__name__)


def check_limit(value: Any) -> int | None:
    """`task_runner(max_in_flight=...)`: a positive whole number, or None for the default; else one line."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"task_runner(max_in_flight={value!r}): give a whole number of tasks, at least 1 "
                        f"(or leave it out: {PER_THREAD} per worker thread, at least {MINIMUM})")
    return value


def client_threads(client: Callable[[], Any]) -> Callable[[], int]:
    """The workers' threads, as a Dask client (the runner's, once it has one) counts them now."""
    return lambda: sum(client().nthreads().values())


def default_limit(threads: int) -> int:
    return max(MINIMUM, PER_THREAD * threads)


class InFlight:
    """How many of a runner's tasks are unfinished in Dask, and the wait that keeps it under the limit."""

    def __init__(self, limit: int | None, threads: Callable[[], int], clock: Callable[[], float] = time.monotonic,
                 unrecorded: Any = None):
        self._fixed, self._threads, self._clock = limit, threads, clock
        self.unrecorded = unrecorded  # recorded.Unrecorded: Prefect's server kept within reach, or None
        self._limit: int | None = limit
        self._asked = -RECHECK
        self._count = 0
        self.peak = 0  # the most unfinished at once (tests, the bench)
        self._cond = threading.Condition()

    @property
    def count(self) -> int:
        return self._count

    def limit(self) -> int:
        """The limit now: the given one, else sized to the workers (asked at most every RECHECK s)."""
        if self._fixed is not None:
            return self._fixed
        now = self._clock()
        if self._limit is None or now - self._asked >= RECHECK:
            self._asked = now
            try:
                self._limit = default_limit(self._threads())
            except Exception as exc:  # noqa: BLE001 - a scheduler busy answering: keep the last limit
                logger.debug("workers' threads unknown (%s): keeping %s in flight", exc, self._limit)
                self._limit = self._limit or MINIMUM
        return self._limit

    def admit(self) -> None:
        """Wait (the flow's thread) until one more task may be in flight, and count it; first, while Prefect's
        server is far behind recording the finished ones (outside the lock: it may ask the API)."""
        if self.unrecorded is not None:
            self.unrecorded.wait()
        with self._cond:
            while self._count >= self.limit():
                self._cond.wait(RECHECK)
            self._count += 1
            self.peak = max(self.peak, self._count)

    def cancel(self) -> None:
        """A task admitted but never submitted (its submission raised)."""
        self.finished()

    def finished(self) -> None:
        """One task left Dask's unfinished ones (Dask's callback thread)."""
        with self._cond:
            self._count -= 1
            self._cond.notify()


class ReleasingFuture(releasing_future_class()):  # type: ignore[misc]
    """The runner's Prefect future: once released, `.result()` reads the value back from the results store."""

    def result(self, timeout: float | None = None, raise_on_failure: bool = True) -> Any:
        state = self.final(timeout)
        if not _is_state(state):
            return state
        found = read_back(state)
        return found if found is not NOTHING else state.result(raise_on_failure=raise_on_failure, _sync=True)


NOTHING = object()


def read_back(state: Any) -> Any:
    """A Completed state's value from the file its record metadata names, read as Prefect's ResultStore reads an
    unsaved local file system's (ResultStore._from_metadata); NOTHING where that is not the case, or the read
    fails (Prefect's own path then reads it, with its retries). Prefect's path costs ~9 ms a result (a store and
    a file-system block built, an event loop crossed); this one a file read."""
    from pathlib import Path

    from prefect.results import ResultRecord, ResultRecordMetadata

    data = state.data
    if not (state.is_completed() and isinstance(data, ResultRecordMetadata) and data.storage_block_id is None
            and data.storage_key and Path(data.storage_key).is_absolute()):
        return NOTHING
    try:
        return ResultRecord.deserialize(Path(data.storage_key).read_bytes(), backup_serializer=data.serializer).result
    except Exception as exc:  # noqa: BLE001 - Prefect's own path decides, with its retries
        logger.debug("reading %s back: %s", data.storage_key, exc)
        return NOTHING


class Releaser:
    """Gathers finished tasks' final States (a thread of its own, BATCH at a time) and drops their Dask futures."""

    def __init__(self, client: Callable[[], Any]) -> None:
        self._client = client  # the runner's Dask client, once it has one
        self._queue: deque[Any] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.released = 0

    def finished(self, future: Any) -> None:
        """A persisted task's Dask future is done (Dask's callback thread: only enqueues)."""
        with self._cond:
            if self._closed:
                return
            self._queue.append(future)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hpc-garage-release", daemon=True)
                self._thread.start()
            self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Release what is queued, then stop (the flow's end, while the client lives)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            self._release(batch)

    def _release(self, batch: list[Any]) -> None:
        wrapped = [f.wrapped_future for f in batch]
        try:
            states = self._client().gather(wrapped, errors="raise")
        except Exception as exc:  # noqa: BLE001 - a lost worker, a closing client: those keep their futures
            logger.debug("releasing %d finished tasks: %s", len(batch), exc)
            return
        for future, state in zip(batch, states):
            if _is_state(state):
                release_future(future, state)
                self.released += 1


class Ends:
    """The task runs whose Dask future finished, and the futures whose done-callback has not run yet.

    Dask runs a future's callbacks on a thread of its own, a little after its result is there: the flow can
    hold every result and return while the last callbacks wait their turn (under load, seen in CI: 14 of 200).
    The runner's end waits for the callbacks of every future that is done (`settle`), so its last tasks are
    counted, released, reported and waited for at Prefect's API like the others. Only unfinished futures are
    held here: memory stays bounded by the work in flight."""

    def __init__(self) -> None:
        self._finished = bytearray()  # ids of task runs whose Dask future finished, 16 bytes each (a flow of
        # 300,000 trials: 5 MB, where a list of UUIDs took 30)
        self._pending: dict[int, Any] = {}  # id() -> Dask future, until its callback ran
        self._cond = threading.Condition()

    def __reduce__(self) -> tuple[type[Ends], tuple[()]]:
        return Ends, ()  # the runner travels pickled with its flow: a copy starts with nothing in flight

    def submitted(self, dask_future: Any) -> None:
        with self._cond:
            self._pending[id(dask_future)] = dask_future

    def ran(self, dask_future: Any, run_id: Any) -> None:
        """Its callback ran (Dask's callback thread)."""
        with self._cond:
            self._pending.pop(id(dask_future), None)
            if dask_future.status == "finished":
                self._finished += run_id.bytes
            self._cond.notify_all()

    def count(self) -> int:
        """How many task runs' Dask futures finished (cheap: asked before each submission)."""
        return len(self._finished) // 16

    @property
    def finished(self) -> list[uuid.UUID]:
        """The ids of task runs whose Dask future finished, in the order they did (read at the flow's end)."""
        with self._cond:
            held = bytes(self._finished)
        return [uuid.UUID(bytes=held[i:i + 16]) for i in range(0, len(held), 16)]

    def settle(self, timeout: float) -> int:
        """Wait until no done future's callback is still to run; how many still were after `timeout` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while (late := sum(1 for f in self._pending.values() if f.done())) and time.monotonic() < deadline:
                self._cond.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            return late


def when_done(future: Any, gate: InFlight, ends: Ends, releaser: Releaser | None,
              metrics: Any) -> Callable[[Any], None]:
    """The one callback (Dask's callback thread) a submitted task's Dask future gets: out of the gate, its run
    id noted in `ends` (the runner waits for Prefect to record the finished ones), released, and its end to
    `metrics` (prefect/metrics.py: trials.json, the pruner)."""
    run_id = future.task_run_id
    hex_id = run_id.hex if hasattr(run_id, "hex") else str(run_id)
    if metrics is not None:
        metrics.submitted(hex_id)
    ends.submitted(future.wrapped_future)

    def done(dask_future: Any) -> None:
        gate.finished()
        if dask_future.status == "finished" and releaser is not None:
            releaser.finished(future)
        if metrics is not None:
            metrics.ended(hex_id, dask_future)
        ends.ran(dask_future, run_id)  # last: once settled, what the callback does is done

    return done


def close(releaser: Releaser | None) -> None:
    """The runner's end: release what is queued, if anything was ever submitted."""
    if releaser is not None:
        releaser.close()


def _is_state(value: Any) -> bool:
    from prefect.client.schemas.objects import State

    return isinstance(value, State)


# Prefect 3.8 resolves a persisted result's absolute local path against its default storage block's base path
# and refuses it, so a released trial handed to a downstream task failed there (seen on 3.8.0); 3.9 reads it back
RELEASE_FROM = "3.9"


def releases(task: Any) -> bool:
    """Whether a task's finished runs can leave Dask: Prefect persists its result, so `.result()` reads it back."""
    return task.persist_result is True and at_least("prefect", RELEASE_FROM)


def mapped_length(parameters: dict[str, Any]) -> int | None:
    """How many tasks Prefect's map will make of `parameters`, where that is known without reading anything:
    the length of a mapped list, range or other sized iterable; None for a generator or a future's value."""
    from prefect.futures import PrefectFuture
    from prefect.utilities.annotations import allow_failure, opaque, quote, unmapped
    from prefect.utilities.collections import isiterable

    for value in parameters.values():
        if isinstance(value, (allow_failure, opaque, quote)):
            value = value.unwrap()
        if isinstance(value, (unmapped, PrefectFuture)):
            continue  # static, or resolved by Prefect's map (to a list or a static value)
        if isiterable(value):
            return len(value) if hasattr(value, "__len__") else None
    return None


def run_released(**kwargs: Any) -> Any:
    """prefect_fast.run_task, returning the final State with a persisted result's record metadata in place of
    the record (the value stays in the results store, not in the worker's memory nor on the wire)."""
    state = prefect_fast.run_task(**kwargs)
    return compact(state)


def compact(state: Any) -> Any:
    """A Completed State whose result was persisted, as the flow needs it: the metadata that finds the value."""
    from prefect.results import ResultRecord

    if _is_state(state) and state.is_completed() and isinstance(state.data, ResultRecord):
        # the same State, its data replaced: State.model_copy resets `timestamp`, and on Prefect 3.9.1 to
        # PydanticUndefined (the field's default factory is not called), which serializes as garbage
        return state.model_copy(update={"data": state.data.metadata, "timestamp": state.timestamp})
    return state
