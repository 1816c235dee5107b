"""What the trials reported, as its readers see it (cluster/trial_metrics.py): trials.json read cheaply and never
to a failure, the live figures status shows, the report's section with the GPU-seconds pruning saved, the curves.
The files are hand-written in the shape prefect/metrics.py writes (docs: issue 25's store)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from hpc_garage.cluster import trial_metrics
from hpc_garage.cluster.report import by_task_run
from hpc_garage.cluster.trial_metrics import Watch, best_of, curves, lines, live, read_summary, section
from hpc_garage.rundir import RunDir

RUNS = {name: f"{i:x}" * 32 for i, name in enumerate(("a", "b", "c", "d", "e"), start=10)}  # task run ids (hex)


def trial(run: str, state: str, best: float, *, reports: int = 10, started: float = 0.0,
          ended: float | None = None) -> dict[str, Any]:
    return {"task": "train", "run": RUNS[run], "reports": reports, "last_step": reports - 1,
            "last": {"loss": best + 0.1}, "best": {"loss": best, "acc": 1 - best}, "state": state,
            "started": started, "ended": ended, "worker": "tls://10.0.0.1:1"}


def summary_data(**extra: Any) -> dict[str, Any]:
    """Five trials: a, b ran to the end (10 s, 20 s), c and d pruned (5 s on 2 GPUs, 18 s on 1), e not ended."""
    return {"metric": "loss", "mode": "min", "pruner": "MedianPruner", "updated": 1.0,
            "trials": {"key-a": trial("a", "done", 0.5), "key-b": trial("b", "done", 0.29),
                       "key-c": trial("c", "pruned", 0.9), "key-d": trial("d", "pruned", 0.8),
                       "key-e": trial("e", "running", 0.7, started=100.0, ended=104.0)},
            "reporting": 5, "pruned": 2, "best": {"trial": "key-b", "value": 0.29, "step": 11}, **extra}


def report_of(durations: dict[str, tuple[float, int]]) -> dict[str, Any]:
    """A report's trials (cluster/report.build's shape), keyed as prefect/fast.py keys a Prefect trial, by their
    task run id (cluster/report.by_task_run)."""
    return by_task_run({"trials": [{"key": f"train-{RUNS[name]}", "worker": f"w{i}",
                                    "gpus": [str(g) for g in range(gpus)], "start": 0.0, "duration_s": seconds,
                                    "failed": False}
                                   for i, (name, (seconds, gpus)) in enumerate(durations.items())]})


def test_a_missing_partial_or_foreign_file_reads_as_nothing(tmp_path: Path) -> None:
    path = tmp_path / "trials.json"
    assert read_summary(path) is None  # no trial reported (or no run directory)
    path.write_text(json.dumps(summary_data())[:200])  # cut mid-write
    assert read_summary(path) is None
    for foreign in ([1, 2], {"trials": [1]}, {"metric": "loss"}, "text"):
        path.write_text(json.dumps(foreign))
        assert read_summary(path) is None, foreign
        assert Watch(path)() is None
    path.write_text(json.dumps({"trials": {"t": "not an object", "u": {"state": "odd", "best": "x"}}, "best": 3}))
    assert live(read_summary(path)) == {"reporting": 0, "pruned": 0, "best": None}  # what can be read of it


def test_live_figures_are_the_counts_and_the_best_trial() -> None:
    assert live(summary_data()) == {"reporting": 5, "pruned": 2, "best": {"trial": "key-b", "task": "train",
                                                                          "metric": "loss", "value": 0.29, "step": 11}}
    assert live(summary_data(trials={}, reporting=0)) is None  # nothing reported: status shows nothing
    assert live(summary_data(reporting=None, pruned=None))["reporting"] == 1  # counted: those running now


def test_the_best_trial_where_the_file_names_none_is_each_trials_best_by_mode() -> None:
    data = summary_data(best=None)
    assert best_of(data)["trial"] == "key-b"
    assert best_of(data | {"mode": "max"})["trial"] == "key-c"
    no_metric = best_of(data | {"metric": None})  # without a metric: the first one reported, lowest
    assert (no_metric["trial"], no_metric["metric"]) == ("key-b", "loss")


def test_watch_reads_again_only_when_the_file_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "trials.json"
    reads: list[Path] = []
    real = trial_metrics.read_summary
    monkeypatch.setattr(trial_metrics, "read_summary", lambda p: reads.append(p) or real(p))
    watch = Watch(path)
    assert watch() is None and reads == []  # no file: one stat, no read
    path.write_text(json.dumps(summary_data()))
    assert watch()["reporting"] == 5
    assert watch()["reporting"] == 5 and len(reads) == 1  # unchanged: not read again
    path.write_text(json.dumps(summary_data(reporting=6)))
    os.utime(path, ns=(1, 1))
    assert watch()["reporting"] == 6 and len(reads) == 2
    path.unlink()
    assert watch() is None


def test_pruning_saved_the_mean_finished_duration_less_each_pruned_ones_times_its_gpus() -> None:
    report = report_of({"a": (10.0, 1), "b": (20.0, 1), "c": (5.0, 2), "d": (18.0, 1)})
    found = section(summary_data(), report)
    # mean of the finished: 15 s; c: (15 - 5) x 2 GPUs = 20; d: 18 s is longer than the mean: 0, not -3
    assert found["saved"] == {"seconds": 20.0, "unit": "GPU-s", "mean_finished_s": 15.0, "finished": 2,
                              "pruned_timed": 2}
    assert (found["reporting"], found["done"], found["pruned"], found["running"]) == (5, 2, 2, 1)
    rows = {r["trial"]: r for r in found["trials"]}
    assert (rows["key-c"]["duration_s"], rows["key-c"]["gpus"]) == (5.0, 2)
    assert (rows["key-e"]["duration_s"], rows["key-e"]["gpus"]) == (4.0, 0)  # untimed by the report: the driver's
    text = lines(found)
    assert text[0] == ("trial metrics: 5 trials reported; best loss 0.29 (trial key-b step 11); 2 ran to the end, "
                       "2 pruned (MedianPruner), 1 did not end")
    assert text[1].startswith("pruning saved about 20.0 GPU-s (an estimate: for each of the 2 pruned trials, the "
                              "15.0 s mean of the 2 that ran to the end less its own duration, times its GPUs")


def test_failed_and_interrupted_trials_are_counted_apart_and_not_compared_with() -> None:
    data = summary_data()
    data["trials"]["key-a"]["state"], data["trials"]["key-e"]["state"] = "failed", "interrupted"
    found = section(data, report_of({"a": (1.0, 1), "b": (20.0, 1), "c": (5.0, 2), "d": (18.0, 1)}))
    assert (found["done"], found["failed"], found["interrupted"], found["running"]) == (1, 1, 1, 0)
    assert found["saved"]["seconds"] == 32.0  # (20 - 5) x 2 + (20 - 18): the failed one's 1 s is no yardstick
    assert lines(found)[0].endswith("1 ran to the end, 2 pruned (MedianPruner), 1 failed, 1 interrupted")


def test_without_a_finished_trial_the_saving_is_not_estimated() -> None:
    data = summary_data()
    for key in ("key-a", "key-b"):
        data["trials"][key]["state"] = "pruned"
    found = section(data, report_of({"a": (10.0, 1)}))
    assert found["saved"] is None
    assert lines(found)[1].startswith("pruning saved: not estimated")
    cpu = section(summary_data(), report_of({"a": (10.0, 0), "b": (20.0, 0), "c": (5.0, 0)}))
    assert cpu["saved"]["unit"] == "worker-s" and cpu["saved"]["seconds"] == 10.0  # c only: d is untimed
    assert section(summary_data(trials={}), {}) is None


def test_curves_are_each_trials_metric_by_step_skipping_what_cannot_be_read(tmp_path: Path) -> None:
    rundir = RunDir(tmp_path)
    rundir.metrics_dir.mkdir()
    rundir.trial_metrics("key-a").write_text(
        "\n".join(json.dumps({"step": s, "time": 1.0, "values": {"loss": 1.0 / (s + 1)}}) for s in (2, 0, 1))
        + '\n{"step": 3, "values": {"acc": 0.5}}\n{"step": 4, "values": {"loss": NaN}}\n{"step": 5, "val\n')
    rundir.trial_metrics("key-b").write_text("not json\n")
    got = curves(rundir, {"metric": "loss", "trials": [{"trial": "key-a"}, {"trial": "key-b"}, {"trial": "key-x"}]})
    assert got == {"key-a": [(0.0, 1.0), (1.0, 0.5), (2.0, 1 / 3)]}
    assert rundir.trial_metrics("../x/y").parent == rundir.metrics_dir  # an id never leaves the directory
