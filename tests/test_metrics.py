"""The flow's side of trial.report() (hpc_garage/prefect/metrics.py): the store written in the run directory,
the pruner asked, pruned trials stopped on their worker. First without a cluster (the drain's bookkeeping on
scripted reports), then a real flow on a real Dask cluster with Prefect: eight trials with deterministic
learning curves under a median pruner."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpc_garage.prefect.metrics import TrialMetrics
from hpc_garage.rundir import RunDir
from hpc_garage.variables import RESULTS_ENV, RUN_DIR_ENV
from tests.slurm_jobs import poll

optuna = pytest.importorskip("optuna")


class FakeClient:
    """What TrialMetrics uses of a Dask client: the topic, and the run op it stops a trial with."""

    def __init__(self) -> None:
        self.handler: Any = None
        self.runs: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
        self.plugins: dict[str, Any] = {}

    def subscribe_topic(self, topic: str, handler: Any) -> None:
        self.handler = handler

    def unsubscribe_topic(self, topic: str) -> None:
        self.handler = None

    def run(self, function: Any, *args: Any, **kwargs: Any) -> None:
        self.runs.append((function, args, kwargs))

    def register_plugin(self, plugin: Any, name: str) -> None:
        self.plugins[name] = plugin

    def unregister_worker_plugin(self, name: str) -> None:
        del self.plugins[name]


class Done:
    """A finished task's future, holding Prefect's state of it."""

    status = "finished"

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def result(self, timeout: float | None = None) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(type=SimpleNamespace(value=self.kind))


def msg(trial: str, step: int, **values: float) -> dict[str, Any]:
    return {"trial": trial, "run": f"run-{trial}", "task": "train", "step": step, "time": 1000.0 + step,
            "values": values, "worker": "tcp://w1"}


def feed(metrics: TrialMetrics, client: FakeClient, *items: Any) -> None:
    """Reports (dicts) through the client's handler, and task ends (run, kind), then a drained close."""
    for item in items:
        if isinstance(item, dict):
            client.handler((time.time(), {"reports": [item]}))
        else:
            metrics.ended(item[0], Done(item[1]))


def test_reports_are_stored_per_trial_and_summed_up(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path)
    metrics, client = TrialMetrics(None, "loss", "min", run_dir), FakeClient()
    metrics.start(client)
    feed(metrics, client, msg("a", 0, loss=1.0, acc=0.1), msg("a", 1, loss=0.5, acc=0.3), msg("a", 2, loss=0.7),
         msg("b", 0, loss=0.9), msg("b", 1, loss=0.4), ("run-b", "COMPLETED"), ("run-a", "CRASHED"),
         ("run-x", "COMPLETED"))  # x never reported: not a trial here
    metrics.close()
    assert client.handler is None and not client.runs
    summary = json.loads(run_dir.metrics_summary.read_text())
    assert (run_dir.metrics_dir.stat().st_mode & 0o777) == 0o700
    assert summary["metric"] == "loss" and summary["mode"] == "min" and summary["pruner"] is None
    a, b = summary["trials"]["a"], summary["trials"]["b"]
    assert a["last"] == {"loss": 0.7, "acc": 0.3} and a["best"] == {"loss": 0.5, "acc": 0.3}
    assert (a["reports"], a["last_step"], a["task"], a["run"], a["worker"]) == (3, 2, "train", "run-a", "tcp://w1")
    assert a["state"] == "interrupted" and b["state"] == "done" and b["ended"] is not None and a["started"] == 1000.0
    assert summary["best"] == {"trial": "b", "value": 0.4, "step": 1}
    assert (summary["reporting"], summary["pruned"]) == (0, 0)
    lines = [json.loads(line) for line in run_dir.trial_metrics("a").read_text().splitlines()]
    assert lines == [{"step": 0, "time": 1000.0, "values": {"loss": 1.0, "acc": 0.1}},
                     {"step": 1, "time": 1001.0, "values": {"loss": 0.5, "acc": 0.3}},
                     {"step": 2, "time": 1002.0, "values": {"loss": 0.7}}]


def test_without_a_metric_the_first_reported_one_ranks_lower_first(tmp_path: Path) -> None:
    metrics, client = TrialMetrics(None, None, "max", RunDir(tmp_path)), FakeClient()
    metrics.start(client)
    feed(metrics, client, msg("a", 0, err=3.0, acc=0.9), msg("b", 0, err=2.0, acc=0.1))
    metrics.close()
    summary = json.loads(RunDir(tmp_path).metrics_summary.read_text())
    assert (summary["metric"], summary["mode"], summary["best"]["trial"]) == ("err", "min", "b")
    assert summary["reporting"] == 2


def test_numbered_reports_are_answered_where_the_trial_waits_and_the_prune_goes_with_the_answer(
        tmp_path: Path) -> None:
    """Reports are answered where the trial waits ("answer": its steps are slow) and where they prune it (the
    stop goes with the answer); the workers are told, by a plugin, that answers come."""
    from hpc_garage.cluster import stopping

    pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1)
    metrics, client = TrialMetrics(pruner, "loss", "min", RunDir(tmp_path)), FakeClient()
    metrics.start(client)

    def numbered(trial: str, step: int, loss: float, answer: bool) -> dict[str, Any]:
        return msg(trial, step, loss=loss) | {"number": step + 1, "answer": answer}

    # each trial's reports in one event (one drained batch), as a worker's flush sends them
    client.handler((time.time(), {"reports": [numbered("good", s, 1.0 / (s + 1), answer=False) for s in range(4)]}))
    feed(metrics, client, ("run-good", "COMPLETED"))
    client.handler((time.time(), {"reports": [numbered("poor", 0, 5.0, answer=False), numbered("poor", 1, 4.9, True),
                                              numbered("poor", 2, 4.8, True), numbered("poor", 3, 4.7, True)]}))
    assert set(client.plugins) == {"hpc-garage-pruner-answers"}
    metrics.close()
    assert client.plugins == {}  # the workers may serve a flow without a pruner next
    sent = [(f.__name__, args) for f, args, _ in client.runs]
    # answered: reports that wait, and the pruning one (one answer per trial and drained batch: its last);
    # a report of the pruned trial that waits gets "pruned" again
    assert sent == [("decided", ("run-poor", 4, True, 4))], sent  # (a median pruner decides at every step)
    assert all(kw["workers"] == ["tcp://w1"] for _, _, kw in client.runs)
    assert client.runs[-1][0] is stopping.decided


def numbered(trial: str, step: int, loss: float, since: float | None = 0.2) -> dict[str, Any]:
    """A report the trial waits on (its step took `since` s), as trial.report sends it with a pruner."""
    return msg(trial, step, loss=loss) | {"number": step, "answer": True, "since": since}


def decisions(client: FakeClient) -> dict[str, bool]:
    """The run ids answered so far -> whether each was pruned."""
    return {args[0]: args[2] for _, args, _ in client.runs}


def answered(client: FakeClient, n: int) -> None:
    """Until the drain thread sent `n` answers (it decides held reports on its own clock)."""
    poll(lambda: len(client.runs) >= n, 10, f"fewer than {n} answers after 10 s: {client.runs}", every=0.005)


def test_trials_reaching_an_asha_rung_together_are_decided_together_the_best_first(tmp_path: Path) -> None:
    """Successive halving promotes any trial that is the best so far among fewer than its reduction factor (4):
    trials started together would all pass in the order they happen to arrive. Reports at such a rung wait for
    their rivals (here the 4th arrival completes the rung) and are decided the best first: one trial goes on."""
    metrics, client = TrialMetrics("asha", "loss", "min", RunDir(tmp_path)), FakeClient()
    metrics.start(client)
    for trial, loss in (("w", 2.4), ("x", 2.0), ("y", 2.2), ("best", 1.8)):  # worst first, best last
        client.handler((time.time(), {"reports": [numbered(trial, 1, loss)]}))
    answered(client, 4)
    assert decisions(client) == {"run-w": True, "run-x": True, "run-y": True, "run-best": False}, client.runs
    assert {args[3] for _, args, _ in client.runs} == {4}  # the next rung: where the survivor waits again
    # the rung has its 4: a later arrival is decided at once (not held), in the best quarter or pruned
    client.handler((time.time(), {"reports": [numbered("late", 1, 1.7)]}))
    answered(client, 5)
    assert decisions(client)["run-late"] is False
    metrics.close()
    assert json.loads(RunDir(tmp_path).metrics_summary.read_text())["pruned"] == 3


def test_without_rivals_a_held_report_is_decided_after_one_of_its_steps(tmp_path: Path) -> None:
    """A lone trial at a rung waits at most one of its own steps ("since"), HOLD_MAX at most; its end, or the
    flow's, decides what is held at once."""
    from hpc_garage.prefect.metrics import HOLD_MAX

    metrics, client = TrialMetrics("asha", "loss", "min", RunDir(tmp_path)), FakeClient()
    metrics.start(client)
    sent = time.monotonic()
    client.handler((time.time(), {"reports": [numbered("alone", 1, 2.0, since=0.15)]}))
    answered(client, 1)
    waited = time.monotonic() - sent
    assert decisions(client) == {"run-alone": False} and 0.1 <= waited < 0.15 + 1.0, waited
    client.runs.clear()
    sent = time.monotonic()
    client.handler((time.time(), {"reports": [numbered("alone", 4, 1.0, since=None)]}))  # no step known: HOLD_MAX
    answered(client, 1)
    waited = time.monotonic() - sent
    assert decisions(client) == {"run-alone": False} and HOLD_MAX - 0.05 <= waited < HOLD_MAX + 1.0, waited
    client.runs.clear()
    client.handler((time.time(), {"reports": [numbered("ends", 1, 0.5, since=30.0)]}))  # held: 1 of 4 at rung 1
    metrics.ended("run-ends", Done("COMPLETED"))
    metrics.close()  # (at once: no wait for the hold)
    assert decisions(client) == {"run-ends": False}  # decided (promoted: the best so far) before its end
    summary = json.loads(RunDir(tmp_path).metrics_summary.read_text())
    assert summary["trials"]["ends"]["state"] == "done"


def test_a_held_report_waits_for_a_running_rival_its_pace_brings_to_the_rung(tmp_path: Path) -> None:
    """A trial first at a rung waits (beyond its own short step) for a rival whose pace brings it there soon,
    and the better of the two goes on: not the one that happened to arrive first."""
    metrics, client = TrialMetrics("asha", "loss", "min", RunDir(tmp_path)), FakeClient()
    metrics.start(client)

    def send(trial: str, step: int, loss: float, since: float) -> None:
        client.handler((time.time(), {"reports": [numbered(trial, step, loss, since)]}))

    for poor in "pqrs":  # rung 1 gets its 4: what follows there is decided at once
        send(poor, 1, 5.0, 0.1)
    send("lead", 1, 1.0, 0.1)
    send("lag", 1, 0.9, 0.1)
    for step in (2, 3):
        send("lead", step, 0.9 - step / 10, 0.1)
    send("lag", 2, 0.8, 0.1)  # 0.1 s a step: at step 4 in about 0.2 s
    send("lead", 4, 0.5, 0.01)  # first at rung 4; its own step (0.01 s) would not wait for "lag"
    time.sleep(0.1)
    send("lag", 3, 0.6, 0.1)
    time.sleep(0.1)
    send("lag", 4, 0.3, 0.1)
    poll(lambda: {"run-lag", "run-lead"} <= decisions(client).keys(), 10, f"not both decided: {client.runs}",
         every=0.005)
    metrics.close()
    answered = [(args[0], args[1], args[2]) for _, args, _ in client.runs if args[0] in ("run-lead", "run-lag")]
    assert ("run-lead", 4, True) in answered and ("run-lag", 4, False) in answered, answered


def test_at_the_first_rung_a_report_waits_for_tasks_in_flight_that_have_not_reported(tmp_path: Path) -> None:
    """Trials started together do not start at the same instant: the first at the first rung waits (up to
    HOLD_MAX, not only its own step) while submitted tasks have not reported yet, and the best goes on."""
    metrics, client = TrialMetrics("asha", "loss", "min", RunDir(tmp_path)), FakeClient()
    metrics.start(client)
    for run in ("run-early", "run-late"):
        metrics.submitted(run)
    client.handler((time.time(), {"reports": [numbered("early", 1, 2.4, since=0.05)]}))
    time.sleep(0.3)  # six of its steps later
    client.handler((time.time(), {"reports": [numbered("late", 1, 1.8, since=0.05)]}))
    poll(lambda: len(decisions(client)) >= 2, 10, f"not both decided: {client.runs}", every=0.005)
    metrics.close()
    assert decisions(client) == {"run-early": True, "run-late": False}


def test_a_pruner_answer_wakes_the_waiting_report_and_stops_a_pruned_trial() -> None:
    import threading

    from hpc_garage.cluster import stopping

    stopping.reset()
    try:
        assert not stopping.answers() and stopping.wait_answer("r1", 1, 0.05) is False
        stopping.answering(True)
        assert stopping.answers()
        threading.Timer(0.1, stopping.decided, ("r1", 2, True)).start()
        assert stopping.wait_answer("r1", 2, 5.0) is True  # woken by the answer, not the timeout
        assert stopping.reason("r1") == "pruned" and stopping.reason("r2") is None
        stopping.decided("r1", 1, False)  # a late answer to an earlier report moves nothing back
        assert stopping.wait_answer("r1", 2, 0.0) is True
        # an answer names the step its trial's reports wait at again (successive halving's next rung)
        assert stopping.waits_at("r2", 0) and stopping.waits_at("r2", 7)  # nothing answered yet: every report
        stopping.decided("r2", 1, False, 4)
        assert [stopping.waits_at("r2", s) for s in (2, 3, 4, 5)] == [False, False, True, True]
        stopping.decided("r2", 2, False)  # (no step named: the next report waits)
        assert stopping.waits_at("r2", 2)
    finally:
        stopping.reset()


def test_the_pruner_decides_and_the_pruned_trial_is_told_on_its_worker(tmp_path: Path) -> None:
    from hpc_garage.cluster import stopping

    pruner = optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1)
    metrics, client = TrialMetrics(pruner, "loss", "min", RunDir(tmp_path)), FakeClient()
    metrics.start(client)
    feed(metrics, client, *[msg("good", s, loss=1.0 / (s + 1)) for s in range(4)], ("run-good", "COMPLETED"))
    feed(metrics, client, *[msg("poor", s, loss=5.0 + 1.0 / (s + 1)) for s in range(4)], ("run-poor", "COMPLETED"))
    metrics.close()
    assert client.runs == [(stopping.stop, ("pruned",), {"trial": "run-poor", "workers": ["tcp://w1"],
                                                         "on_error": "ignore"})]
    summary = json.loads(RunDir(tmp_path).metrics_summary.read_text())
    assert summary["trials"]["poor"]["state"] == "pruned"  # kept after its task returned
    assert summary["trials"]["poor"]["reports"] == 4  # reports after the prune are stored, not decided
    assert (summary["pruner"], summary["pruned"], summary["best"]["trial"]) == ("MedianPruner", 1, "good")


def test_a_trial_the_epochs_study_has_as_pruned_is_stopped_at_its_first_report(tmp_path: Path) -> None:
    from hpc_garage.pruning import TrialPruner, journal_path

    journal = journal_path({RESULTS_ENV: str(tmp_path / "results")})
    earlier = TrialPruner(optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0), "min", journal)
    earlier.decide("good", 0, 0.1)
    earlier.finished("good", 0.1)
    assert earlier.decide("poor", 0, 9.0)
    metrics, client = TrialMetrics("median", "loss", "min", RunDir(tmp_path / "run"), journal), FakeClient()
    (tmp_path / "run").mkdir()
    metrics.start(client)
    feed(metrics, client, msg("poor", 0, loss=9.0))
    metrics.close()
    assert [c[2]["trial"] for c in client.runs] == ["run-poor"]
    assert json.loads(RunDir(tmp_path / "run").metrics_summary.read_text())["trials"]["poor"]["state"] == "pruned"


def test_a_plain_flow_keeps_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    assert TrialMetrics.for_runner(None, "loss", "min") is None  # nothing to write, nothing to decide
    monkeypatch.setenv(RUN_DIR_ENV, "/nonexistent")
    assert TrialMetrics.for_runner(None, None, "min") is not None


def test_the_runner_refuses_a_bad_setting_when_the_flow_is_decorated_and_keeps_good_ones() -> None:
    from hpc_garage.core.errors import UserError
    from hpc_garage.prefect.task_runner import HpcTaskRunner, task_runner

    with pytest.raises(UserError, match=r"^task_runner\(pruner='asha'\) needs metric=\.\.\."):
        task_runner(pruner="asha")  # before any Prefect API or cluster is started
    with pytest.raises(UserError, match=r"^task_runner\(mode='best'\)"):
        HpcTaskRunner(address="tcp://127.0.0.1:1", metric="loss", mode="best")
    runner = HpcTaskRunner(address="tcp://127.0.0.1:1", pruner="hyperband", metric="acc", mode="max")
    copy = runner.duplicate()  # what Prefect enters for each flow run
    assert (copy.pruner, copy.metric, copy.mode, copy.address) == ("hyperband", "acc", "max", "tcp://127.0.0.1:1")


# ------------------------------------------------------------------------------- a real flow, real Dask


STEPS, STEP_SECONDS, WARMUP = 12, 0.1, 3
FLOORS = {0: 0.1, 1: 0.2, 2: 0.3, 3: 0.05, 4: 2.0, 5: 3.0, 6: 2.5, 7: 0.15}  # 4, 5, 6: poor curves


@pytest.mark.slow
def test_a_median_pruner_stops_the_poor_trials_which_return(api: dict[str, str], cluster: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import cloudpickle
    from prefect import flow, task
    from prefect.futures import wait

    import hpc_garage
    from hpc_garage import trial

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # worker processes cannot import this file
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.setenv(RESULTS_ENV, str(tmp_path / "results"))
    (tmp_path / "run").mkdir()

    @task
    def train(i: int) -> dict[str, Any]:
        loss, step = 0.0, 0
        for step in range(STEPS):
            loss = FLOORS[i] + 1.0 / (step + 1)
            trial.report(step, loss=loss, lr=0.1 * i)
            if trial.should_stop():
                break
            time.sleep(STEP_SECONDS)
        return {"i": i, "loss": loss, "step": step, "reason": trial.stop_reason()}

    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=WARMUP)

    @flow(task_runner=hpc_garage.task_runner(address=cluster.scheduler_address, pruner=pruner, metric="loss"))
    def sweep() -> list[dict[str, Any]]:
        first = [train.submit(i) for i in (0, 1, 2)]  # three good curves finish first: the pruner's reference
        wait(first)
        rest = [train.submit(i) for i in (3, 4, 5, 6, 7)]
        return [f.result() for f in first + rest]

    results = {r["i"]: r for r in sweep()}
    pruned = {i for i, r in results.items() if r["reason"] == "pruned"}
    assert pruned == {4, 5, 6}, results
    assert all(results[i]["step"] < STEPS - 1 for i in pruned)  # they saw should_stop() and returned early
    assert all(results[i]["step"] == STEPS - 1 and results[i]["reason"] is None for i in (0, 1, 2, 3, 7))

    run_dir = RunDir(tmp_path / "run")
    summary = json.loads(run_dir.metrics_summary.read_text())
    by_lr = {round(r["last"]["lr"] / 0.1): (tid, r) for tid, r in summary["trials"].items()}
    assert sorted(by_lr) == list(range(8))
    assert {i for i, (_, r) in by_lr.items() if r["state"] == "pruned"} == {4, 5, 6}
    assert all(r["state"] == "done" and r["ended"] for i, (_, r) in by_lr.items() if i not in (4, 5, 6))
    assert (summary["pruned"], summary["reporting"], summary["pruner"]) == (3, 0, "MedianPruner")
    best_id, best = by_lr[3]
    assert summary["best"] == {"trial": best_id, "value": FLOORS[3] + 1.0 / STEPS, "step": STEPS - 1}
    assert best["reports"] == STEPS and best["task"] == "train"
    for i, (tid, record) in by_lr.items():
        lines = run_dir.trial_metrics(tid).read_text().splitlines()
        assert len(lines) == record["reports"] == results[i]["step"] + 1
    assert (tmp_path / "results" / ".pruner.journal").exists()
