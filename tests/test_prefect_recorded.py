"""prefect/recorded.py: the flow kept within reach of what Prefect's server has recorded (issue 32). The wait's
arithmetic against a stand-in server (a count, a clock that sleeps advance); then a real flow on a real server
and cluster whose bound is small enough that it waits."""

from __future__ import annotations

import logging
from typing import Any, Callable

import pytest

from hpc_garage.prefect import recorded
from hpc_garage.prefect.recorded import AFTER_ERROR, RECHECK, STALLED, Unrecorded


class Server:
    """A stand-in for Prefect's count of a flow run's ended task runs: `earlier` before the runner's first, then
    what `records(t)` says it has recorded of the runner's by time t; each ask noted."""

    def __init__(self, earlier: int, records: Callable[[float], int]) -> None:
        self.now, self.earlier, self.records, self.asks = 0.0, earlier, records, 0
        self.down = self.started = False

    def count(self) -> int:
        self.asks += 1
        if self.down:
            raise OSError("connection refused")
        return self.earlier + (self.records(self.now) if self.started else 0)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def bound(server: Server, finished: Callable[[], int], limit: int = 100) -> Unrecorded:
    unrecorded = Unrecorded(server.count, finished, limit, clock=lambda: server.now, sleep=server.sleep)
    unrecorded.start()
    server.started = True  # the runner's tasks from here on
    return unrecorded


def test_within_the_bound_nothing_is_asked() -> None:
    server = Server(earlier=500, records=lambda t: 0)  # the flow run's earlier task runs are not the runner's
    unrecorded = bound(server, finished=lambda: 100)
    for _ in range(1000):
        unrecorded.wait()
    assert (server.asks, server.now, unrecorded.waited) == (1, 0.0, 0.0)  # start's ask alone


def test_the_flow_waits_until_the_server_is_back_within_the_bound() -> None:
    server = Server(earlier=7, records=lambda t: int(50 * t))  # the server records 50 a second
    unrecorded = bound(server, finished=lambda: 400)
    unrecorded.wait()
    assert unrecorded.behind() <= 100 and server.now == pytest.approx(6 * RECHECK)  # 300 recorded after 6 s
    assert server.asks == 1 + 7 and unrecorded.waited == pytest.approx(6 * RECHECK)


def test_once_fine_it_is_asked_again_only_after_a_recheck() -> None:
    finished = [150]
    server = Server(earlier=0, records=lambda t: 100)
    unrecorded = bound(server, finished=lambda: finished[0])
    unrecorded.wait()  # 50 behind
    finished[0] = 250
    unrecorded.wait()  # 150 behind by its last count, but asked a moment ago: not asked again yet
    assert (server.asks, server.now) == (2, 0.0)
    server.now += RECHECK
    server.records = lambda t: 200
    unrecorded.wait()
    assert server.asks == 3 and unrecorded.behind() == 50


def test_an_api_that_does_not_answer_is_not_waited_for() -> None:
    server = Server(earlier=0, records=lambda t: 0)
    unrecorded = bound(server, finished=lambda: 1000)
    server.down = True
    unrecorded.wait()
    unrecorded.wait()
    assert (server.asks, server.now) == (2, 0.0)  # one failed ask, then none until AFTER_ERROR
    server.now += AFTER_ERROR
    server.down = False
    server.records = lambda t: 950
    unrecorded.wait()
    assert server.asks == 3 and unrecorded.behind() == 50


def test_without_a_first_count_the_runner_never_waits() -> None:
    server = Server(earlier=0, records=lambda t: 0)
    server.down = True
    unrecorded = bound(server, finished=lambda: 10_000)
    unrecorded.wait()
    assert (server.asks, server.now) == (1, 0.0)


def test_tasks_the_server_never_records_are_waited_for_once() -> None:
    """Events lost with a worker: the server records 700 of 1,000 and no more. The flow waits STALLED s with
    no progress, says so, and then goes on as if they were recorded."""
    finished = [1000]
    server = Server(earlier=0, records=lambda t: 700)
    unrecorded = bound(server, finished=lambda: finished[0])
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(recorded.__name__)  # its own: hpc-garage's logger may not propagate (log.setup)
    logger.addHandler(handler)
    try:
        unrecorded.wait()
    finally:
        logger.removeHandler(handler)
    assert server.now == pytest.approx(STALLED)
    assert [line for line in lines if "recorded none of 300 finished task runs in 60 s" in line], lines
    assert unrecorded.behind() == 0
    finished[0] = 1080  # the next tasks are counted from there: within the bound, nothing waited
    server.now += RECHECK
    unrecorded.wait()
    assert server.now == pytest.approx(STALLED + RECHECK)


def test_count_ended_body_names_the_flow_run_and_the_ended_states() -> None:
    import uuid

    flow_run_id = uuid.uuid4()
    body = recorded._ended(flow_run_id=flow_run_id)["task_runs"]
    assert body["flow_run_id"]["any_"] == [str(flow_run_id)] and body["id"] is None
    assert body["state"]["name"]["any_"] == [recorded.NOT_READY]
    assert set(body["state"]["type"]["any_"]) == {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@pytest.mark.slow
def test_a_flow_whose_server_falls_behind_waits_for_it(api: dict[str, str], cluster: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """300 trials on the real server and cluster with a bound of 10 unrecorded. The server is made to fall behind,
    not hoped to: its SQLite database is write-locked while the first 30 trials run and for 2 s after (its API
    still reads: WAL), so the flow's next submission has 30 finished trials the server has not recorded. The flow
    waits until the server records them, every result is right, and the API holds every trial when it returns."""
    import sqlite3
    import threading

    from prefect import flow, task
    from prefect.context import FlowRunContext

    import hpc_garage
    from hpc_garage.prefect.server import ServerDir

    monkeypatch.setattr(recorded, "MAX_UNRECORDED", 10)
    database = ServerDir.here().home / "prefect.db"
    assert database.is_file(), database
    seen: dict[str, Any] = {}

    @task
    def trial(i: int) -> int:
        return 3 * i

    @flow(task_runner=hpc_garage.task_runner(address=cluster.scheduler_address))
    def sweep(n: int) -> list[int]:
        lock = sqlite3.connect(database, timeout=30, check_same_thread=False, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")  # the server's writes wait; its reads go on
        first = [f.result() for f in trial.map(range(30))]
        seen.update(ended=recorded.count_ended(FlowRunContext.get().flow_run.id))
        threading.Timer(2.0, lambda: (lock.execute("ROLLBACK"), lock.close())).start()
        values = first + [f.result() for f in trial.map(range(30, n))]
        unrecorded = FlowRunContext.get().task_runner._in_flight.unrecorded
        seen.update(limit=unrecorded.limit, waited=unrecorded.waited, flow_run_id=FlowRunContext.get().flow_run.id)
        return values

    assert sweep(300) == [3 * i for i in range(300)]
    assert seen["ended"] == 0, seen  # the server had recorded none of the first 30
    assert seen["limit"] == 10 and seen["waited"] >= 1.0, seen  # so the flow waited until it had
    assert recorded.count_ended(seen["flow_run_id"]) == 300


def test_the_docs_say_the_bound_the_runner_keeps() -> None:
    """docs/how-to/large-jobs.md's promise, literally: the figures it names are the ones the runner uses."""
    from pathlib import Path

    text = " ".join((Path(__file__).parents[1] / "docs" / "how-to" / "large-jobs.md").read_text().split())
    assert f"more than {recorded.MAX_UNRECORDED:,} of its finished trials are not yet recorded" in text
    assert RECHECK == 1.0 and "asked at most once a second" in text
    assert STALLED == 60.0 and "records none of them for a minute" in text
