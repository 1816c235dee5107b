"""`report --plot` (cluster/report_plot.py): a search's best value so far against the GPU-hours its trials used,
computed from the report alone (min and max searches; pruned, failed and interrupted trials never the best), the
panel drawn below the timeline, and a job without a search drawn as before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_garage.cluster.report import build, with_metrics
from hpc_garage.cluster.report_plot import SearchProgress, plot, search_progress
from hpc_garage.rundir import RunDir
from tests.test_report import _png_height, reported_run

pytest.importorskip("matplotlib")

T0 = 1000.0
# key, worker, start, stop (s after T0), failed, state in trials.json (None: the trial reported nothing), last loss
TRIALS = [("k0", "w0", 0, 1800, False, "done", 0.8),
          ("k1", "w1", 0, 900, False, "pruned", 2.0),
          ("k2", "w1", 900, 2700, False, "done", 0.5),
          ("k3", "w0", 1800, 2400, True, None, None),
          ("k4", "w0", 2400, 4500, False, "done", 0.9),
          ("k5", "w1", 2700, 3600, False, "pruned", 0.1)]  # pruned at a loss below every finished trial's
GPUS = {"w0": ["0", "1"], "w1": ["2"]}  # w0's trials count twice
# in the order they ended: k1 (900), k0 (1800), k3 (2400), k2 (2700), k5 (3600), k4 (4500)
ENDED = ["k1", "k0", "k3", "k2", "k5", "k4"]
GPU_HOURS = [900 / 3600, (900 + 2 * 1800) / 3600, (900 + 2 * 1800 + 2 * 600) / 3600,
             (900 + 2 * 1800 + 2 * 600 + 1800) / 3600, (900 + 2 * 1800 + 2 * 600 + 1800 + 900) / 3600,
             (900 + 2 * 1800 + 2 * 600 + 1800 + 900 + 2 * 2100) / 3600]


def run_id(key: str) -> str:
    return key[-1] * 32  # a task run id's hex


def searched(tmp_path: Path, mode: str | None = "min", reported: bool = True, budget: float | None = 4.0) -> dict:
    """A report as `load` returns it: report.json built from a progress record, then search.json and (where
    trials reported) trials.json read from the run directory."""
    rundir = RunDir(tmp_path / f"run-{mode}-{reported}")
    rundir.metrics_dir.mkdir(parents=True, exist_ok=True)
    report = build({"started": T0, "ended": T0 + 4600, "flow_runs": [],
                    "workers": [{"name": w, "gpus": float(len(ids)), "gpu_ids": ids, "nthreads": 1,
                                 "memory_limit": 2**32, "memory_peak": 2**30, "joined": T0, "left": T0 + 4600}
                                for w, ids in GPUS.items()],
                    "trials": [{"key": f"train-{run_id(key)}", "worker": worker, "start": T0 + start,
                                "stop": T0 + stop, "failed": failed, "asked_gpu": True}
                               for key, worker, start, stop, failed, _, _ in TRIALS]})
    if reported:
        rundir.metrics_summary.write_text(json.dumps({
            "metric": "loss", "mode": mode or "min", "pruner": "SuccessiveHalvingPruner", "reporting": 5,
            "trials": {key: {"task": "train", "run": run_id(key), "reports": 3, "last_step": 2, "state": state,
                             "last": {"loss": loss}, "best": {"loss": loss}}
                       for key, _, _, _, _, state, loss in TRIALS if state is not None}}))
    search = {"study": "search", "metric": "loss", **({"mode": mode} if mode else {}),
              "stopped": "trials: all 6 trials asked", "workers": 3, "told": 6, "complete": 3, "pruned": 2,
              "failed": 1, "running": 0, "gpu_hours": 3.6, "budget_gpu_hours": budget,
              "best": {"number": 2, "params": {"lr": 0.01}, "value": 0.5 if mode != "max" else 0.9}}
    rundir.search_summary.write_text(json.dumps(search))
    return with_metrics(report, rundir)


def test_gpu_hours_add_up_as_trials_ended_and_the_best_so_far_follows_the_mode(tmp_path: Path) -> None:
    low = search_progress(searched(tmp_path, "min"))
    assert low is not None and (low.metric, low.mode, low.budget_gpu_hours, low.study_best) == ("loss", "min", 4.0, 0.5)
    assert [p.key for p in low.points] == [f"train-{run_id(k)}" for k in ENDED]
    assert [p.gpu_hours for p in low.points] == pytest.approx(GPU_HOURS)
    assert [p.state for p in low.points] == ["pruned", "done", "failed", "done", "pruned", "done"]
    assert [p.value for p in low.points] == [None, 0.8, None, 0.5, None, 0.9]
    # k5, pruned at 0.1, and k1, pruned at 2.0, are never the best
    assert [p.best for p in low.points] == [None, 0.8, 0.8, 0.5, 0.5, 0.5] and low.best == 0.5
    high = search_progress(searched(tmp_path, "max"))
    assert high is not None and high.mode == "max"
    assert [p.best for p in high.points] == [None, 0.8, 0.8, 0.8, 0.8, 0.9] and high.best == 0.9


def test_the_mode_of_an_older_search_json_is_the_trials_metrics_and_a_cpu_trial_counts_once(tmp_path: Path) -> None:
    assert search_progress(searched(tmp_path, None)).mode == "min"  # type: ignore[union-attr]
    report = searched(tmp_path, None)
    report["metrics"]["mode"] = "max"
    assert search_progress(report).mode == "max"  # type: ignore[union-attr]
    report["metrics"]["metric"] = "accuracy"  # the trials' metric is another: the search's own default
    assert search_progress(report).mode == "min"  # type: ignore[union-attr]
    cpu = {"trials": [{"key": "a", "start": 0.0, "duration_s": 1800.0, "failed": False, "gpus": []},
                      {"key": "b", "start": 0.0, "duration_s": 3600.0, "failed": False}],
           "search": {"told": 2, "metric": "loss"}}
    assert [p.gpu_hours for p in search_progress(cpu).points] == [0.5, 1.5]  # type: ignore[union-attr]


def test_the_plot_adds_the_search_panel_below_the_timeline(tmp_path: Path) -> None:
    report = searched(tmp_path, "min")
    out, plain = tmp_path / "search.png", tmp_path / "plain.png"
    drawn = plot(report, out)
    assert isinstance(drawn, SearchProgress) and drawn == search_progress(report)
    assert plot({k: v for k, v in report.items() if k != "search"}, plain) is None
    assert out.read_bytes().startswith(b"\x89PNG") and _png_height(out) == _png_height(plain) + 400
    nothing = searched(tmp_path, "min", reported=False, budget=None)  # no trial reported: GPU-hours, no values
    progress = plot(nothing, tmp_path / "nothing.png")
    assert progress is not None and progress.best is None and progress.budget_gpu_hours is None
    assert [p.state for p in progress.points] == ["done", "done", "failed", "done", "done", "done"]
    assert (tmp_path / "nothing.png").read_bytes().startswith(b"\x89PNG")


def test_a_job_without_a_search_is_drawn_as_before(tmp_path: Path) -> None:
    """No search (or a search.json that is not one): no panel, the timeline's own size, the same bytes."""
    report = {k: v for k, v in searched(tmp_path, "min").items() if k != "search"}
    drawn = {name: tmp_path / f"{name}.png" for name in ("none", "foreign")}
    assert plot(report, drawn["none"]) is None
    assert plot(report | {"search": {"study": "x"}}, drawn["foreign"]) is None
    assert drawn["none"].read_bytes() == drawn["foreign"].read_bytes()
    assert int.from_bytes(drawn["none"].read_bytes()[16:20], "big") == 1000  # today's 10 inches; a panel makes 11
    assert _png_height(drawn["none"]) == round(100 * (1 + 0.35 * 3))  # three GPU rows, as before


def test_report_plot_of_a_job_that_ran_a_search(tmp_path: Path) -> None:
    """`report JOB --plot`: the search's search.json in the run directory adds its panel below the curves."""
    env, run_dir = reported_run(tmp_path)

    def drawn(png: Path) -> int:
        done = subprocess.run([sys.executable, "-m", "hpc_garage", "report", "4343", "--site", "metrics-lab",
                               "--plot", str(png)], capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0 and done.stdout.splitlines()[-1] == f"timeline: {png}", done.stdout + done.stderr
        return _png_height(png)

    before = drawn(tmp_path / "before.png")
    RunDir(run_dir).search_summary.write_text(json.dumps({
        "study": "search", "metric": "loss", "mode": "min", "stopped": "budget: 0.01 GPUh used", "told": 4,
        "complete": 2, "pruned": 2, "failed": 0, "running": 0, "gpu_hours": 0.015, "budget_gpu_hours": 0.01,
        "best": {"number": 0, "params": {"lr": 0.1}, "value": 1.1}}))
    assert drawn(tmp_path / "after.png") == before + 400
