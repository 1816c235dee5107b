"""The per-trial API (hpc_garage/trial.py, cluster/stopping.py) and the wind-down's pure decisions about
interrupted trials (cluster/wind_down.py), without a cluster: outside hpc-garage, a stop per trial, the
checkpoint key, the grace timing, when the job chain stops."""

from __future__ import annotations

import functools
import json
import uuid
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpc_garage import trial
from hpc_garage.cluster import stopping
from hpc_garage.cluster.wind_down import (EX_CANCELLED, EX_TEMPFAIL, NEVER_CHECKPOINTS, Unfinished, WindDown,
                                          follow_up_needed, interruption, lead_for)
from hpc_garage.core.site import Site
from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    stopping.reset()
    yield
    stopping.reset()


def site(**extra: Any) -> Site:
    return Site.model_validate({"name": "t", "scheduler": "slurm", "node": {"cores": 4, "memory": "8GiB"}, **extra})


def test_outside_hpc_garage_nothing_stops_and_the_directory_is_local(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(SWEEP_ENV, raising=False)
    assert trial.should_stop() is False and trial.stop_reason() is None
    path = trial.checkpoint_dir()
    assert path == tmp_path / trial.LOCAL_DIR / "default" and path.is_dir()
    assert issubclass(trial.Interrupted, BaseException) and not issubclass(trial.Interrupted, Exception)


def test_a_stop_reaches_every_trial_or_one_and_callbacks_run_once() -> None:
    heard: list[str] = []
    trial.on_stop(heard.append)
    stopping.stop("pruned", trial="aa")  # one trial only (the reason a pruner will give)
    assert stopping.reason("aa") == "pruned" and stopping.reason("bb") is None and heard == ["pruned"]
    stopping.stop("walltime: 30 s left")
    stopping.stop("walltime: 30 s left")  # told twice: heard once
    assert stopping.reason("bb") == "walltime: 30 s left" and stopping.reason("aa") == "pruned"
    assert heard == ["pruned", "walltime: 30 s left"]
    assert trial.should_stop() is True  # outside a task run: the job-wide reason
    late: list[str] = []
    trial.on_stop(late.append)
    assert late == ["walltime: 30 s left"]


def test_the_workers_answer_what_they_know_of_the_running_trials() -> None:
    stopping.note_trial("r1", "KEY1", "train")
    answer = stopping.stop_trials("signal SIGUSR1", ["r1", "r2"])
    assert set(answer) == {"r1"} and answer["r1"]["key"] == "KEY1" and stopping.any_stop()
    for n in range(stopping.KEEP + 10):  # bounded
        stopping.note_trial(f"x{n}", "K", "t")
    assert stopping.trial("r1") is None and stopping.trial(f"x{stopping.KEEP + 9}") is not None


def _ctx(fn: Any, params: dict[str, Any]) -> Any:
    from prefect import task

    return SimpleNamespace(task=task(fn), task_run=SimpleNamespace(id=uuid.uuid4()), parameters=params)


def _one(x: int) -> int:
    return x


def _other(x: int) -> int:
    return x + 1


def test_the_checkpoint_key_is_the_result_key_source_inputs_and_epoch() -> None:
    from hpc_garage.prefect.sweep_cache import sweep_policy, trial_key

    key = trial_key(_ctx(_one, {"x": 1}), "s@1")
    assert key == trial_key(_ctx(_one, {"x": 1}), "s@1")  # every attempt of the trial
    ctx = _ctx(_one, {"x": 1})
    assert key == sweep_policy("s@1").compute_key(task_ctx=ctx, inputs={"x": 1}, flow_parameters={})  # = result's
    assert key != trial_key(_ctx(_one, {"x": 2}), "s@1")  # inputs changed
    assert key != trial_key(_ctx(_other, {"x": 1}), "s@1")  # source changed
    assert key != trial_key(_ctx(_one, {"x": 1}), "s@2")  # a fresh submit: a new epoch
    noted = _ctx(_one, {"x": 1})
    stopping.note_trial(noted.task_run.id.hex, "NOTED", "one")  # computed once, as Prefect computed it
    assert trial_key(noted, "s@1") == "NOTED"


@pytest.mark.parametrize(("margin", "grace", "limit", "lead"), [
    (600, 60, 86400, 600),  # a day's job: the margin leaves room enough
    (600, 900, 86400, 1200),  # a slow checkpoint: told 15 min before the kill at margin / 2
    (30, 60, 60, 30),  # a 1-min job: never more than half of it
    (15, 10, 60, 17.5),  # the tests' site
])
def test_trials_are_told_their_grace_before_they_would_be_killed(margin: float, grace: float, limit: float,
                                                                 lead: float) -> None:
    assert lead_for(margin, grace, limit) == lead


def test_a_trial_without_progress_is_continued_at_most_n_times() -> None:
    never = Unfinished("k", "train", started=100.0, checkpoint=None)
    record = None
    for job in range(3):
        record = interruption(record, never, str(job), 130.0, max_continuations=2)
        assert record["interruptions"][-1] == {"job": str(job), "at": 130.0, "progress": False, "lost": 30.0}
        assert ("gave_up" in record) == (job == 2)
        assert follow_up_needed([record], 0) == (job < 2)  # 2 follow-ups, then the chain ends
    assert record["gave_up"] == NEVER_CHECKPOINTS and follow_up_needed([record], new_results=1)  # others go on
    saved = Unfinished("k", "train", started=100.0, checkpoint=125.0, ended=125.5)  # it stopped: 0.5 s lost
    assert interruption(record, saved, "3", 130.0, max_continuations=2)["interruptions"][-1]["lost"] == 0.5
    saved = Unfinished("k", "train", started=100.0, checkpoint=125.0)  # progress: counted afresh, 5 s lost
    record = interruption(record, saved, "3", 130.0, max_continuations=2)
    assert record["without_progress"] == 0 and "gave_up" not in record and record["interruptions"][-1]["lost"] == 5
    stale = Unfinished("k", "train", started=200.0, checkpoint=125.0)  # only the old checkpoint, read back
    for job in range(3):
        record = interruption(record, stale, str(4 + job), 230.0, max_continuations=2)
    assert record["gave_up"] == "no new checkpoint in 3 jobs in a row" and record["interruptions"][-1]["lost"] == 30


def test_the_job_chain_ends_with_the_trial_named_and_exit_code_75(tmp_path: Path) -> None:
    """What today's code did (a follow-up whenever a trial ran in the job) and what it does now, job by job,
    for a trial that never checkpoints."""
    submitted: list[str] = []
    jobs = 0
    while jobs < 10:
        jobs += 1
        said: list[str] = []
        ending = WindDown(site(requeue="auto"), str(jobs), None, lambda: submitted.append("n") or str(len(submitted)),
                          lambda other: None, results=tmp_path)
        ending.bind(said.append, lambda **kw: None)
        ending.stopped = True
        ending._decide([Unfinished("k1", "train", started=0.0, checkpoint=None)])
        if ending.next_job is None:
            break
    assert jobs == 3 and len(submitted) == 2  # max_continuations: 2
    assert ending.exit_code(143) == EX_TEMPFAIL
    assert any(f"trial train (k1) is not continued: {NEVER_CHECKPOINTS}" in line for line in said), said
    record = json.loads((tmp_path / stopping.TRIALS_DIR / "k1.json").read_text())
    assert len(record["interruptions"]) == 3 and record["gave_up"] == NEVER_CHECKPOINTS


def test_a_cancel_records_the_interrupted_trials_submits_no_follow_up_and_ends_as_cancelled(tmp_path: Path) -> None:
    """`hpc-garage cancel` marked the job (RunDir.request_cancel): on `requeue: auto` the same wind-down
    without the mark submits a follow-up job; with it, none, and `run` exits as a cancelled job does."""
    said: list[str] = []
    noted: dict[str, Any] = {}
    for cancelled in (False, True):
        submitted: list[str] = []
        ending = WindDown(site(requeue="auto"), "42", None, functools.partial(_submit, submitted),
                          lambda other: None, results=tmp_path, cancel_requested=(lambda c=cancelled: c))
        ending.bind(said.append, noted.update)
        ending.stopped = True
        ending._decide([Unfinished("k1", "train", started=0.0, checkpoint=5.0)])
        assert bool(submitted) is not cancelled and (ending.next_job is None) is cancelled
        assert ending.exit_code(143) == (EX_CANCELLED if cancelled else 0)
    assert noted["cancelled"] and ("no follow-up job: the job is being cancelled; `hpc-garage resume 42` continues "
                                   "the sweep from the trials' checkpoints") in said, said
    record = json.loads((tmp_path / stopping.TRIALS_DIR / "k1.json").read_text())
    assert len(record["interruptions"]) == 2  # recorded as interrupted all the same: `resume` continues it
    ending.stopped = False  # the flow ended itself (a trial raised Interrupted) before COMMAND was stopped
    ending.winding = True
    assert ending.exit_code(1) == EX_CANCELLED and ending.exit_code(0) == 0  # (or it finished the sweep)


def _submit(submitted: list[str]) -> str:
    submitted.append("n")
    return "43"


def test_a_command_ended_by_an_interrupted_trial_keeps_the_follow_up_job() -> None:
    cancelled: list[str] = []
    ending = WindDown(site(requeue="auto"), "42", None, None, cancelled.append)
    ending.bind(lambda line: None, lambda **kw: None)
    ending.winding, ending.next_job = True, "43"
    assert ending.exit_code(1) == 0 and not cancelled  # the flow ended because a trial raised Interrupted
    assert ending.exit_code(0) == 0 and cancelled == ["43"]  # it finished the sweep after all


def test_a_follow_up_job_starts_the_interrupted_trials_first(tmp_path: Path) -> None:
    from prefect import task

    from hpc_garage.prefect.sweep_cache import SweepTasks, trial_key

    fresh = SweepTasks({SWEEP_ENV: "s@1", RESULTS_ENV: str(tmp_path)})
    one = task(_one)
    assert not fresh.interrupted_first(one, {"x": 1})  # no record in the epoch: nothing computed
    key = trial_key(_ctx(_one, {"x": 1}), "s@1")
    (tmp_path / stopping.TRIALS_DIR).mkdir()
    (tmp_path / stopping.TRIALS_DIR / f"{key}.json").write_text(json.dumps({"trial": key, "interruptions": [{}]}))
    tasks = SweepTasks({SWEEP_ENV: "s@1", RESULTS_ENV: str(tmp_path)})
    assert tasks.interrupted_first(one, {"x": 1}) and not tasks.interrupted_first(one, {"x": 2})
    (tmp_path / key).write_text("{}")  # it finished since: nothing to put first
    assert not SweepTasks({SWEEP_ENV: "s@1", RESULTS_ENV: str(tmp_path)}).interrupted_first(
        one, {"x": 1})


# ------------------------------------------------------------------------------------ trial.report()


@pytest.mark.parametrize(("call", "said"), [
    (lambda: trial.report(-1, loss=1.0), r"^trial\.report\(step=-1\): step must be an int >= 0"),
    (lambda: trial.report(1.5, loss=1.0), r"^trial\.report\(step=1\.5\): step must be an int >= 0"),
    (lambda: trial.report(True, loss=1.0), r"^trial\.report\(step=True\): step must be an int >= 0"),
    (lambda: trial.report(3), r"^trial\.report\(3\) reports no value; name each one"),
    (lambda: trial.report(3, loss=float("nan")), r"^trial\.report\(3, loss=nan\): loss must be a finite real number$"),
    (lambda: trial.report(3, loss=float("inf")), r"^trial\.report\(3, loss=inf\): loss must be a finite real number$"),
    (lambda: trial.report(3, loss="0.5"), r"^trial\.report\(3, loss='0\.5'\): loss must be a finite real number$"),
    (lambda: trial.report(3, acc=0.5, loss=[1.0]), r"^trial\.report\(3, loss=\[1\.0\]\): loss must be a finite"),
])
def test_a_bad_report_is_a_value_error_naming_it(call: Any, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        call()


def test_outside_a_worker_a_report_checks_and_does_nothing_more() -> None:
    import subprocess
    import sys

    code = ("import sys, time; from hpc_garage import trial; import numpy\n"
            "trial.report(0, loss=numpy.float32(0.5), n=3)\n"
            "t = time.perf_counter()\n"
            "for i in range(10000): trial.report(i, loss=0.5)\n"
            "print((time.perf_counter() - t) / 10000 * 1e6, 'distributed' in sys.modules, 'prefect' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    cost, distributed, prefect = done.stdout.split()
    assert (distributed, prefect) == ("False", "False"), done.stderr  # nothing heavy imported for it
    assert float(cost) < 50  # µs per call: a few in fact


_CURRENT: dict[str, Any] = {}  # the task run the worker's thread "runs" (Prefect's context, faked)


def _trial_body(run_id: uuid.UUID) -> None:
    """Three reports inside a (faked) Prefect task run, one outside any."""
    _CURRENT["ctx"] = SimpleNamespace(task_run=SimpleNamespace(id=run_id), task=SimpleNamespace(name="train"))
    for step in range(3):
        trial.report(step, loss=1.0 / (step + 1))
    _CURRENT.pop("ctx")
    trial.report(9, loss=0.0)  # a plain Dask task: no trial, nothing sent


@pytest.mark.slow
def test_a_report_in_a_worker_reaches_a_subscribed_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The channel itself: the worker logs an event, the scheduler forwards it to the subscribed client; the
    trial is named by its sweep-cache key where the worker knows it, else by its task run id."""
    import queue

    from distributed import Client, LocalCluster
    from prefect.context import TaskRunContext

    keyed, plain = uuid.uuid4(), uuid.uuid4()
    stopping.note_trial(keyed.hex, "KEY-1", "train")
    monkeypatch.setattr(TaskRunContext, "get", classmethod(lambda cls: _CURRENT.get("ctx")))

    got: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.subscribe_topic(trial.REPORT_TOPIC, lambda event: [got.put(m) for m in event[1]["reports"]])
        client.submit(_trial_body, keyed, pure=False).result()
        client.submit(_trial_body, plain, pure=False).result()
        worker = next(iter(cluster.workers.values())).address
        msgs = [got.get(timeout=10) for _ in range(6)]
        time.sleep(0.5)
        assert got.empty()
    assert [(m["trial"], m["run"], m["task"], m["step"], m["values"], m["worker"]) for m in msgs[:3]] == [
        ("KEY-1", keyed.hex, "train", s, {"loss": 1.0 / (s + 1)}, worker) for s in range(3)]
    assert [m["trial"] for m in msgs[3:]] == [plain.hex] * 3 and all(abs(m["time"] - time.time()) < 60 for m in msgs)
