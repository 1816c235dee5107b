"""A run's progress in words (core/progress_text.py): the same line wherever a job is shown (`status`, `--wait`,
`run`'s report). The lines as `status` shows them: tests/test_status_text.py and tests/test_progress.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpc_garage.core.progress_text import interrupted_text, metrics_text, progress_text, sweep_text, trial_label


@pytest.mark.parametrize(("elapsed", "eta", "shown"), [
    (5, None, "5s"), (65, 130, "1m05s, ETA 2m10s"), (3600 + 61, 59.6, "1h01m, ETA 1m00s")])
def test_times_read_in_seconds_minutes_or_hours(elapsed: float, eta: float | None, shown: str) -> None:
    assert progress_text({"done": 1, "elapsed": elapsed, "eta": eta}) == f"1 done, 0 running, 0 failed, 0 waiting; {shown}"


def test_a_trial_is_named_by_its_id_where_short_else_by_its_task_and_the_ids_start() -> None:
    long_id = "3f2a9c" + "0" * 26
    assert trial_label("train-3") == "train-3"
    assert trial_label(long_id, "train") == "train-3f2a9c00"
    assert trial_label(long_id) == long_id[:12]


def test_a_sweeps_line_counts_its_jobs_what_ran_again_and_what_was_interrupted() -> None:
    assert sweep_text(None) is None and sweep_text({"trials": {}}) is None
    trials = {"done": 40, "running": 4, "failed": 0, "to_go": 36, "jobs": 1}
    assert sweep_text({"trials": trials}) == "40 done, 4 running, 0 failed, 36 to go (1 job)"
    changed = {"trials": {**trials, "jobs": 3}, "source_changed": {"train": 2}}
    assert sweep_text(changed) == ("40 done, 4 running, 0 failed, 36 to go (3 jobs); 2 ran again because their "
                                   "task's source changed (train)")
    cut = {"interrupted": 2, "continued": 2, "lost": 12.4, "lost_max": 5,
           "stopped": [{"task": "train", "trial": "3f2a9c" + "0" * 26, "why": "longer than the walltime"}]}
    assert interrupted_text(cut) == ("; 2 interrupted, to be continued; 2 continued from their checkpoints (work "
                                     "lost 12 s, at most 5 s); trial train (3f2a9c000000) not continued: longer "
                                     "than the walltime")
    assert interrupted_text(None) == "" and sweep_text({"trials": trials, "interrupted": cut}).endswith(
        "longer than the walltime")


@given(st.one_of(st.none(), st.text(), st.integers(), st.dictionaries(st.text(max_size=8), st.integers() | st.none()
                                                                      | st.text(max_size=4), max_size=4)))
def test_metrics_of_any_shape_are_a_line_or_nothing(metrics: object) -> None:
    """What the trials reported comes from a file the flow writes: a shape this does not know is no line."""
    text = metrics_text(metrics)
    assert text is None or "reporting" in text


def test_a_searchs_summary_is_one_line_with_its_best_trial_counts_and_budget() -> None:
    from hpc_garage.core.progress_text import search_text

    summary = {"study": "search", "metric": "loss", "stopped": "budget: 20 GPUh of 20 GPUh used", "told": 42,
               "complete": 10, "pruned": 30, "failed": 2, "running": 0, "gpu_hours": 20.04, "budget_gpu_hours": 20.0,
               "best": {"number": 17, "params": {"lr": 0.003, "depth": 4}, "value": 0.123456789}}
    assert search_text(summary) == ("search: 42 trials told (10 complete, 30 pruned, 2 failed), 20 GPUh of 20 GPUh; "
                                    "best #17 loss 0.123457 {'lr': 0.003, 'depth': 4}; stopped: budget: 20 GPUh of "
                                    "20 GPUh used")
    running = {**summary, "stopped": "", "best": None, "budget_gpu_hours": None, "gpu_hours": 0.5}
    assert search_text(running) == ("search: 42 trials told (10 complete, 30 pruned, 2 failed), 0.5 GPUh; no trial "
                                    "finished yet")
    assert search_text(None) is None and search_text({"trials": {}}) is None
