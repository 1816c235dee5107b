"""The job's clock and the wind-down's decisions (cluster/wind_down.py, schedulers' time_left and follow-up
submission), without a batch system: what SLURM and PBS say of the time left, the margin, the exit code; the wind-down
on an in-process Dask cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hpc_garage.cluster.wind_down import EX_TEMPFAIL, WindDown, margin_for
from hpc_garage.core.site import Site
from hpc_garage.schedulers.pbs import Pbs
from hpc_garage.schedulers.slurm import Slurm

QSTAT = Path(__file__).parent / "data" / "qstat-f.txt"


def site(**extra: Any) -> Site:
    return Site.model_validate({"name": "t", "scheduler": "slurm", "node": {"cores": 4, "memory": "8GiB"}, **extra})


@pytest.mark.parametrize(("squeue", "expected"), [
    ("1:30|2:00\n", (90.0, 120.0)),
    ("1-00:00:05|2-00:00:00\n", (86405.0, 172800.0)),
    ("0:00|1:00\n", (0.0, 60.0)),
    ("UNLIMITED|UNLIMITED\n", None),
    ("INVALID|NOT_SET\n", None),
    ("", None),
])
def test_slurm_time_left_from_squeue(squeue: str, expected: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[list[str]] = []
    monkeypatch.setattr(Slurm, "run_unless_gone", lambda self, argv, gone: asked.append(list(argv)) or squeue)
    assert Slurm().time_left("42") == expected
    assert asked == [["squeue", "-h", "-j", "42", "-o", "%L|%l"]]


def test_pbs_time_left_is_the_limit_less_the_walltime_used() -> None:
    text = QSTAT.read_text()
    assert Pbs().time_left("13", qstat_f=lambda _: text) == (600.0, 600.0)  # walltime 00:10:00, none used yet
    used = text + "\tresources_used.walltime = 00:04:10\n"
    assert Pbs().time_left("13", qstat_f=lambda _: used) == (350.0, 600.0)
    assert Pbs().time_left("13", qstat_f=lambda _: "") is None  # qstat could not say


def test_follow_up_jobs_start_after_the_job_however_it_ended(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    assert Slurm().follow_up_argv(script, "42", "x.out") == ["sbatch", "--parsable", "--dependency=afterany:42",
                                                             str(script)]
    assert Slurm().follow_up_argv(script, None, "x.out") == ["sbatch", "--parsable", str(script)]
    assert Pbs().follow_up_argv(script, "7.srv", "/l/x.out") == ["qsub", "-W", "depend=afterany:7.srv", "-j", "oe",
                                                                 "-o", "/l/x.out", str(script)]


def test_restart_count_is_read_from_slurm() -> None:
    assert Slurm().restart_count({"SLURM_RESTART_COUNT": "2"}) == 2
    assert Slurm().restart_count({}) == 0 and Pbs().restart_count({"SLURM_RESTART_COUNT": "2"}) == 0


@pytest.mark.parametrize(("given", "limit", "margin"), [
    (None, 3600, 180),  # 5 % of the limit
    (None, 600, 30),  # at least 30 s ...
    (None, 86400 * 2, 600),  # ... at most 10 min
    ("2min", 3600, 120),  # the site's
    ("30min", 1800, 900),  # never more than half the limit
])
def test_margin(given: str | None, limit: int, margin: int) -> None:
    extra = {"walltime_margin": given} if given else {}
    assert margin_for(site(**extra), limit) == margin


def test_a_bare_margin_is_minutes_as_every_walltime_is() -> None:
    assert site(walltime_margin=20).walltime_margin == 1200 and site(walltime_margin="20s").walltime_margin == 20


def test_exit_codes_and_a_follow_up_job_that_is_no_longer_needed() -> None:
    cancelled: list[str] = []
    said: list[str] = []
    ending = WindDown(site(requeue="auto"), "42", None, None, cancelled.append)
    ending.bind(said.append, lambda **kw: None)
    assert ending.exit_code(3) == 3  # not stopped: COMMAND's own code
    ending.next_job = "43"  # the sweep finished during the wind-down: its follow-up is cancelled
    assert ending.exit_code(0) == 0 and cancelled == ["43"] and "follow-up job 43 cancelled" in said[-1]
    ending.stopped, ending.next_job = True, "44"
    assert ending.exit_code(143) == 0  # stopped and handed on
    ending.next_job = None
    assert ending.exit_code(143) == EX_TEMPFAIL  # stopped, nobody carries it on: resume it


def test_a_job_in_which_no_trial_finished_or_ran_ends_the_chain_and_notes_why(tmp_path: Path) -> None:
    """A job that wound down before any trial ran (its start-up took the walltime) submits no follow-up job, which
    would fare no better, and notes why: `status` and `--wait` end with the reason, not "to be continued"."""
    said: list[str] = []
    notes: dict[str, Any] = {}
    submitted: list[str] = []
    ending = WindDown(site(requeue="auto"), "42", None, lambda: submitted.append("43") or "43", lambda other: None,
                      tmp_path)
    ending.bind(said.append, lambda **kw: notes.update(kw))
    ending._decide([])
    ending.stopped = True  # as the wind-down stops COMMAND next
    assert submitted == [] and ending.next_job is None and ending.exit_code(143) == EX_TEMPFAIL
    assert notes["chain_ended"].startswith("no trial finished or ran in this job, so no follow-up job")
    assert "`hpc-garage resume 42`" in notes["chain_ended"] and said == [notes["chain_ended"]]
    (tmp_path / "result-1").write_text("{}")  # a job that stored a result hands on
    notes.clear()
    ending._decide([])
    assert submitted == ["43"] and "chain_ended" not in notes


@pytest.mark.parametrize("value", ["KILL@60", "USR1", "USR1@0", "USR1@-5", "usr1@60"])
def test_a_warning_signal_must_be_one_run_winds_down_on(value: str) -> None:
    with pytest.raises(ValueError, match="warning_signal"):
        site(warning_signal=value)


def test_the_job_script_asks_for_the_warning_signal_and_requeue(tmp_path: Path) -> None:
    from hpc_garage.core.request import Request
    from hpc_garage.schedulers.jobscript import job_spec, render

    spec, _ = job_spec(site(warning_signal="USR1@300", requeue="auto"), Request(), script="/w/s.py",
                       output="/w/%j.out", workdir="/w", python="/usr/bin/python3")
    text = render(spec)
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text


def _trial_that_lands_late(results: str, seconds: float) -> str:
    """A trial whose result lands `seconds` after the wind-down begins (as Prefect's persistence writes it)."""
    import time

    time.sleep(seconds)
    Path(results, "result-of-a-late-trial").write_text("{}")
    return "done"


def test_a_trial_running_unseen_by_heartbeats_is_waited_for_and_its_result_counts(tmp_path: Path) -> None:
    """Under load the workers' heartbeats come seconds late, so the scheduler's `WorkerState.executing` does not
    yet hold a trial that runs (here: no heartbeat after registration). The wind-down asks the workers, waits
    for the trial, counts its result as this job's, and hands the sweep on; judged by the heartbeats it found
    nothing running, decided before the result landed, logged "no trial finished or ran" and ended the chain."""
    import asyncio

    from distributed import Client, Scheduler, Worker

    results = tmp_path / "results"
    results.mkdir()

    class Command:
        returncode = None
        signals: list[int] = []

        def send_signal(self, sig: int) -> None:
            self.signals.append(sig)

    async def main() -> tuple[WindDown, list[str], Command]:
        said: list[str] = []
        ending = WindDown(site(requeue="auto"), "42", None, lambda: "43", lambda other: None, results)
        ending.bind(said.append, lambda **kw: None)
        async with Scheduler(port=0, dashboard_address=":0") as scheduler, \
                Worker(scheduler.address, nthreads=1, heartbeat_interval="1h") as worker, \
                Client(scheduler.address, asynchronous=True) as client:
            future = client.submit(_trial_that_lands_late, str(results), 4.0, pure=False)
            while not worker.state.executing:
                await asyncio.sleep(0.05)
            assert not any(ws.executing for ws in scheduler.workers.values())  # what the heartbeats told
            command = Command()
            await ending._wind_down(scheduler, command, "walltime", None, 30.0, asyncio.get_running_loop())
            assert await future == "done"
        return ending, said, command

    ending, said, command = asyncio.run(main())
    assert (results / "result-of-a-late-trial").is_file()
    assert ending.next_job == "43", said
    assert not any("no trial finished or ran" in line for line in said), said
    assert ending.stopped and command.signals  # COMMAND stopped once the trial was done
