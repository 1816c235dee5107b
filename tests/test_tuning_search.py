"""hpc_garage.search (tuning/search.py): the task it is given is checked at once; a real flow on a local cluster
stops at its budget and says so, runs first the trial a job left running (with its parameters), and ends on too
many failed trials; on the local SLURM, the example keeps every GPU busy, and a cancelled search resumes with no
told trial asked or run again."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.tuning.search import _capacity, _check_task, _value
from tests.conftest import ROOT


def test_the_value_is_the_number_returned_or_the_metric_in_a_dict() -> None:
    assert _value(0.5, "loss") == 0.5 and _value({"loss": 2, "acc": 0.1}, "loss") == 2.0
    assert _value({"acc": 0.1}, "loss") is None and _value("0.5", "loss") is None
    assert _value(float("nan"), "loss") is None and _value(None, "loss") is None


def test_one_trial_per_worker_or_as_many_as_its_resources_allow() -> None:
    assert _capacity({"GPU": 4.0}, {"GPU": 1.0}) == 4
    assert _capacity({"GPU": 1.0}, {"GPU": 2.0}) == 0
    assert _capacity({"GPU": 4.0, "CPU": 8.0}, {"GPU": 1.0, "CPU": 4.0}) == 2
    assert _capacity({}, {}) == 1


def test_a_task_that_cannot_take_the_space_is_refused_in_one_line() -> None:
    from prefect import task

    @task
    def train(lr: float, depth: int, seed: int) -> float:
        return lr

    with pytest.raises(UserError, match=r"^search\(train, space=...\): the task takes no parameter width; the space "
                       r"gives no value for seed \(give it a default\)$"):
        _check_task(train, ["lr", "depth", "width"])
    with pytest.raises(UserError, match=r"give a Prefect task"):
        _check_task(lambda lr: lr, ["lr"])


def test_the_leaderboard_is_the_best_finished_trials_best_first() -> None:
    import optuna

    from hpc_garage.tuning.leaderboard import leaderboard

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    dist = {"lr": optuna.distributions.FloatDistribution(0, 1)}
    for value, state in ((0.2, None), (0.9, None), (None, optuna.trial.TrialState.PRUNED), (0.5, None)):
        trial = study.ask(dist)
        trial.set_user_attr("hpc_garage_gpu_seconds", 12.34)
        study.tell(trial, value, state=state)
    rows = leaderboard(study, "acc", rows=2)
    assert [(r["rank"], r["trial"], r["acc"]) for r in rows] == [(1, 1, 0.9), (2, 3, 0.5)]
    assert rows[0]["gpu_seconds"] == 12.3 and set(rows[0]) == {"rank", "trial", "acc", "gpu_seconds", "lr"}


SCRIPT = """
import json, os, sys, time
from pathlib import Path
import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from prefect import flow, task
import hpc_garage

SPACE = {"lr": ("log", 1e-4, 1.0), "depth": ("int", 2, 8)}

@task
def train(lr: float, depth: int) -> dict:
    Path("runs", f"{lr!r}-{depth}-{time.time_ns()}").touch()  # every execution leaves a mark
    time.sleep(0.5)
    return {"loss": (lr - 0.01) ** 2 + depth * 0.001}

@task
def broken(lr: float, depth: int) -> float:
    raise ValueError(f"depth {depth} breaks")

@flow(task_runner=hpc_garage.task_runner())
def tune() -> dict:
    first = hpc_garage.search(train, space=SPACE, trials=12, metric="loss", budget="2 GPUs", seed=1)
    failing = hpc_garage.search(broken, space=SPACE, trials=20, metric="loss", max_failures=3, name="failing")
    return {"first": first.summary(), "failing": failing.summary(),
            "first_ran": [r.number for r in sorted(first.results, key=lambda r: r.start)],
            "best": [first.best.number, first.best.params, first.best.value]}

if __name__ == "__main__":
    Path("runs").mkdir()
    storage = JournalStorage(JournalFileBackend("search.journal"))
    left = optuna.create_study(study_name="search", storage=storage).ask()  # a job ended with it running
    left.suggest_float("lr", 1e-4, 1.0, log=True); left.suggest_int("depth", 2, 8)
    out = tune()
    study = optuna.load_study(study_name="search", storage=storage)
    out["trials"] = [[t.number, t.state.name, t.params] for t in study.trials]
    out["left"] = [left.number, left.params]
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.slow
def test_a_search_stops_at_its_budget_runs_a_left_trial_first_and_ends_on_failures(tmp_path: Path) -> None:
    (tmp_path / "tune.py").write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run([sys.executable, "tune.py"], cwd=tmp_path, capture_output=True, text=True, timeout=400,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT "):])
    first, failing = out["first"], out["failing"]
    # the budget (2 GPU-seconds; each trial is >= 0.5 s on its worker) came before the 12 trials, and it says so
    assert first["stopped"].startswith("budget: ") and first["told"] < 12, first
    assert first["gpu_hours"] * 3600 >= 2 and first["budget_gpu_hours"] == round(2 / 3600, 4), first
    # the trial the "last job" left running ran first, with its own parameters, and was told
    left_number, left_params = out["left"]
    assert out["first_ran"][0] == left_number
    states = {number: (state, params) for number, state, params in out["trials"]}
    assert states[left_number] == ("COMPLETE", left_params)
    # (continuing the study in a later job, none asked twice: the SLURM cancel + resume test below)
    assert out["best"][0] in states and states[out["best"][0]][0] == "COMPLETE"
    # failures end the search, in one line naming the last; the trials in flight then (one per worker, and one
    # queued in Dask) end too, and are told
    in_flight = failing["workers"] + 1
    assert 3 <= failing["failed"] <= 2 + in_flight and failing["told"] == failing["failed"], failing
    assert failing["stopped"].startswith("failures: 3 trials failed (max_failures=3); the last: trial #")
    assert "ValueError" in failing["stopped"] and "breaks" in failing["stopped"], failing["stopped"]


# ---------------------------------------------------------------------- on the local SLURM

ASK_TELL = ROOT / "examples" / "optuna_ask_tell.py"


@pytest.mark.slurm
@pytest.mark.slow
def test_the_example_keeps_every_gpu_of_two_nodes_busy(tmp_path: Path) -> None:
    """examples/optuna_ask_tell.py on 2 nodes x 4 GPUs: as many trials in flight as GPUs, never more, the first
    wave one on each GPU, never two at once on a GPU, and a GPU whose trial ended gets the next one within about
    1 s while trials are left to ask (tests/test_pruning_sweep.py's gpu_use)."""
    from tests.test_durable import hpcg, site_file
    from tests.test_pruning_sweep import gpu_use, job_of

    site, out, trials, gpus = site_file(tmp_path), tmp_path / "search.json", 32, 8
    done = hpcg(["submit", "--site", str(site), "--nodes", "2", "--gpus-per-node", "4", "--time", "10", "--wait",
                 str(ASK_TELL), "--trials", str(trials), "--steps", "10", "--step-seconds", "0.5", "--out", str(out)],
                tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(out.read_text())
    assert summary["gpus"] == gpus and summary["workers"] == gpus and summary["told"] == trials, summary
    records = summary["records"]
    assert len(records) == trials
    gaps = gpu_use(records, gpus)
    # the hand-off is under 1 s (0.47-0.81 s at most on an idle machine); CI's 2 cores at load ~20 starve a
    # worker now and then (one gap of 1.04 s seen), so there the worst gap is held to 2 s and the median to 1 s
    assert gaps and sorted(gaps)[len(gaps) // 2] < 1.0 and max(gaps) < 2.0, gaps
    job = job_of(done)  # status and the report show the search: its counts and its best trial
    status = hpcg(["status", job, "--site", str(site)], tmp_path).stdout
    assert f"search:         search: {trials} trials told (" in status and "best #" in status, status
    report = hpcg(["report", job, "--site", str(site)], tmp_path).stdout.splitlines()
    assert report[-1].startswith(f"search search: {trials} trials told ("), report
    assert f"stopped: trials: all {trials} trials asked" in report[-1], report


@pytest.mark.slurm
@pytest.mark.slow
def test_a_cancelled_search_resumes_with_as_many_told_trials_as_asked_none_twice(tmp_path: Path) -> None:
    """The example on 1 node x 4 GPUs, cancelled once 6 of 40 trials were told, then resumed: the study ends with
    exactly its trials, all told; the resumed job runs none the first job had told."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from tests.slurm_jobs import wait_gone
    from tests.test_durable import hpcg, site_file
    from tests.test_pruning_sweep import job_of

    # 40 trials of ~4.5 s on 4 GPUs: ~35 s still to run when the cancel is asked at 6 told (with 20, under CI's
    # load the cancel's own start and wind-down outlasted the search's ~20 s left: "ended before the cancel")
    site, out, trials = site_file(tmp_path), tmp_path / "search.json", 40
    done = hpcg(["submit", "--site", str(site), "--nodes", "1", "--gpus-per-node", "4", "--time", "10",
                 str(ASK_TELL), "--trials", str(trials), "--steps", "15", "--step-seconds", "0.3", "--out", str(out)],
                tmp_path)
    job = job_of(done)

    def study() -> optuna.Study | None:
        found = list((tmp_path / "runs" / "sweeps").glob("*/*/search.journal"))
        if not found:
            return None
        try:
            return optuna.load_study(study_name="search", storage=JournalStorage(JournalFileBackend(str(found[0]))))
        except KeyError:  # the journal is there, its study not yet (Optuna opens the file, then appends the study)
            return None

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        s = study()
        if s is not None and sum(t.state.is_finished() for t in s.trials) >= 6:
            break
        time.sleep(0.5)
    asked = time.monotonic()
    cancelled = hpcg(["cancel", job, "--site", str(site)], tmp_path, timeout=200)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    took = time.monotonic() - asked
    wait_gone(job, 120)
    s = study()
    assert s is not None and not out.exists(), f"the search ended before the cancel (which took {took:.1f} s)"
    told_before = {t.number for t in s.trials if t.state.is_finished()}
    assert len(told_before) < trials
    resumed = hpcg(["resume", job, "--site", str(site), "--wait"], tmp_path, timeout=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    s = study()
    assert s is not None and len(s.trials) == trials and all(t.state.is_finished() for t in s.trials)
    ran_again = {r["number"] for r in json.loads(out.read_text())["records"]} & told_before
    print(f"cancelled with {len(told_before)} told; resumed to {trials}")
    assert not ran_again, f"told before the cancel and run again: {sorted(ran_again)}"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)  # the submit's own 600 s first: its output names what it waited for
def test_a_search_that_reaches_its_walltime_continues_in_the_follow_up_job(tmp_path: Path) -> None:
    """--time 2 (120 s) with `requeue: auto` for a search of about 140 s of trials on 4 GPUs, most of them pruned
    (a 1-minute job under CI's load spent half of it starting): each job winds
    down, the follow-up job continues the same study, and it ends with exactly its trials, all told. No trial
    was started that did not reach its first report before its job ended: every trial a job interrupted had
    reported (it is in that job's trials.json)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from hpc_garage.cluster.report import by_task_run
    from tests.test_durable import hpcg, job_logs, site_file

    site = site_file(tmp_path, "requeue: auto\nwalltime_margin: 15s\ncheckpoint_grace: 5s\n")
    trials, out = 120, tmp_path / "search.json"
    done = hpcg(["submit", "--site", str(site), "--nodes", "2", "--gpus-per-node", "2", "--time", "2", "--wait",
                 str(ASK_TELL), "--trials", str(trials), "--steps", "15", "--step-seconds", "0.8", "--out", str(out)],
                tmp_path, timeout=800)
    assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")
    assert re.search(r"the sweep continues in job \d+", done.stdout), done.stdout
    [journal] = (tmp_path / "runs" / "sweeps").glob("*/*/search.journal")
    study = optuna.load_study(study_name="search", storage=JournalStorage(JournalFileBackend(str(journal))))
    assert len(study.trials) == trials and all(t.state.is_finished() for t in study.trials)
    summary = json.loads(out.read_text())
    assert summary["told"] == trials and summary["stopped"] == f"trials: all {trials} trials asked", summary
    unreported = []
    for report in (tmp_path / "runs").glob("*/report.json"):
        metrics = report.parent / "metrics" / "trials.json"  # none: no trial of that job reported
        reported = json.loads(metrics.read_text())["trials"] if metrics.exists() else {}
        runs = {t["run"] for t in reported.values()}
        unreported += [run for run, t in by_task_run(json.loads(report.read_text())).items()
                       if t.get("interrupted") and run not in runs]
    jobs = len(list((tmp_path / "runs").glob("*/report.json")))
    print(f"search over {jobs} jobs: {summary['states']}")
    assert jobs >= 2 and not unreported, unreported
