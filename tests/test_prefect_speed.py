"""HpcTaskRunner's fast path (hpc_garage.prefect.fast) against real Prefect and real Dask: it is engaged,
and Prefect still sees every task, its state and its result; placement, failures and retries as before.
No timings here: bench/ measures speed."""

from __future__ import annotations

import sys
import uuid
from typing import Any

import cloudpickle
import pytest
from distributed import Client, SpecCluster, get_worker
from prefect import flow, task
from prefect.context import FlowRunContext
from prefect_dask import DaskTaskRunner

import hpc_garage
from hpc_garage.cluster.handoff import workers_now
from hpc_garage.prefect import fast as prefect_fast
from hpc_garage.prefect.task_runner import HpcTaskRunner
from tests.conftest import task_runs

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # worker processes cannot import this file

pytestmark = pytest.mark.slow


def stats(cluster: SpecCluster) -> dict[str, dict[str, int]]:
    """prefect_fast's counters in each worker process, by worker name."""
    with Client(cluster.scheduler_address) as client:
        by_address = client.run(prefect_fast.worker_stats)
        names = {a: w["name"] for a, w in workers_now(client).items()}
    return {names[a]: s for a, s in by_address.items()}


def delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], key: str) -> dict[str, int]:
    return {name: after[name][key] - before.get(name, {}).get(key, 0) for name in after}


# ---------------------------------------------------------------------------------------------- tasks


@task
def square(i: int) -> int:
    return i * i


@task(persist_result=True)
def kept(i: int) -> dict[str, int]:
    return {"i": i, "cube": i ** 3}


@task(tags=hpc_garage.resources(gpu=1))
def on_gpu(i: int) -> str:
    return str(get_worker().name)


@task(retries=2)
def always_fails(i: int) -> None:
    raise ValueError(f"no luck {i}")


@task(retries=1)
def fails_once() -> int:
    from prefect.runtime import task_run

    if task_run.run_count < 2:
        raise RuntimeError("first attempt fails")
    return int(task_run.run_count)


@task
def add(x: int, y: int) -> int:
    return x + y


# ------------------------------------------------------------------------------ the fast path is used


def test_set_up_is_done_once_per_worker_not_per_task(runner: HpcTaskRunner, cluster: SpecCluster) -> None:
    before = stats(cluster)

    @flow(task_runner=runner)
    def many() -> list[int]:
        return [f.result() for f in square.map(range(40))]

    assert many() == [i * i for i in range(40)]
    after = stats(cluster)
    ran = delta(before, after, "tasks")
    assert sum(ran.values()) == 40  # every task went through prefect_fast.run_task, none through prefect-dask's
    for name, count in ran.items():
        if count:
            # one client per worker thread (2 here) and one validation of the settings per process, ever,
            # where prefect-dask builds two clients and validates the settings for every task
            assert after[name]["clients_built"] <= 2, (name, after[name])
            assert after[name]["settings_validated"] == 1, (name, after[name])


def test_flow_side_serializes_settings_and_flow_context_once(runner: HpcTaskRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.context import EngineContext, SettingsContext

    calls = {"settings": 0, "flow": 0}
    for kind, cls in (("settings", SettingsContext), ("flow", EngineContext)):
        original = cls.serialize

        def counted(self: Any, *args: Any, _original: Any = original, _kind: str = kind, **kwargs: Any) -> Any:
            calls[_kind] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "serialize", counted)

    @flow(task_runner=runner)
    def many() -> list[int]:
        return [f.result() for f in square.map(range(30))]

    assert many() == [i * i for i in range(30)]
    # once for the payload, once more for the first task's check against Prefect's own serialize_context;
    # prefect-dask serializes both for every one of the 30 tasks
    assert calls == {"settings": 2, "flow": 2}


def test_dask_keys_name_the_task_and_its_run(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def keyed() -> tuple[str, Any]:
        future = square.submit(3)
        future.wait()
        return future.wrapped_future.key, future.task_run_id

    key, run_id = keyed()
    assert key == f"square-{uuid.UUID(str(run_id)).hex}"


# ------------------------------------------------------------------------- what Prefect's API records


def test_every_task_run_its_state_and_result_reach_prefect(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner)
    def sweep() -> tuple[list[Any], list[int]]:
        squares = square.map(range(25))
        sums = [add.submit(a, b) for a, b in zip(squares, squares[1:])]  # futures as arguments
        kept_ = kept.map(range(5))
        return [f.task_run_id for f in [*squares, *sums, *kept_]], [f.result() for f in sums]

    state = sweep(return_state=True)
    ids, sums = state.result()
    assert sums == [a * a + b * b for a, b in zip(range(25), range(1, 25))]
    runs = {r.id: r for r in task_runs(state.state_details.flow_run_id)}  # read at once: the runner waited
    assert set(runs) == set(ids) and len(runs) == 25 + 24 + 5
    assert {r.state.type.value for r in runs.values()} == {"COMPLETED"}
    assert all(r.run_count == 1 for r in runs.values())
    # upstream links survive: each add run has its two square runs as inputs
    adds = [r for r in runs.values() if r.task_key.startswith("add")]
    assert all({i.id for i in r.task_inputs["x"] + r.task_inputs["y"]} <= set(runs) for r in adds)
    assert all(len(r.task_inputs["x"]) == 1 for r in adds)
    # a persisted result is readable from the API's state, as under prefect-dask
    persisted = sorted(r.state.result()["cube"] for r in runs.values() if r.task_key.startswith("kept"))
    assert persisted == [i ** 3 for i in range(5)]


def test_tagged_tasks_still_land_on_the_worker_with_the_resource(runner: HpcTaskRunner, cluster: SpecCluster) -> None:
    before = stats(cluster)

    @flow(task_runner=runner)
    def placed() -> list[str]:
        return on_gpu.map(range(12)).result()

    assert set(placed()) == {"gpu"}
    assert delta(before, stats(cluster), "tasks") == {"gpu": 12, "cpu": 0}  # and through the fast path


# ----------------------------------------------------------------------------- failures and retries


def outcome(task_runner_: Any, settled: int = 0) -> dict[str, Any]:
    @flow(task_runner=task_runner_)
    def retried() -> tuple[str, int]:
        failing = always_fails.submit(7)
        failing.wait()
        try:
            failing.result()
            raised = "nothing"
        except ValueError as exc:
            raised = f"ValueError: {exc}"
        return raised, fails_once.submit().result()

    state = retried(return_state=True)
    raised, count = state.result()
    runs = task_runs(state.state_details.flow_run_id, settled=settled)
    return {"raised": raised, "fails_once returned": count,
            "runs": sorted((r.name.rsplit("-", 1)[0], r.state.type.value, r.state.name, r.run_count) for r in runs)}


def test_failures_and_retries_match_plain_prefect_dask(runner: HpcTaskRunner, cluster: SpecCluster) -> None:
    ours = outcome(runner)
    assert ours == {"raised": "ValueError: no luck 7", "fails_once returned": 2,
                    "runs": [("always_fails", "FAILED", "Failed", 3), ("fails_once", "COMPLETED", "Completed", 2)]}
    assert ours == outcome(DaskTaskRunner(address=cluster.scheduler_address), settled=2)


def test_a_failed_flow_still_raises_the_task_error(runner: HpcTaskRunner) -> None:
    @flow(task_runner=runner, retries=0)
    def doomed() -> None:
        always_fails.with_options(retries=0).submit(1).result()

    with pytest.raises(ValueError, match="no luck 1"):
        doomed()


# ------------------------------------------------------------------------------ the fallback path


def test_switched_off_it_is_plain_prefect_dask(runner: HpcTaskRunner, cluster: SpecCluster,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(prefect_fast.DISABLE_ENV, "0")
    before = stats(cluster)

    @flow(task_runner=runner)
    def plain() -> list[int]:
        return [f.result() for f in square.map(range(6))]

    assert plain() == [i * i for i in range(6)]
    assert sum(delta(before, stats(cluster), "tasks").values()) == 0


def test_an_unknown_prefect_version_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    assert prefect_fast.problem() is None
    monkeypatch.setattr(prefect_fast.prefect, "__version__", "3.99.0")
    assert "outside" in (prefect_fast.problem() or "")


def test_a_context_prefect_composes_differently_falls_back(runner: HpcTaskRunner, cluster: SpecCluster,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    real = prefect_fast.serialize_context
    monkeypatch.setattr(prefect_fast, "serialize_context", lambda **kw: {**real(**kw), "new_part": {}})
    before = stats(cluster)

    @flow(task_runner=runner)
    def drifted() -> tuple[list[int], bool]:
        values = [f.result() for f in square.map(range(4))]
        return values, FlowRunContext.get().task_runner._submitter is False

    values, fell_back = drifted()
    assert values == [0, 1, 4, 9] and fell_back
    assert sum(delta(before, stats(cluster), "tasks").values()) == 0



# ------------------------------------------------------------- what every task carries (prefect/shared.py)


def test_tasks_carry_the_flows_shared_parts_by_reference_fetched_once_per_worker(
        runner: HpcTaskRunner, cluster: SpecCluster) -> None:
    """The flow run context, Prefect's settings and the task travel to the scheduler once, not with each of the
    40 tasks: every worker fetches each at most once, and the runner drops them when the flow ends."""
    from hpc_garage.prefect import shared

    address = cluster.scheduler_address  # the flow pickles what it refers to: an address, not the cluster

    def metadata() -> dict[str, Any]:
        with Client(address) as client:
            return client.get_metadata([shared.ROOT], default={})

    def fetches() -> dict[str, int]:
        with Client(address) as client:
            return client.run(shared.fetched)

    before, during = fetches(), {}

    @flow(task_runner=runner)
    def many() -> list[int]:
        values = [f.result() for f in square.map(range(40))]
        during.update({space: set(blobs) for space, blobs in metadata().items() if blobs})
        return values

    assert many() == [i * i for i in range(40)]
    assert len(during) == 1 and len(next(iter(during.values()))) == 3, during  # settings, flow context, task
    after = fetches()
    assert 0 < sum(after[w] - before.get(w, 0) for w in after) <= 3 * len(after), (before, after)
    assert not any(metadata().values())  # the runner's exit dropped them


def test_a_shared_part_the_scheduler_no_longer_holds_fails_the_task_in_one_line(cluster: SpecCluster) -> None:
    from hpc_garage.prefect import shared

    with Client(cluster.scheduler_address) as client:
        publisher = shared.Publisher(client)
        ref = publisher.share(b"flow context")
        assert client.submit(shared.fetch, ref, pure=False).result() == b"flow context"
        publisher.close()
        gone = shared.Shared(publisher.space, "0" * 32)
        with pytest.raises(RuntimeError, match="no longer holds the flow's shared task data 0000"):
            client.submit(shared.fetch, gone, pure=False).result()


def test_a_task_is_sent_by_reference_from_its_second_submission_and_a_task_per_trial_never() -> None:
    from hpc_garage.prefect import shared

    class Recording:
        def __init__(self) -> None:
            self.set: list[list[str]] = []

        def set_metadata(self, keys: list[str], value: Any) -> None:
            self.set.append(keys)

    client = Recording()
    publisher = shared.Publisher(client)
    assert publisher.task(square) is square  # first sight: inline
    first, second = publisher.task(square), publisher.task(square)
    assert isinstance(first, shared.Shared) and first.digest == second.digest and len(client.set) == 1
    assert cloudpickle.loads(cloudpickle.dumps(first)).digest == first.digest  # the scheduler keeps a reference
    per_trial = [square.with_options(name=f"trial-{i}") for i in range(5)]
    assert all(publisher.task(t) is t for t in per_trial) and len(client.set) == 1
