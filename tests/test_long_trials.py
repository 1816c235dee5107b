"""Trials longer than a job (issue 24), on the real local SLURM: continued from their checkpoints across
walltime follow-ups, a warning signal, cancel + resume; the endless job chain stopped; no stale checkpoint;
the same script outside a job. The work each trial did is counted from what it writes
(tests/data/long_trials.py: `work-<i>-<pid>-<ns>`, one file per attempt)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import DATA, outside_job_env
from tests.slurm_jobs import job_logs, release_requeued, wait_gone
from tests.test_durable import hpcg, site_file, sweep_record

SWEEP = DATA / "long_trials.py"
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LONG_SITE = "requeue: auto\nwalltime_margin: 15s\ncheckpoint_grace: 10s\n"
LONGEST = 240  # s of work per trial in the walltime chain: more than two 2-minute jobs give it


def attempts(marks: Path) -> dict[int, list[dict]]:
    """Per trial, each attempt's record (seconds worked, the step it started from), oldest first: only trials
    with a complete record (the sweep renames each record into place whole), so no trial's list is empty."""
    found: dict[int, list[tuple[int, dict]]] = defaultdict(list)
    for p in marks.glob("work-*"):
        _, i, _pid, ns = p.name.split("-")
        found[int(i)].append((int(ns), json.loads(p.read_text())))
    return {i: [r for _, r in sorted(rs, key=lambda x: x[0])] for i, rs in found.items()}


def submit_long(tmp_path: Path, site: Path, duration: float, every: int, *extra: str,
                timeout: float = 120) -> subprocess.CompletedProcess:
    return hpcg(["submit", "--site", str(site), "--nodes", "1", "--gpus-per-node", "2", *extra, str(SWEEP),
                 "--trials", "2", "--duration", str(duration), "--every", str(every), "--marks",
                 str(tmp_path / "marks"), "--out", str(tmp_path / "out.json")], tmp_path, timeout=timeout)


@pytest.mark.timeout(1500)  # 3-4 jobs of 2 minutes
def test_trials_longer_than_the_walltime_are_continued_across_jobs(tmp_path: Path) -> None:
    """2 GPU trials of 240 s that checkpoint every 10 s, `--time 2`: the sweep completes unattended over
    several jobs, and each interruption loses at most 15 s of a trial's work. (2 minutes, not 1: under CI's
    load a job took 30 s to start its trials, and `--time 1` left them 10 s a job, 12 minutes in all.)"""
    done = submit_long(tmp_path, site_file(tmp_path, LONG_SITE), LONGEST, 10, "--time", "2", "--wait",
                       timeout=1400)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")
    assert json.loads((tmp_path / "out.json").read_text())["result"] == 1
    jobs = sweep_record(tmp_path)["epochs"]["1"]["jobs"]
    assert len(jobs) >= 3, jobs
    for i, runs in attempts(tmp_path / "marks").items():
        worked = sum(r["worked"] for r in runs)
        interruptions = len(runs) - 1
        print(f"trial {i}: {len(runs)} attempts, {worked:.0f} s of work, "
              f"{(worked - LONGEST) / max(interruptions, 1):.1f} s lost per interruption")
        assert interruptions >= 2 and worked <= LONGEST + 15 * interruptions, runs
        assert all(r["from"] > 0 for r in runs[1:]), runs  # every later attempt resumed from a checkpoint
    assert re.search(r"trials interrupted: work lost since their last checkpoint", done.stdout + done.stderr) or \
        any("trials interrupted" in p.read_text() for p in (tmp_path / "runs").glob("*.out"))


def test_trials_that_never_checkpoint_end_the_chain_with_the_reason(tmp_path: Path) -> None:
    """The same sweep without checkpoints, `max_continuations: 1`: at most 2 jobs, then the chain stops with
    the one-line reason and exit code 75 (today's code chained on: 7 jobs in 7 minutes, still going).
    `--time 2`: under CI's load the second job of a 1-minute chain had wound down before its trials started."""
    # a margin that leaves the teardown time enough on this shared machine, with trials still running
    site = site_file(tmp_path, LONG_SITE.replace("15s", "30s") + "max_continuations: 1\n")
    done = submit_long(tmp_path, site, 150, 0, "--time", "2", "--wait", timeout=580)
    print(done.stdout, done.stderr)
    assert done.returncode == 75, done.stdout + done.stderr
    jobs = sweep_record(tmp_path)["epochs"]["1"]["jobs"]
    assert len(jobs) == 2, jobs
    logs = "".join(p.read_text() for p in (tmp_path / "runs").glob("*.out"))
    assert re.search(r"trial train \(\w+\) is not continued: longer than the walltime and never checkpoints", logs)
    assert re.search(r"sweep: 0 done, .*; trials train \(\w+\), train \(\w+\) not continued: longer than the "
                     r"walltime and never checkpoints$", done.stdout.strip().splitlines()[-1])
    last = done.stdout.strip().splitlines()[-1]
    assert "longer than the walltime and never checkpoints" in last, last


def test_a_warning_signal_then_cancel_and_resume_continue_from_the_checkpoint(tmp_path: Path) -> None:
    site = site_file(tmp_path, "warning_signal: USR1@40\ncheckpoint_grace: 10s\n")
    done = submit_long(tmp_path, site, 60, 5, "--time", "10")
    assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")
    job = re.search(r"submitted job (\S+)", done.stdout).group(1)
    marks = tmp_path / "marks"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not any(r[-1]["step"] >= 12 for r in attempts(marks).values() if r):
        time.sleep(1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)  # what SLURM sends at USR1@40
    wait_gone(job, 120)
    first = attempts(marks)
    assert all(1 <= len(r) for r in first.values()) and len(first) == 2, first
    resumed = hpcg(["resume", job, "--site", str(site), "--wait"], tmp_path, timeout=400)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + job_logs(tmp_path / "runs")
    assert json.loads((tmp_path / "out.json").read_text())["result"] == 1
    for runs in attempts(marks).values():
        assert len(runs) == 2 and runs[1]["from"] >= runs[0]["step"] - 5 and runs[1]["from"] > 0, runs
    # cancel + resume mid-trial: the checkpoints on disk carry the trial on (a fresh epoch would not)
    again = submit_long(tmp_path, site, 60, 5, "--time", "10")
    job = re.search(r"submitted job (\S+)", again.stdout).group(1)
    before = {i: len(r) for i, r in attempts(marks).items()}
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all(len(now.get(i, [])) > before[i] and now[i][-1]["step"] >= 12
                                                  for now in [attempts(marks)] for i in before):
        time.sleep(1)
    now = attempts(marks)
    assert all(len(now[i]) > before[i] and now[i][-1]["from"] == 0 for i in before), now  # a new epoch: clean
    assert hpcg(["cancel", job, "--site", str(site)], tmp_path).returncode == 0
    wait_gone(job, 120)
    resumed = hpcg(["resume", job, "--site", str(site), "--wait"], tmp_path, timeout=400)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + job_logs(tmp_path / "runs")
    assert all(attempts(marks)[i][-1]["from"] >= 10 for i in before), attempts(marks)


def test_cancel_gives_the_trials_their_grace_and_submits_no_follow_up(tmp_path: Path) -> None:
    """`hpc-garage cancel` mid-trial on a `requeue: auto` site: the trials see should_stop() and save (they
    would not checkpoint before step 30 otherwise), the job ends by itself, no follow-up job is submitted, and
    `resume` continues from the checkpoints the stop saved."""
    site = site_file(tmp_path, "requeue: auto\ncheckpoint_grace: 20s\n")
    done = submit_long(tmp_path, site, 45, 30, "--time", "10")
    assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")
    job = re.search(r"submitted job (\S+)", done.stdout).group(1)
    marks = tmp_path / "marks"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (len(attempts(marks)) == 2 and
                                               all(r[-1]["step"] >= 8 for r in attempts(marks).values())):
        time.sleep(1)
    cancelled = hpcg(["cancel", job, "--site", str(site)], tmp_path, timeout=200)
    print(cancelled.stdout, cancelled.stderr)
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    lines = cancelled.stdout.strip().splitlines()
    assert lines[0] == (f"job {job}: winding down; giving its running trials 20 s (checkpoint_grace) to checkpoint "
                        "before it is cancelled (`--now` cancels at once)"), lines
    assert lines[-1] == (f"job {job} wound down and ended (cancelled (exit 143)); no follow-up job; "
                         f"`hpc-garage resume {job}` continues its sweep"), lines
    stopped = [json.loads(p.read_text()) for p in marks.glob("stopped-*")]
    assert len(stopped) == 2 and all(s["why"] == "cancelled (`hpc-garage cancel`)" and s["step"] >= 8
                                     for s in stopped), stopped
    wait_gone(job, 60)
    assert len(sweep_record(tmp_path)["epochs"]["1"]["jobs"]) == 1  # no follow-up job, even with requeue: auto
    state = json.loads((tmp_path / "runs" / job / "state.json").read_text())
    assert state.get("cancelled") and not state.get("next_job") and state["interrupted"] == 2, state
    logs = "".join(p.read_text() for p in (tmp_path / "runs").glob(f"*{job}*.out"))
    assert "no follow-up job: the job is being cancelled" in logs, logs
    resumed = hpcg(["resume", job, "--site", str(site), "--wait"], tmp_path, timeout=400)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr + job_logs(tmp_path / "runs")
    assert json.loads((tmp_path / "out.json").read_text())["result"] == 1
    saved = {s["step"] for s in stopped}
    for runs in attempts(marks).values():
        assert len(runs) == 2 and runs[1]["from"] in saved and runs[1]["from"] >= 8, runs


def test_the_same_script_runs_on_a_login_node_and_outside_hpc_garage(tmp_path: Path) -> None:
    """`hpc-garage run` on a login node and plain `python`, unchanged; and no stale checkpoint: a trial whose
    inputs changed, resumed in the same epoch, starts clean beside the old one."""
    env = outside_job_env()
    site = site_file(tmp_path)

    def args(duration: int) -> list[str]:
        return [str(SWEEP), "--trials", "2", "--duration", str(duration), "--every", "1", "--marks", str(tmp_path / "m")]

    def run(*extra: str, duration: int = 3) -> None:
        done = subprocess.run(["python3", "-m", "hpc_garage", "run", "--site", str(site), "--sweep", "same", *extra,
                               "--", "python3", *args(duration), "--out", str(tmp_path / "a.json")],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")

    run()
    checkpoints = tmp_path / "runs" / "sweeps" / "same" / "1" / ".checkpoints"
    assert len(list(checkpoints.iterdir())) == 2  # under `run`: the sweep's directory
    run("--resume", duration=4)  # the inputs changed: new keys, and the new attempts start from step 0
    assert len(list(checkpoints.iterdir())) == 4
    assert [r[-1]["from"] for r in attempts(tmp_path / "m").values()] == [0, 0]
    plain = subprocess.run(["python3", *args(3), "--out", str(tmp_path / "b.json")], capture_output=True, text=True,
                           cwd=tmp_path, env={**env, "HPC_GARAGE_SITE": str(site)}, timeout=300)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    assert len(list((tmp_path / ".hpc-garage-checkpoints").iterdir())) == 2  # outside hpc-garage: a local one


def test_preemption_winds_the_job_down_in_its_grace_and_the_requeued_job_continues(tmp_path: Path) -> None:
    """Issue 31: the local SLURM's `low` partition is preempted by `high` (PreemptMode=REQUEUE, GraceTime=30:
    SIGTERM to the job's steps, the kill 30 s later). Two 60-s trials that checkpoint every 20 steps and on
    should_stop(): the SIGTERM winds the job down, each trial saves, the job is requeued under the same id, and
    the sweep completes from the checkpoints: no trial lost or run from zero, <= 15 s of work lost per trial."""
    site = site_file(tmp_path, "requeue: auto\ncheckpoint_grace: 20s\n")
    site.write_text(site.read_text().replace("queue: gpu", "queue: low"))
    done = submit_long(tmp_path, site, 60, 20, "--time", "10")
    assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")
    job = re.search(r"submitted job (\S+)", done.stdout).group(1)
    marks = tmp_path / "marks"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (len(attempts(marks)) == 2 and
                                               all(r and r[-1]["step"] >= 8 for r in attempts(marks).values())):
        time.sleep(1)
    node = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
    high = subprocess.run(["sbatch", "--parsable", "--partition=high", "--exclusive", f"--nodelist={node}",
                           f"--output={tmp_path / 'high-%j.out'}", "--wrap", "sleep 3"],
                          capture_output=True, text=True, check=True).stdout.strip()
    wait_gone(high, 240)
    release_requeued(job)
    deadline = time.monotonic() + 600  # the requeued job runs the rest
    while time.monotonic() < deadline and not (tmp_path / "out.json").exists():
        time.sleep(2)
    assert (tmp_path / "out.json").exists(), job_logs(tmp_path / "runs")
    assert json.loads((tmp_path / "out.json").read_text())["result"] == 1
    restarts = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "Restarts=1" in restarts, restarts  # requeued once, under the same id
    stopped = [json.loads(p.read_text()) for p in marks.glob("stopped-*")]
    assert len(stopped) == 2 and all(s["why"].startswith("signal SIGTERM") for s in stopped), stopped
    for i, runs in attempts(marks).items():
        print(f"trial {i}: {runs}")
        assert len(runs) == 2, runs  # interrupted once, continued once: never run again from zero
        assert runs[1]["from"] > 0 and runs[0]["step"] - runs[1]["from"] <= 15, runs
        assert runs[1]["step"] == 60, runs


def test_a_cancel_in_prefect_winds_a_submitted_job_down_and_the_flow_run_ends_cancelled(tmp_path: Path) -> None:
    """Issue 31: the Cancel button (here: the API's set_state CANCELLING, as the UI and `prefect flow-run
    cancel` do) on a flow run that `hpc-garage submit` started: `run` sees it, winds the job down as `hpc-garage
    cancel` does (the trials save on should_stop(); no follow-up job even with `requeue: auto`), and the flow
    run ends Cancelled."""
    from hpc_garage.prefect_api import PrefectApi

    site = site_file(tmp_path, "requeue: auto\ncheckpoint_grace: 20s\n")
    done = submit_long(tmp_path, site, 45, 30, "--time", "10")
    assert done.returncode == 0, done.stdout + done.stderr + job_logs(tmp_path / "runs")
    job = re.search(r"submitted job (\S+)", done.stdout).group(1)
    marks, state_file = tmp_path / "marks", tmp_path / "runs" / job / "state.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (len(attempts(marks)) == 2 and
                                               all(r and r[-1]["step"] >= 8 for r in attempts(marks).values())):
        time.sleep(1)
    prefect = json.loads(state_file.read_text())["progress"]["prefect"]
    auth = hpcg(["server", "auth"], tmp_path).stdout.strip()
    api = PrefectApi.from_env({"PREFECT_API_URL": prefect["api"], "PREFECT_API_AUTH_STRING": auth})
    (flow_run,) = [r["id"] for r in prefect["flow_runs"]]
    api.post(f"/flow_runs/{flow_run}/set_state", {"state": {"type": "CANCELLING", "message": "the test"},
                                                  "force": True})
    wait_gone(job, 120)
    stopped = [json.loads(p.read_text()) for p in marks.glob("stopped-*")]
    assert len(stopped) == 2 and all(s["why"] == "cancelled in Prefect" and s["step"] >= 8 for s in stopped), stopped
    assert api.get(f"/flow_runs/{flow_run}")["state_type"] == "CANCELLED"
    state = json.loads(state_file.read_text())
    assert state.get("cancelled") and not state.get("next_job") and state["interrupted"] == 2, state
    assert len(sweep_record(tmp_path)["epochs"]["1"]["jobs"]) == 1  # no follow-up job
    assert state.get("exit_code") == 143, state  # ends as a cancelled job does
