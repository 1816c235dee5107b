"""The scheduler's record of finished trials (cluster/finished_trials.py): every record back for the report, and
memory that does not grow with the sweep."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

from hpc_garage.cluster.finished_trials import FinishedTrials, TrialRecord


def record(i: int, **extra: object) -> TrialRecord:
    fields: dict[str, object] = {"failed": False, "asked_gpu": True, **extra}
    return TrialRecord(key=f"trial-{i:032x}", worker=f"w{i % 3}", start=float(i), stop=i + 0.5,
                       **fields)  # type: ignore[arg-type]


def test_every_record_comes_back_in_the_order_they_finished_with_their_counts(tmp_path: Path) -> None:
    trials = FinishedTrials(tmp_path, recent=10)
    for i in range(25):
        trials.add(record(i, failed=i % 5 == 0, interrupted=i == 7, gpu={"gpu_util_mean": 50.0} if i == 3 else None))
    back = list(trials.records())
    assert [r.key for r in back] == [record(i).key for i in range(25)]
    assert back[3].gpu == {"gpu_util_mean": 50.0} and back[7].interrupted and back[5].failed and not back[6].failed
    assert (len(trials), trials.failed, trials.interrupted) == (25, 5, 1)
    assert os.listdir(tmp_path) == []  # the spool has no name: nothing is left in the run directory
    trials.add(record(25))  # more after a read: appended, none lost
    assert [r.key for r in trials.records()][-2:] == [record(24).key, record(25).key]
    assert len(list(trials.records())) == 26
    pairs = list(zip(trials.records(), trials.records()))  # two walks at once keep their own places
    assert all(a.key == b.key for a, b in pairs) and len(pairs) == 26
    trials.close()


def test_a_recent_trial_computed_again_is_counted_once_and_takes_its_samplers_figures() -> None:
    trials = FinishedTrials(recent=10)
    for i in range(5):
        trials.add(record(i))
    trials.add(record(2, failed=True))  # a lost worker's result computed again
    assert (len(trials), trials.failed) == (5, 1)
    assert trials.latest(2) == [record(2).key, record(4).key] and record(3).key in trials
    found = trials.get(record(4).key)
    assert found is not None
    trials.update(found, {"start": 10.0, "stop": 12.0, "failed": True, "gpu_memory_peak": 7})
    assert (found.start, found.stop, found.gpu, trials.failed) == (10.0, 12.0, {"gpu_memory_peak": 7}, 2)
    assert sorted(r.key for r in trials.records()) == sorted(record(i).key for i in range(5))


def test_memory_stays_flat_as_trials_finish() -> None:
    trials = FinishedTrials(recent=1000)
    tracemalloc.start()
    try:
        for i in range(2000):
            trials.add(record(i))
        after_2000 = tracemalloc.get_traced_memory()[0]
        for i in range(2000, 20000):
            trials.add(record(i))
        growth = tracemalloc.get_traced_memory()[0] - after_2000
    finally:
        tracemalloc.stop()
    assert growth < 100_000, growth  # 18,000 more records held in memory would take several MB
    assert len(trials) == 20000 and len(list(trials.records())) == 20000
    trials.close()


def test_the_latest_4096_are_in_memory_as_the_docs_say() -> None:
    trials = FinishedTrials()  # docs/how-to/large-jobs.md: "the latest 4,096 finished trials' records in memory"
    for i in range(5000):
        trials.add(record(i))
    assert trials.get(record(5000 - 4096).key) is not None and record(4999).key in trials
    assert trials.get(record(5000 - 4097).key) is None and record(0).key not in trials  # in the file
    assert [r.key for r in trials.records()] == [record(i).key for i in range(5000)]
    trials.close()
