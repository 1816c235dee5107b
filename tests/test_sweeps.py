"""A sweep on disk (hpc_garage/sweeps.py): its trials counted across the jobs of an epoch, and the trials that
ran again because their task's source changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_garage.core.sweep import SOURCE_CHANGES, SOURCES_DIR, SweepKey
from hpc_garage.sweeps import SweepBook, across_jobs, add_job, source_changes, summary

RUNNING = {"done": 12, "running": 4, "failed": 1, "waiting": 20}


@pytest.mark.parametrize(("kept", "jobs", "expected"), [
    (0, [], {"done": 0, "running": 0, "failed": 0, "to_go": 0, "jobs": 0}),
    (12, [(RUNNING, True)], {"done": 12, "running": 4, "failed": 1, "to_go": 20, "jobs": 1}),
    # the job wound down: what ran when it ended, and what never started, is to go
    (12, [(RUNNING, False)], {"done": 12, "running": 0, "failed": 1, "to_go": 24, "jobs": 1}),
    # ... though its flow, stopped, forgot the trials it never started: the most it knew of counts
    (12, [({"done": 12, "running": 0, "failed": 0, "waiting": 0, "total": 41}, False)],
     {"done": 12, "running": 0, "failed": 0, "to_go": 29, "jobs": 1}),
    # the follow-up is still queued: the last job that reported speaks for running, failed and to go
    (12, [(RUNNING, False), (None, False)], {"done": 12, "running": 0, "failed": 1, "to_go": 24, "jobs": 2}),
    # the follow-up reads the first job's trials back (done counts them) and runs the rest
    (30, [(RUNNING, False), ({"done": 35, "running": 2, "failed": 0, "waiting": 3}, True)],
     {"done": 35, "running": 2, "failed": 0, "to_go": 3, "jobs": 2}),
    # results kept count trials finished in jobs whose progress was never written (a killed job); the
    # follow-up has not read them all back yet, so its waiting trials are fewer to go than it says
    (17, [(None, False), ({"done": 2, "running": 4, "failed": 0, "waiting": 30}, True)],
     {"done": 17, "running": 4, "failed": 0, "to_go": 15, "jobs": 2}),
])
def test_trials_across_jobs(kept: int, jobs: list, expected: dict) -> None:
    assert across_jobs(kept, jobs) == expected


def test_source_changes_count_distinct_trials_per_task(tmp_path: Path) -> None:
    lines = [{"task": "train", "trial": "a", "at": 1}, {"task": "train", "trial": "b", "at": 2},
             {"task": "train", "trial": "a", "at": 3}, {"task": "score", "trial": "c", "at": 4}]
    (tmp_path / SOURCE_CHANGES).write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"task": "tr')
    assert source_changes(tmp_path) == {"score": 1, "train": 2}  # the cut last line is skipped
    assert source_changes(tmp_path / "missing") == {}


def test_summary_counts_result_files_not_the_bookkeeping_beside_them(tmp_path: Path) -> None:
    book = SweepBook(tmp_path, "s")
    add_job(book, SweepKey("s", 1), "42", "submit", {})
    results = book.results(1)
    (results / SOURCES_DIR).mkdir(parents=True)
    (results / SOURCES_DIR / "x").write_text("src")
    for name in ("k1", "k2", ".lock-k3"):
        (results / name).write_text("{}")
    (results / SOURCE_CHANGES).write_text(json.dumps({"task": "t", "trial": "x", "at": 0}) + "\n")
    found = summary(book)
    assert found is not None
    assert (found["results"], found["source_changed"], [j["job_id"] for j in found["jobs"]]) == (2, {"t": 1}, ["42"])
