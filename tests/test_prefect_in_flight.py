"""prefect/in_flight.py: the back-pressure on a flow's submissions and the release of finished persisted tasks
(issue 32). No cluster, no server: the gate's arithmetic, the releaser against a stand-in client, the worker's
compact state and the read back from the results store."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import pickle
import uuid
from typing import Any

import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.prefect import in_flight
from hpc_garage.prefect.in_flight import (MINIMUM, PER_THREAD, RELEASE_FROM, Ends, InFlight, Releaser,
                                          ReleasingFuture, check_limit, compact, default_limit, read_back, releases,
                                          when_done)
from hpc_garage.compat import at_least


def test_limit_given_is_checked_in_one_line() -> None:
    assert check_limit(None) is None
    assert check_limit(5) == 5
    for bad in (0, -3, 2.5, "100", True):
        with pytest.raises(UserError, match=r"task_runner\(max_in_flight=.*at least 1"):
            check_limit(bad)


def test_runner_refuses_a_bad_limit_at_construction() -> None:
    from hpc_garage.prefect.task_runner import HpcTaskRunner

    with pytest.raises(UserError, match="max_in_flight=0"):
        HpcTaskRunner(address="tcp://127.0.0.1:1", max_in_flight=0)
    runner = HpcTaskRunner(address="tcp://127.0.0.1:1", max_in_flight=7)
    assert runner.duplicate().max_in_flight == 7  # Prefect enters a duplicate per flow run


def test_default_limit_is_sized_to_the_workers() -> None:
    assert default_limit(0) == MINIMUM
    assert default_limit(2) == MINIMUM
    assert default_limit(1024) == PER_THREAD * 1024


def test_admit_waits_at_the_limit_until_a_task_finishes() -> None:
    gate = InFlight(3, threads=lambda: 0)
    for _ in range(3):
        gate.admit()
    assert gate.count == 3
    admitted = threading.Event()
    waiter = threading.Thread(target=lambda: (gate.admit(), admitted.set()))
    waiter.start()
    assert not admitted.wait(0.3), "a fourth task was admitted past the limit of 3"
    gate.finished()
    assert admitted.wait(5), "a finished task did not let the next one in"
    waiter.join()
    assert (gate.count, gate.peak) == (3, 3)
    gate.cancel()  # a submission that raised gives its place back
    assert gate.count == 2


def test_bound_holds_with_many_submitters_and_finishers() -> None:
    """Submissions (one thread, as Prefect's map) against completions (another, as Dask's callback thread): the
    count never passes the limit and ends at zero."""
    gate, n = InFlight(5, threads=lambda: 0), 2000
    done: list[int] = []
    pending: list[int] = []
    lock = threading.Lock()

    def finisher() -> None:
        while len(done) < n:
            with lock:
                item = pending.pop(0) if pending else None
            if item is None:
                time.sleep(0)
                continue
            done.append(item)
            gate.finished()

    thread = threading.Thread(target=finisher)
    thread.start()
    for i in range(n):
        gate.admit()
        assert gate.count <= 5
        with lock:
            pending.append(i)
    thread.join(30)
    assert (len(done), gate.count, gate.peak) == (n, 0, 5)


def test_default_limit_is_asked_again_as_workers_join() -> None:
    now, threads = [0.0], [1]
    gate = InFlight(None, threads=lambda: threads[0], clock=lambda: now[0])
    assert gate.limit() == MINIMUM
    threads[0] = 1000
    assert gate.limit() == MINIMUM  # not asked again within RECHECK
    now[0] += in_flight.RECHECK
    assert gate.limit() == PER_THREAD * 1000

    def failing() -> int:
        raise OSError("scheduler busy")

    gate = InFlight(None, threads=failing)
    assert gate.limit() == MINIMUM  # a scheduler that does not answer: the minimum, not a crash


class FakeDaskFuture:
    def __init__(self, value: Any, status: str = "finished") -> None:
        self.value, self.status = value, status


class FakeClient:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, 0

    def gather(self, futures: list[FakeDaskFuture], errors: str = "raise") -> list[Any]:
        self.calls += 1
        if self.fail:
            raise OSError("worker lost")
        return [f.value for f in futures]


def completed(value: Any, tmp_path: Any) -> tuple[Any, Any]:
    """A Completed state as Prefect's engine returns it with a persisted result, and its compact form."""
    from prefect.filesystems import LocalFileSystem
    from prefect.results import ResultStore
    from prefect.states import Completed

    store = ResultStore(result_storage=LocalFileSystem(basepath=str(tmp_path)))
    record = store.create_result_record(value, key=uuid.uuid4().hex)
    store.persist_result_record(record)
    full = Completed(data=record)
    return full, compact(full)


@pytest.mark.skipif(not at_least("prefect", RELEASE_FROM), reason="Prefect < 3.9 reads no record metadata back")
def test_worker_sends_the_record_metadata_not_the_value(tmp_path: Any) -> None:
    from prefect.results import ResultRecordMetadata
    from prefect.states import Completed, Failed

    full, small = completed(list(range(1000)), tmp_path)
    assert isinstance(small.data, ResultRecordMetadata)
    assert small.type == full.type and small.id == full.id and small.timestamp == full.timestamp
    assert read_back(small) == list(range(1000))
    assert small.result() == list(range(1000))  # Prefect's own path reads the same
    failed = Failed(message="boom")
    assert compact(failed) is failed
    plain = Completed(data=3)  # not a persisted record: as it is
    assert compact(plain) is plain and read_back(plain) is in_flight.NOTHING


def test_read_back_falls_back_to_prefect_when_the_file_is_gone(tmp_path: Any) -> None:
    _, small = completed(5, tmp_path)
    from pathlib import Path

    Path(small.data.storage_key).unlink()
    assert read_back(small) is in_flight.NOTHING


def test_releaser_drops_the_dask_future_and_result_reads_the_store(tmp_path: Any) -> None:
    from hpc_garage.compat import dask_futures

    _, small = completed({"loss": 0.5}, tmp_path)
    client = FakeClient()
    releaser = Releaser(lambda: client)
    future = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=FakeDaskFuture(small))
    assert not future.released
    assert dask_futures(None, {"x": future})["x"] is future.wrapped_future  # still in Dask: its Dask future
    releaser.finished(future)
    releaser.close()
    assert future.released and releaser.released == 1 and client.calls == 1
    assert future.result() == {"loss": 0.5}
    future.wait()  # no Dask future to wait on: returns
    assert future.state.is_completed()
    assert dask_futures(None, {"x": [future]})["x"][0] == future.state  # downstream: the State, Prefect resolves it


def test_a_released_future_keeps_its_state_small_and_gives_back_the_same_state(tmp_path: Any) -> None:
    """A flow holds every future its user keeps (a `.map` of 300,000): a released one's State costs ~0.3 KB
    (the packed State and its place), not the ~5 KB of its objects, and reads back equal."""
    import gc
    import tracemalloc

    from hpc_garage.compat import release_future

    _, small = completed({"loss": 0.5}, tmp_path)
    future = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=FakeDaskFuture(small))
    release_future(future, small)
    again = future.state
    assert again == small and again.id == small.id and again.timestamp == small.timestamp
    assert again.data == small.data and again.state_details == small.state_details
    assert future.result() == {"loss": 0.5} and future.released
    elsewhere = subprocess.run([sys.executable, "-c", "import pickle, sys; f = pickle.load(sys.stdin.buffer); "
                                "print(f.state.id, f.result())"], input=pickle.dumps(future), capture_output=True)
    assert elsewhere.stdout.decode().split() == [str(small.id), "{'loss':", "0.5}"], elsewhere.stderr.decode()[-800:]
    wire = [pickle.dumps(completed(i, tmp_path)[1]) for i in range(500)]  # as the workers send them
    held = [ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=None) for _ in wire]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for f, sent in zip(held, wire):
            release_future(f, pickle.loads(sent))
        gc.collect()
        per_future = (tracemalloc.get_traced_memory()[0] - before) / len(held)
    finally:
        tracemalloc.stop()
    assert per_future < 400, f"{per_future:.0f} bytes held per released future's State"


def test_releaser_keeps_futures_it_cannot_gather(tmp_path: Any) -> None:
    _, small = completed(1, tmp_path)
    releaser = Releaser(lambda: FakeClient(fail=True))
    future = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=FakeDaskFuture(small))
    releaser.finished(future)
    releaser.close()
    assert not future.released and releaser.released == 0


def test_releaser_gathers_in_batches(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(in_flight, "BATCH", 10)
    _, small = completed(1, tmp_path)
    client = FakeClient()
    releaser = Releaser(lambda: client)
    futures = [ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=FakeDaskFuture(small)) for _ in range(35)]
    with releaser._cond:  # all queued before the thread runs: 4 gathers, not 35
        for f in futures:
            releaser._queue.append(f)
    releaser.finished(ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=FakeDaskFuture(small)))
    releaser.close()
    assert releaser.released == 36 and client.calls == 4


def test_when_done_counts_out_notes_and_releases(tmp_path: Any) -> None:
    _, small = completed(1, tmp_path)
    gate, ends, queued = InFlight(2, threads=lambda: 0), Ends(), []
    gate.admit()
    gate.admit()

    class Queue:
        def finished(self, future: Any) -> None:
            queued.append(future)

    ok = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=FakeDaskFuture(small))
    when_done(ok, gate, ends, Queue(), None)(ok.wrapped_future)  # type: ignore[arg-type]
    lost = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=FakeDaskFuture(None, status="error"))
    when_done(lost, gate, ends, Queue(), None)(lost.wrapped_future)  # type: ignore[arg-type]
    assert gate.count == 0 and ends.finished == [ok.task_run_id] and queued == [ok]
    assert ends.settle(0) == 0  # both callbacks ran: nothing is pending


_released = threading.Event()  # a module's: tasks of an in-process cluster are still pickled


def _held() -> bool:
    return _released.wait(30)


def _same(x: int) -> int:
    return x


def test_the_runners_end_waits_for_dasks_callbacks_of_its_done_tasks() -> None:
    """Dask runs done-callbacks on one thread of its own, after the result is there: a flow can hold every
    result while its tasks' callbacks still wait (CI: 14 of 200 task runs never reached Prefect's API, the
    runner had not waited for them). `Ends.settle` waits for those of done futures, and only those."""
    from distributed import Client, LocalCluster

    _released.clear()
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        gate, ends = InFlight(None, threads=lambda: 2), Ends()
        blocker = client.submit(_same, -1, pure=False)
        blocker.add_done_callback(lambda _: _released.wait(30))  # holds Dask's one callback thread
        blocker.result()
        futures = []
        for i in range(20):
            gate.admit()
            future = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=client.submit(_same, i, pure=False))
            future.wrapped_future.add_done_callback(when_done(future, gate, ends, None, None))
            futures.append(future)
        gate.admit()
        unfinished = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=client.submit(_held, pure=False))
        unfinished.wrapped_future.add_done_callback(when_done(unfinished, gate, ends, None, None))
        assert [f.wrapped_future.result() for f in futures] == list(range(20))
        assert ends.finished == [] and gate.count == 21  # every result is here, no callback has run
        assert ends.settle(0.2) == 20  # bounded: it says how many were still to run
        threading.Timer(0.5, _released.set).start()
        assert ends.settle(30) == 0
        assert set(ends.finished) >= {f.task_run_id for f in futures}  # the unfinished one may have ended too


@pytest.mark.slow
def test_a_flow_behind_slow_done_callbacks_ends_with_every_task_counted(cluster: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's done-callback runs on Dask's one callback thread, as the runner's own do: behind slow ones the
    flow holds every result long before the runner's callbacks ran. The runner's end waits for them, so every
    finished task is counted (and waited for at Prefect's API) when the flow returns."""
    from prefect import flow, task

    import hpc_garage
    from hpc_garage.prefect.task_runner import HpcTaskRunner

    counted: list[int] = []
    original = HpcTaskRunner.__exit__

    def exit_and_count(self: HpcTaskRunner, *exc: Any) -> None:
        original(self, *exc)
        counted.append(len(self._ends.finished))

    monkeypatch.setattr(HpcTaskRunner, "__exit__", exit_and_count)  # the flow's process only

    @task
    def trial(i: int) -> int:
        return i

    def slow(_: Any) -> None:
        time.sleep(0.1)

    @flow(task_runner=hpc_garage.task_runner(address=cluster.scheduler_address))
    def sweep(n: int) -> list[int]:
        futures = trial.map(range(n))
        for future in futures:
            future.add_done_callback(slow)  # 3 s of callbacks in all, queued behind one another
        return [f.result() for f in futures]

    assert sweep(30) == list(range(30))
    assert counted == [30]  # without the wait: those whose callback had run by the flow's end


def test_a_pickled_ends_starts_empty() -> None:
    import pickle

    ends = Ends()
    ends.finished.append(uuid.uuid4())
    assert pickle.loads(pickle.dumps(ends)).finished == []  # the runner travels with its flow


def test_only_persisted_tasks_are_released(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect import task

    from hpc_garage.compat import versions

    monkeypatch.setattr(versions, "version", lambda package: "3.9.1")  # where released results are read back

    @task
    def trial(i: int) -> int:
        return i

    assert not releases(trial)
    assert releases(trial.with_options(persist_result=True))
    assert not releases(trial.with_options(persist_result=False))


def test_on_prefect_before_3_9_nothing_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefect 3.8 cannot read a released trial's result back from its record metadata: nothing leaves Dask."""
    from prefect import task

    from hpc_garage.compat import versions

    trial = task(lambda: 1, persist_result=True)
    monkeypatch.setattr(versions, "version", lambda package: "3.8.0")
    assert not releases(trial)
    monkeypatch.setattr(versions, "version", lambda package: "3.9.1")
    assert releases(trial)


@pytest.mark.slow
def test_a_sweep_stays_within_its_bound_and_every_trial_is_a_task_run(
        api: dict[str, str], cluster: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 trials written as a user writes them (`.map`, then `.result()` each) under a sweep's results store,
    with max_in_flight=20: the scheduler never holds more than 20 unfinished, finished ones leave it (their
    results read back from the store), every result is right and every trial is one Prefect task run."""
    from distributed import Client
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    import hpc_garage
    from hpc_garage.cluster.handoff import ANNOUNCED
    from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV

    monkeypatch.setenv(SWEEP_ENV, "in-flight-test@1")  # as `hpc-garage run` exports them
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path))
    n, limit = 2000, 20
    seen = {"unfinished": 0, "held": 0, "announced": 0}
    stop = threading.Event()

    def sample() -> None:
        with Client(cluster.scheduler_address) as client:
            before = sum(client.get_metadata(list(ANNOUNCED), default={}).values())  # other tests' runners
            while not stop.is_set():
                told = sum(client.get_metadata(list(ANNOUNCED), default={}).values()) - before
                seen["announced"] = max(seen["announced"], told)
                unfinished, held = client.run_on_scheduler(lambda dask_scheduler: (
                    sum(ts.state not in ("memory", "released", "forgotten", "erred")
                        for ts in dask_scheduler.tasks.values()), len(dask_scheduler.tasks)))
                seen["unfinished"], seen["held"] = max(seen["unfinished"], unfinished), max(seen["held"], held)
                time.sleep(0.05)

    @task
    def trial(i: int) -> int:
        return 2 * i

    @flow(task_runner=hpc_garage.task_runner(address=cluster.scheduler_address, max_in_flight=limit))
    def sweep(n: int) -> tuple[list[int], str, int, int]:
        futures = trial.map(range(n))
        values = [f.result() for f in futures]
        context = FlowRunContext.get()
        runner = context.task_runner
        released = sum(f.released for f in futures)
        return values, str(context.flow_run.id), runner._in_flight.peak, released

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        values, flow_run_id, peak, released = sweep(n)
    finally:
        stop.set()
        sampler.join(10)
    assert values == [2 * i for i in range(n)]
    assert peak == limit and seen["unfinished"] <= limit, seen
    assert seen["announced"] == n, seen  # the scheduler heard the map's length: `status` counts the held-back rest
    assert released >= n - in_flight.BATCH  # finished trials left Dask (the last batch may still be on its way)
    assert seen["held"] <= limit + in_flight.BATCH < n, seen  # not every trial at once: what was in flight
    # Prefect's server writes task runs from their events, in its own time: under load it may still be some
    # hundreds behind when the flow returns. Every one arrives, and no more than one per trial.
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
    deadline, count = time.monotonic() + 180, -1
    with get_client(sync_client=True) as client:
        while count < n and time.monotonic() < deadline:
            time.sleep(0 if count < 0 else 1)
            count = client.request("POST", "/task_runs/count", json=body).json()
    assert count == n


def test_result_and_callbacks_of_a_future_released_while_it_is_read(tmp_path: Any) -> None:
    """The releaser may drop the Dask future at any moment: a reader that took it still gets the value."""
    from hpc_garage.compat import release_future

    _, small = completed(9, tmp_path)

    class Dropping(FakeDaskFuture):
        def __init__(self, value: Any, owner: list[Any]) -> None:
            super().__init__(value)
            self.owner = owner

        def result(self, timeout: float | None = None) -> Any:
            release_future(self.owner[0], self.value)  # released between the reader's two looks
            return self.value

        def add_done_callback(self, fn: Any) -> None:
            fn(self)

    owner: list[Any] = []
    future = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=Dropping(small, owner))
    owner.append(future)
    assert future.result() == 9 and future.released
    called: list[Any] = []
    future.add_done_callback(called.append)
    assert called == [future]
    failed = ReleasingFuture(task_run_id=uuid.uuid4(), wrapped_future=FakeDaskFuture(None))
    from prefect.states import Failed

    release_future(failed, Failed(message="boom"))
    with pytest.raises(Exception, match="boom"):
        failed.result()
    assert failed.result(raise_on_failure=False) is not None


def test_mapped_length_is_known_only_without_reading_anything() -> None:
    from prefect.futures import PrefectFuture
    from prefect.utilities.annotations import allow_failure, quote, unmapped

    from hpc_garage.prefect.in_flight import mapped_length

    class Future(PrefectFuture):  # a future's value: Prefect's map resolves it, its length is not known here
        def __init__(self) -> None:
            pass

        wait = result = add_done_callback = None  # type: ignore[assignment]

    assert mapped_length({"i": range(100_000), "lr": unmapped([1, 2])}) == 100_000
    assert mapped_length({"x": quote([1, 2, 3])}) == 3 and mapped_length({"x": allow_failure([1])}) == 1
    assert mapped_length({"data": Future(), "i": [4, 5]}) == 2
    assert mapped_length({"i": (i for i in range(3))}) is None  # a generator: not read here
    assert mapped_length({"data": Future()}) is None and mapped_length({"s": "abc", "n": 3}) is None
