"""The jobqueue launcher's scaling policy, with plain numbers for time: when a job expires, is gone, has
finished retiring or failed, when a pool gives up, which states count as live; and that the policy stays pure."""

from __future__ import annotations

import ast
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from hpc_garage.core.pools import JobShape, job_shapes, lifetime
from hpc_garage.core.site import parse_site_dict
from hpc_garage.launchers.jobqueue import scaling
from hpc_garage.launchers.jobqueue.scaling import (
    FAILURES_BEFORE_GIVING_UP,
    FINISHED,
    GONE_AFTER,
    LEAVING,
    LIVE,
    REPLACE_AHEAD,
    RETIRE_GRACE,
    UNFINISHED,
    JobRecord,
    JobState,
    DRAIN_SETTLE,
    ahead,
    change,
    drain_window,
    drained,
    drains,
    expiring,
    gives_up,
    left_queue,
    live_jobs,
    pool_state,
    retire_done,
    retires_at,
    stopped_as,
    to_let_go,
    workers_gone,
)


def shape(walltime: str = "02:00:00", **jobqueue: object) -> JobShape:
    site = parse_site_dict({"name": "t", "scheduler": "slurm", "launcher": "jobqueue", "walltime": walltime,
                            "node": {"cores": 8, "memory": "16GiB", "gpus": 0}, "workers": {"per": "node"},
                            "jobqueue": {"jobs": 1, "gpus_per_job": 0, **jobqueue}})
    return next(iter(job_shapes(site).values()))


def running(started_at: float = 100.0, **fields: object) -> JobRecord:
    """A started job (a worker registered at `started_at`), with `fields` changed."""
    given: dict[str, object] = {"pool": "p", "name": "p-0", "job_id": "1", "state": JobState.RUNNING,
                                "started": 1e9, "started_at": started_at, "last_seen": started_at}
    return JobRecord(**(given | fields))  # type: ignore[arg-type]


def test_a_running_job_turns_expiring_ahead_of_its_lifetime_not_before() -> None:
    s = shape()
    life, stagger = lifetime(s.site)
    assert life / 2 > REPLACE_AHEAD  # so REPLACE_AHEAD, not half the lifetime, is what applies here
    rec = running(started_at=100.0)
    end = retires_at(rec, s, now=0.0)
    assert end == 100.0 + life - stagger
    assert not expiring(rec, s, end - REPLACE_AHEAD - 1, queue_wait=0.0)
    assert expiring(rec, s, end - REPLACE_AHEAD, queue_wait=0.0)  # a minute ahead: still before the lifetime ends
    # a pool whose jobs waited long in the queue replaces them earlier, twice that wait ahead
    assert ahead(s, queue_wait=100.0) == 200.0
    assert expiring(rec, s, end - 200.0, queue_wait=100.0) and not expiring(rec, s, end - 201.0, queue_wait=100.0)
    # never more than half the lifetime ahead, whatever the queue wait
    assert ahead(s, queue_wait=1e6) == life / 2
    # only a running job expires (an expiring one already has its replacement; a retiring one is idle)
    for state in (JobState.PENDING, JobState.EXPIRING, JobState.RETIRING):
        rec.state = state
        assert not expiring(rec, s, end, queue_wait=0.0)


def test_a_job_stops_taking_tasks_a_drain_window_before_it_retires_and_is_replaced_before_that() -> None:
    s = shape()
    rec = running(started_at=100.0)
    end = retires_at(rec, s, now=0.0)
    window = drain_window(longest_task=20.0)
    assert window == 1.5 * 20.0 + 5.0  # the longest task seen, with room to run long, plus a step's slack
    assert not drains(rec, s, end - window - 1, window) and drains(rec, s, end - window, window)
    rec.state = JobState.EXPIRING  # its replacement is there: it drains all the same
    assert drains(rec, s, end - window, window)
    # a short lifetime, whose half (`ahead`'s cap) is less than the drain window: the job is replaced when it
    # drains, in the same step, not after (proof 14 saw one drain with no replacement submitted ahead)
    short = shape("00:01:30", lifetime_margin="78s", lifetime_stagger=0)  # 12-s lives: `ahead` is at most 6 s
    late, window = running(started_at=100.0), drain_window(longest_task=1.0)  # 6.5 s
    end = retires_at(late, short, now=0.0)
    assert ahead(short, 0.0, window) == 6.0 and drains(late, short, end - window, window)
    assert expiring(late, short, end - window, 0.0, window)
    for state in (JobState.DRAINING, JobState.RETIRING, JobState.PENDING):
        rec.state = state
        assert not drains(rec, s, end, window)
    # the replacement is asked for ahead of the drain, by at least the pool's queue wait
    assert ahead(s, queue_wait=30.0, window=200.0) == 230.0
    # the run's end comes first: the job's own (shorter) life counts
    rec.state = JobState.RUNNING
    assert retires_at(rec, s, 0.0, life=300) == 100.0 + 300 - lifetime(s.site)[1]
    assert drains(rec, s, 100.0 + 300 - lifetime(s.site)[1] - window, window, life=300)


def test_a_draining_job_retires_once_its_heartbeats_say_none_of_its_tasks_executes() -> None:
    rec = running(state=JobState.DRAINING, draining=50.0)
    assert not drained(rec, 50.0 + DRAIN_SETTLE - 0.1, processing=[], executing=[])  # heartbeats not in yet
    assert drained(rec, 50.0 + DRAIN_SETTLE, processing=[], executing=[])
    assert not drained(rec, 60.0, processing=["trial-1"], executing=["trial-1"])  # still running: wait
    assert drained(rec, 60.0, processing=["trial-2"], executing=["trial-1"])  # queued there, never started
    assert not drained(running(), 60.0, processing=[], executing=[])  # not draining


def test_a_started_job_whose_workers_are_gone_longer_than_gone_after_has_ended() -> None:
    rec = running(started_at=10.0)
    assert not workers_gone(rec, 10.0 + GONE_AFTER)  # a worker restarting, or a moment between two steps
    assert workers_gone(rec, 10.0 + GONE_AFTER + 0.1)
    queued = JobRecord(pool="p", name="p-1", job_id="2", state=JobState.PENDING)
    assert not workers_gone(queued, 1e9)  # never started: the batch system says whether it left (left_queue)


def test_a_job_that_leaves_the_queue_failed_without_workers_and_ended_with_them_gone() -> None:
    assert left_queue(JobRecord(pool="p", name="p-0", job_id="1", state=JobState.PENDING)) == JobState.FAILED
    assert left_queue(running(workers=0)) == JobState.ENDED
    assert left_queue(running(workers=2)) is None  # its workers still report: they end it when they go
    assert left_queue(running(workers=0, state=JobState.EXPIRING)) == JobState.ENDED


def test_a_retired_job_is_finished_once_its_workers_left_and_the_grace_passed() -> None:
    rec = running(state=JobState.RETIRING, retiring=50.0, workers=0)
    assert not retire_done(rec, 50.0 + RETIRE_GRACE - 0.1)
    assert retire_done(rec, 50.0 + RETIRE_GRACE)
    rec.workers = 1
    assert not retire_done(rec, 1e9)  # a worker still holds data no other worker could take
    assert not retire_done(running(workers=0), 1e9)  # not retiring


def test_a_pool_stops_after_three_failures_in_a_row() -> None:
    assert FAILURES_BEFORE_GIVING_UP == 3
    assert [gives_up(n) for n in range(5)] == [False, False, False, True, True]


def test_live_states_are_the_jobs_a_pool_counts_and_every_state_is_finished_or_not() -> None:
    assert LIVE == {JobState.SUBMITTING, JobState.PENDING, JobState.RUNNING}
    assert LEAVING == {JobState.EXPIRING, JobState.DRAINING, JobState.RETIRING} and not LIVE & LEAVING
    assert FINISHED | UNFINISHED == set(JobState) and not FINISHED & UNFINISHED
    assert UNFINISHED == LIVE | LEAVING
    records = [JobRecord(pool="a", name=f"a-{i}", state=state) for i, state in enumerate(JobState)]
    records.append(JobRecord(pool="b", name="b-0", state=JobState.RUNNING))
    assert [r.name for r in live_jobs(records, "a")] == ["a-0", "a-1", "a-2"]
    state = pool_state(records, "a", load=2.5)
    assert (state.jobs, state.leaving, state.load) == (3, 3, 2.5)


def test_at_the_end_of_the_run_a_job_is_retired_cancelled_or_left_as_it_was() -> None:
    assert stopped_as(running(state=JobState.RETIRING, workers=0)) == JobState.RETIRED
    assert stopped_as(running(state=JobState.RETIRING, workers=1)) == JobState.CANCELLED
    assert stopped_as(JobRecord(pool="p", name="p-0")) == JobState.CANCELLED  # sbatch may still answer
    for state in FINISHED:
        assert stopped_as(running(state=state)) is None


def test_only_an_adaptive_pool_lets_jobs_go_never_started_first() -> None:
    assert change(3, 1, adaptive=False) == 2 and change(1, 3, adaptive=False) == 0
    assert change(1, 3, adaptive=True) == -2 and change(2, 2, adaptive=True) == 0
    queued = JobRecord(pool="p", name="p-9", state=JobState.PENDING)
    idle, busy = running(busy=10.0), running(busy=95.0)
    idle.name, busy.name = "p-1", "p-2"
    assert to_let_go([busy, idle, queued], now=100.0, idle_timeout=30, surplus=3) == ["p-9", "p-1"]


def test_job_states_read_as_the_words_the_jobs_file_has_always_held() -> None:
    rec = running()
    assert json.loads(json.dumps(asdict(rec)))["state"] == "running"
    assert JobState("retiring") is JobState.RETIRING


@pytest.mark.parametrize("banned", ["time", "asyncio", "os", "subprocess", "dask", "distributed", "dask_jobqueue"])
def test_the_policy_is_pure(banned: str) -> None:
    tree = ast.parse(Path(scaling.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert banned not in imported


def test_a_new_job_gets_the_pools_walltime_or_what_the_run_has_left_or_is_not_submitted() -> None:
    """`new_job_walltime`: no run end → the pool's walltime; a run ending sooner cuts it; a run ending within
    RUN_END_MARGIN plus the drain window submits none (no task could start and finish there)."""
    from hpc_garage.core.pools import RUN_END_MARGIN
    from hpc_garage.launchers.jobqueue.scaling import new_job_walltime

    assert new_job_walltime(7200, None, now=1000.0, window=5.0) == 7200
    assert new_job_walltime(7200, 1000.0 + 9000, now=1000.0, window=5.0) == 7200  # the run outlasts the job
    assert new_job_walltime(7200, 1000.0 + 600, now=1000.0, window=5.0) == 600  # cut to the run's end
    assert new_job_walltime(7200, 1000.0 + RUN_END_MARGIN + 6, now=1000.0, window=5.0) == RUN_END_MARGIN + 6
    assert new_job_walltime(7200, 1000.0 + RUN_END_MARGIN + 5, now=1000.0, window=5.0) is None


def test_a_started_jobs_workers_live_until_the_job_or_the_run_ends_whichever_is_first() -> None:
    """`job_lifetime`: None before a worker registered; else the pool's lifetime, shortened by the job's own
    end (as the batch system said) and by the run's."""
    from hpc_garage.launchers.jobqueue.scaling import job_lifetime

    s = shape()
    assert job_lifetime(running(started_at=None), s, run_end=None) is None  # type: ignore[arg-type]
    assert job_lifetime(running(), s, run_end=None) == lifetime(s.site)[0]
    rec = running(started_at=100.0, ends_at=100.0 + 3600)  # the batch system gives it an hour
    assert job_lifetime(rec, s, run_end=None) == lifetime(s.site, 3600)[0] < lifetime(s.site)[0]
    rec = running(started_at=100.0, started=1e9)  # the run ends 30 minutes after it started
    assert job_lifetime(rec, s, run_end=1e9 + 1800) == lifetime(s.site, None, 1800)[0] < lifetime(s.site)[0]
