"""What Prefect's server has recorded of a runner's finished tasks: the flow keeps within reach of it (issue 32).

Why. Prefect 3 records a task run from the events its worker sends; its server persists them a little later.
Workers on several nodes finish short trials faster than one server records them: a 2-node job on this 2-core
host (lab-cpu, 2 workers of 4 threads a node) finished 10,000 trivial trials in 100 s and its server needed about
two minutes more. Meanwhile the events wait in the server's memory, its API answers slowly, and trials that ask
it something (each worker's tag-limit question, once a minute) stall: the last 1,000 trials took 31 s where each
1,000 before took 3.5. So:
- `Unrecorded`: before each submission the flow's thread waits while more than `limit` of the runner's finished
  tasks are not yet recorded (MAX_UNRECORDED, a few tens of seconds of a server's work): the sweep goes at the
  pace its server records it, and the server's backlog is bounded. Asked only when the runner's count could be
  over, at most every RECHECK s; an API that does not answer is not waited for (prefect/outage.py's concern),
  nor one that records none of them for STALLED s (events lost with a worker), with a warning.
- `await_recorded`: at the flow's end, until the API holds every finished task (when the flow returns, the UI and
  the API show each one, as plain prefect-dask's slowness gave for free).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable

__all__ = ["MAX_UNRECORDED", "NOT_READY", "Unrecorded", "await_recorded", "count_ended", "for_flow_run"]

MAX_UNRECORDED = 2000  # finished tasks the server may have yet to record: ~20-30 s of a busy SQLite server's work
RECHECK = 1.0  # s between two asks while the flow waits
AFTER_ERROR = 30.0  # s before asking again an API that did not answer
STALLED = 60.0  # s the server may record none of the runner's tasks before the flow stops waiting for them
NOT_READY = "NotReady"  # the Pending state Prefect's engine leaves a task in when an upstream did not complete

logger = logging.getLogger(__name__)


def _ended(task_run_ids: list[uuid.UUID] | None = None, flow_run_id: uuid.UUID | None = None) -> dict[str, Any]:
    """`/task_runs/count`'s body: these task runs (or the flow run's) in a state their engine ended them in.
    A task whose upstream failed ends NotReady, a Pending state that is its last: it counts as ended."""
    from prefect.client.schemas.filters import (Operator, TaskRunFilter, TaskRunFilterFlowRunId, TaskRunFilterId,
                                                TaskRunFilterState, TaskRunFilterStateName, TaskRunFilterStateType)
    from prefect.client.schemas.objects import StateType

    state = TaskRunFilterState(
        operator=Operator.or_,
        type=TaskRunFilterStateType(any_=[StateType.COMPLETED, StateType.FAILED, StateType.CRASHED,
                                          StateType.CANCELLED]),
        name=TaskRunFilterStateName(any_=[NOT_READY]))
    found = TaskRunFilter(id=TaskRunFilterId(any_=task_run_ids) if task_run_ids is not None else None,
                          flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]) if flow_run_id else None, state=state)
    return {"task_runs": found.model_dump(mode="json")}


def _count(client: Any, body: dict[str, Any]) -> int:
    response = client.request("POST", "/task_runs/count", json=body)
    response.raise_for_status()
    return int(response.json())


def count_ended(flow_run_id: uuid.UUID) -> int:
    """How many of the flow run's task runs Prefect's API holds in an ended state."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return _count(client, _ended(flow_run_id=flow_run_id))


class Unrecorded:
    """How many of a runner's finished tasks the server has yet to record, and the wait that bounds it."""

    def __init__(self, count: Callable[[], int], finished: Callable[[], int], limit: int = MAX_UNRECORDED,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self._count, self._finished, self.limit = count, finished, limit  # the flow run's ended; the runner's
        self._clock, self._sleep = clock, sleep
        self._base: int | None = None  # the flow run's ended task runs before the runner's first task
        self._recorded = 0  # the runner's finished tasks the server held, as last asked
        self._next_ask = 0.0
        self.waited = 0.0  # s the flow waited for the server (the bench)

    def start(self) -> None:
        """The flow run's ended task runs now, before the runner's first task; an API that does not answer:
        the runner never waits for it."""
        try:
            self._base = self._count()
        except Exception as exc:  # noqa: BLE001 - the flow's own work matters more than this bound
            logger.debug("task runs ended so far unknown (%s): not waiting for the server to record", exc)

    def behind(self) -> int:
        return self._finished() - self._recorded

    def wait(self) -> None:
        """Wait (the flow's thread) while the server has more than `limit` of the runner's finished tasks to record."""
        if self._base is None or self.behind() <= self.limit:
            return  # the submission's hot path: nothing asked, nothing timed
        began = stalled = self._clock()
        while self.behind() > self.limit and self._clock() >= self._next_ask:
            before = self._recorded
            try:
                self._recorded = self._count() - self._base
            except Exception as exc:  # noqa: BLE001 - a down API is outage.py's concern; asked again later
                logger.debug("task runs recorded unknown (%s)", exc)
                self._next_ask = self._clock() + AFTER_ERROR
                break
            now = self._clock()
            self._next_ask = now + RECHECK
            if self.behind() <= self.limit:
                break
            if self._recorded > before:
                stalled = now
            elif now - stalled >= STALLED:  # not catching up on these: counted as recorded, not waited for again
                logger.warning("Prefect's server recorded none of %d finished task runs in %.0f s; the flow goes on "
                               "without waiting for them (they appear as the server catches up)", self.behind(),
                               STALLED)
                self._base -= self.behind()
                self._recorded = self._finished()
                break
            self._sleep(RECHECK)
        self.waited += self._clock() - began


def for_flow_run(finished: Callable[[], int]) -> Unrecorded | None:
    """The bound for a runner whose finished tasks `finished` counts, in the current flow run; None outside one."""
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return None
    flow_run_id = context.flow_run.id
    unrecorded = Unrecorded(lambda: count_ended(flow_run_id), finished, MAX_UNRECORDED)
    unrecorded.start()
    return unrecorded


def await_recorded(task_run_ids: list[uuid.UUID], timeout: float) -> int:
    """Wait until Prefect's API holds each of these task runs in the state its engine ended it in; return
    how many it lacks. The server is asked for counts only, 1,000 ids at a time, with backoff: it is busy
    catching up (here 2-6 s behind 300 tasks at ~60 tasks/s)."""
    from prefect.client.orchestration import get_client

    ids = list(dict.fromkeys(task_run_ids))
    chunks = [ids[i:i + 1000] for i in range(0, len(ids), 1000)]
    deadline, pause, missing = time.monotonic() + timeout, 0.1, len(ids)
    with get_client(sync_client=True) as client:
        while chunks:
            counts = [(c, max(0, len(c) - _count(client, _ended(task_run_ids=c)))) for c in chunks]
            chunks, missing = [c for c, n in counts if n], sum(n for _, n in counts)
            if not chunks or time.monotonic() > deadline:
                break
            time.sleep(pause)
            pause = min(pause * 1.5, 2.0)
    return missing
