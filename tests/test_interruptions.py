"""The chain cap's progress (cluster/interruptions.py): the step a trial states, not its checkpoint file's time."""

from __future__ import annotations

import json
from pathlib import Path

from hpc_garage.cluster import stopping
from hpc_garage.cluster.interruptions import Unfinished, follow_up_needed, interruption
from hpc_garage.cluster.wind_down import EX_TEMPFAIL, WindDown
from tests.test_trial import _fresh, site  # noqa: F401 - the same fresh stop state (autouse) and site


def test_a_new_step_is_progress_a_fresh_file_with_the_same_step_is_not() -> None:
    record = None
    for job, (written, step) in enumerate([(110.0, 40), (210.0, 80)]):  # checkpoints and a step past the last
        record = interruption(record, Unfinished("k", "train", job * 100.0, written, step=step), str(job),
                              written + 5, max_continuations=2)
        assert record["interruptions"][-1]["progress"] and record["step"] == step and record["without_progress"] == 0
    for job in range(2, 5):  # re-saves step 80 in every job: a newer file each time, never a step past it
        written = job * 100.0 + 10
        record = interruption(record, Unfinished("k", "train", job * 100.0, written, step=80), str(job),
                              written + 5, max_continuations=2)
        assert not record["interruptions"][-1]["progress"] and record["interruptions"][-1]["step"] == 80
        assert record["interruptions"][-1]["lost"] == 15.0  # since its start: that job's work is not kept
    assert record["gave_up"] == "no step past 80 in 3 jobs in a row" and not follow_up_needed([record], 0)
    back = interruption(record, Unfinished("k", "train", 600.0, 610.0, step=81), "5", 615.0, max_continuations=2)
    assert back["interruptions"][-1]["progress"] and "gave_up" not in back and back["without_progress"] == 0


def test_a_step_without_a_checkpoint_is_no_progress() -> None:
    record = interruption(None, Unfinished("k", "train", 0.0, None, step=50), "1", 30.0, max_continuations=0)
    assert not record["interruptions"][-1]["progress"] and record["gave_up"] == "longer than the walltime and never checkpoints"


def test_the_workers_keep_each_trials_latest_step() -> None:
    stopping.note_trial("r1", "KEY1", "train")
    for step in (3, 7, 5):  # a step reported again (continued from a checkpoint) does not lower it
        stopping.note_step("r1", step)
    stopping.note_step("unknown", 9)  # not a trial of the sweep: nothing kept
    assert stopping.known_trials(["r1", "unknown"]) == {"r1": {"key": "KEY1", "task": "train", "asked": False,
                                                                "started": stopping.trial("r1")["started"], "step": 7}}
    assert stopping.stop_trials("signal SIGTERM", ["r1"])["r1"]["step"] == 7


def test_a_trial_that_re_saves_the_same_step_each_job_ends_the_chain_named(tmp_path: Path) -> None:
    """trial.py's own example saves on every should_stop(): with a restart that costs about a job, each job
    writes a new checkpoint file at the same step. The chain ends after max_continuations, naming the trial."""
    submitted: list[str] = []
    said: list[str] = []
    jobs = 0
    while jobs < 10:
        jobs += 1
        ending = WindDown(site(requeue="auto"), str(jobs), None, lambda: submitted.append("n") or str(len(submitted)),
                          lambda other: None, results=tmp_path)
        ending.bind(said.append, lambda **kw: None)
        ending.stopped = True
        ending._decide([Unfinished("k1", "train", started=jobs * 100.0, checkpoint=jobs * 100.0 + 50, step=40)])
        if ending.next_job is None:
            break
    assert jobs == 4 and len(submitted) == 3  # job 1 got to step 40 (progress), then 2 follow-ups without any
    assert ending.exit_code(143) == EX_TEMPFAIL
    assert any("trial train (k1) is not continued: no step past 40 in 3 jobs in a row" in line for line in said), said
    record = json.loads((tmp_path / stopping.TRIALS_DIR / "k1.json").read_text())
    assert record["gave_up"] == "no step past 40 in 3 jobs in a row" and record["step"] == 40


def test_the_batch_systems_sigterm_stops_a_workers_trials_and_the_second_ends_it(tmp_path: Path) -> None:
    """A worker process (its forkserver preloads prefect/worker.py, which holds SIGTERM there): the first
    SIGTERM tells its trials to stop and it lives on; the second ends it as SIGTERM does."""
    import os
    import signal
    import subprocess
    import sys

    from hpc_garage.variables import WORKER_PRELOAD

    script = ("import os, signal, time\nfrom hpc_garage.cluster import stopping\nstopping.hold_term()\n"
              "print('ready', flush=True)\nwhile not stopping.any_stop(): time.sleep(0.01)\n"
              "print(stopping.reason(None), flush=True)\ntime.sleep(30)\n")
    env = {**os.environ, WORKER_PRELOAD: "distributed"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == stopping.TERM_REASON and proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM
    plain = subprocess.run([sys.executable, "-c", "from hpc_garage.cluster import stopping; stopping.hold_term(); "
                            "import signal; print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"], capture_output=True,
                           text=True, env={k: v for k, v in os.environ.items() if k != WORKER_PRELOAD})
    assert plain.stdout.strip() == "True"  # not a worker: nothing held


def test_a_sigterm_notice_records_the_trials_and_submits_no_follow_up(tmp_path: Path) -> None:
    """Preemption: the batch system requeues the job (or `resume` continues it): no follow-up job beside it.
    A notice from another job (a jobqueue worker job's SIGTERM) is not this job's."""
    said: list[str] = []
    submitted: list[str] = []
    ending = WindDown(site(requeue="auto"), "42", None, lambda: submitted.append("n") or "43", lambda other: None,
                      results=tmp_path)
    ending.bind(said.append, lambda **kw: None)
    ending._notice({"job": "41"})
    assert not ending.noticed
    ending._notice({"job": "42", "at": 1.0})
    assert ending.noticed and ending._warning == stopping.TERM_REASON
    ending.stopped = True
    ending._decide([Unfinished("k1", "train", started=0.0, checkpoint=10.0, step=10)])
    assert not submitted and ending.next_job is None and ending.exit_code(143) == EX_TEMPFAIL
    assert any("no follow-up job: the batch system is ending this job (SIGTERM)" in line for line in said), said
    assert json.loads((tmp_path / stopping.TRIALS_DIR / "k1.json").read_text())["step"] == 10
