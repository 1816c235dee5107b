"""Submission mechanics against a scripted batch system: all-or-nothing, records, status, wait, logs, cancel."""

from __future__ import annotations

import io
import json
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hpc_garage.core.progress_text import sweep_text
from hpc_garage.core.request import Request
from hpc_garage.rundir import RunRoot

import hpc_garage.schedulers as schedulers
from hpc_garage.schedulers import submission
from hpc_garage.core.errors import UserError
from hpc_garage.schedulers.base import JobStatus
from hpc_garage.schedulers.pbs import Pbs, _pbs_exit, parse_qstat_jobs
from hpc_garage.schedulers.slurm import Slurm, _exit_code, parse_scontrol_job
from tests.conftest import DATA


class FakeSlurm(Slurm):
    """Slurm with its commands answered from a script: `answers[command]` is a list consumed in order
    (the last answer repeats); an answer may be a callable giving it; an exception is raised."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.answers: dict[str, list[Any]] = {"sbatch": ["42\n"], "scancel": [""]}

    def run(self, argv: Sequence[str], *, input: str | None = None, timeout: float = 60) -> str:
        self.calls.append(list(argv))
        queue = self.answers.get(argv[0], [""])
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if callable(answer):
            answer = answer()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def commands(self) -> list[str]:
        return [c[0] for c in self.calls]


def scontrol(state: str, exit_code: str = "0:0", name: str = "flow", reason: str = "None") -> str:
    return (f"JobId=42 JobName={name} UserId=me(1) JobState={state} Reason={reason} ExitCode={exit_code} "
            f"NodeList=node1 Command=/a b/c.sh WorkDir=/a b\n")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    batch = FakeSlurm()
    real_get = schedulers.get
    monkeypatch.setattr(schedulers, "get", lambda name: batch if name == "slurm" else real_get(name))
    return batch


@pytest.fixture
def lab(tmp_path: Path, site_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A SLURM site `t` whose run root is tmp_path/runs (not yet created), and a script in tmp_path/work."""
    (site_dir / "t.yaml").write_text(
        f"scheduler: slurm\nqueue: cpu\nrun_directory: {tmp_path}/runs\n"
        "node:\n  cores: 4\n  memory: 8GiB\nworkers:\n  per: process\n  processes: 2\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    (work / "flow.py").write_text("print('hi')\n")
    monkeypatch.chdir(work)
    return tmp_path


def everything_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


# ------------------------------------------------------------------------------------------- preparing


def test_prepare_reads_and_creates_nothing(lab: Path) -> None:
    before = everything_under(lab)
    prepared = submission.prepare("t", "flow.py", ["--x", "1"])
    assert "#SBATCH --output=" + str(lab / "runs" / "%j.out") in prepared.script
    assert prepared.spec.script == str(lab / "work" / "flow.py") and prepared.spec.workdir == str(lab / "work")
    assert everything_under(lab) == before


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: submission.prepare("t", "nope.py"), "script {lab}/work/nope.py does not exist"),
        (lambda: submission.prepare("nosuch", "flow.py"), "unknown site 'nosuch'"),
        (lambda: submission.prepare("t", "flow.py", request=Request(nodes=0)), "--nodes 0"),
        (lambda: submission.prepare("t", "flow.py", output="no/dir/%j.out"), "directory {lab}/work/no/dir does not exist"),
        (lambda: submission.prepare("t", "flow.py", request=Request(job_name="a b")), "job name 'a b'"),
    ],
)
def test_prepare_refuses_in_one_line(lab: Path, call: Any, fragment: str) -> None:
    with pytest.raises(UserError) as info:
        call()
    assert fragment.format(lab=lab) in str(info.value)


def test_local_sites_take_no_jobs(lab: Path, site_dir: Path) -> None:
    (site_dir / "here.yaml").write_text("scheduler: local\nnode:\n  cores: 2\n  memory: 1GiB\n")
    with pytest.raises(UserError, match="hpc-garage run --site here"):
        submission.prepare("here", "flow.py")


# ------------------------------------------------------------------------------------------ submitting


def test_submit_records_the_job(lab: Path, fake: FakeSlurm) -> None:
    prepared = submission.prepare("t", "flow.py", ["a b"])
    done = submission.submit(prepared)
    root = lab / "runs"
    assert done.job_id == "42" and done.run_dir == root / "42" and done.log == str(root / "42.out")
    (argv,) = fake.calls
    assert argv[:2] == ["sbatch", "--parsable"] and Path(argv[2]).parent == root
    assert not Path(argv[2]).exists()  # the temporary script became job.sh
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and stat.S_IMODE(done.run_dir.stat().st_mode) == 0o700
    assert (done.run_dir / "job.sh").read_text() == prepared.script
    record = json.loads((done.run_dir / "submit.json").read_text())
    assert record["site"] == "t" and record["scheduler"] == "slurm" and record["args"] == ["a b"]
    assert record["cwd"] == str(lab / "work") and record["job_name"] == "flow"
    assert record["log"]["path"] == str(root / "42.out") and record["log"]["output"] == str(root / "%j.out")
    assert abs(record["submitted"] - time.time()) < 60
    assert [p for p in everything_under(root) if not p.startswith("sweeps")] == ["42", "42/job.sh", "42/submit.json"]
    sweep = record["sweep"]  # the job joined its sweep: a fresh epoch, recorded with how it joined
    assert sweep["name"].startswith("flow-") and sweep["epoch"] == 1 and sweep["root"] == str(root / "sweeps")
    book = json.loads((root / "sweeps" / sweep["name"] / "sweep.json").read_text())
    assert [(j["job_id"], j["how"]) for j in book["epochs"]["1"]["jobs"]] == [("42", "submit")]
    assert f"--sweep {sweep['name']} --sweep-epoch 1 --" in prepared.script


def test_a_fresh_submit_starts_a_new_epoch_and_resume_continues_the_latest(lab: Path, fake: FakeSlurm) -> None:
    """Submitting the same sweep again runs everything again (epoch 2: no result of epoch 1 is keyed to it);
    --resume joins the latest epoch; a job's run line says which."""
    fake.answers["sbatch"] = ["42\n", "43\n", "44\n"]
    first = submission.submit(submission.prepare("t", "flow.py", ["x"]))
    second = submission.submit(submission.prepare("t", "flow.py", ["x"]))
    resumed = submission.submit(submission.prepare("t", "flow.py", ["x"], resume=True))
    assert [d.record["sweep"]["epoch"] for d in (first, second, resumed)] == [1, 2, 2]
    assert len({d.record["sweep"]["name"] for d in (first, second, resumed)}) == 1  # derived: the same sweep
    assert "--sweep-epoch 2 --" in (resumed.run_dir / "job.sh").read_text()
    book = json.loads((lab / "runs" / "sweeps" / first.record["sweep"]["name"] / "sweep.json").read_text())
    assert {e: [(j["job_id"], j["how"]) for j in v["jobs"]] for e, v in book["epochs"].items()} == {
        "1": [("42", "submit")], "2": [("43", "submit"), ("44", "resume")]}
    other = submission.prepare("t", "flow.py", ["y"])  # other arguments: another sweep
    assert other.spec.sweep != first.record["sweep"]["name"] and other.spec.sweep_epoch == 1


def test_rejected_submission_leaves_nothing(lab: Path, fake: FakeSlurm) -> None:
    fake.answers["sbatch"] = [UserError("sbatch failed: invalid partition specified: nosuch")]
    with pytest.raises(UserError, match="invalid partition"):
        submission.submit(submission.prepare("t", "flow.py"))
    assert not (lab / "runs").exists()
    assert fake.commands() == ["sbatch"]


def test_unreadable_job_id_leaves_nothing(lab: Path, fake: FakeSlurm) -> None:
    fake.answers["sbatch"] = ["sbatch: Job 42 to start at 2026-01-01T00:00:00 using 2 processors\n"]
    with pytest.raises(UserError, match="instead of a job id"):
        submission.submit(submission.prepare("t", "flow.py"))
    assert not (lab / "runs").exists()


def test_failed_recording_cancels_the_job_and_removes_everything(
    lab: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(path: Path, text: str) -> None:
        (lab / "runs" / "42.out").write_text("the job started already\n")  # as if it ran before we cancelled
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hpc_garage.files.write_private", broken)  # the submit record's write (rundir)
    with pytest.raises(OSError):
        submission.submit(submission.prepare("t", "flow.py"))
    assert fake.calls[-1] == ["scancel", "42"]
    assert not (lab / "runs").exists()


def test_interrupt_while_recording_also_cancels(lab: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch) -> None:
    (lab / "runs").mkdir()
    (lab / "runs" / "keep").write_text("")

    def interrupted(path: Path, text: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("hpc_garage.files.write_private", interrupted)  # the submit record's write (rundir)
    with pytest.raises(KeyboardInterrupt):
        submission.submit(submission.prepare("t", "flow.py"))
    assert ["scancel", "42"] in fake.calls
    assert everything_under(lab / "runs") == ["keep"]  # the root existed before: only ours went


def test_an_older_jobs_files_under_a_recycled_id_are_ignored(lab: Path, fake: FakeSlurm) -> None:
    old = lab / "runs" / "42"
    old.mkdir(parents=True)
    (old / "state.json").write_text(json.dumps({"phase": "done", "exit_code": 0, "updated": time.time() - 3600}))
    (lab / "runs" / "42.out").write_text("old log\n")
    os.utime(lab / "runs" / "42.out", (time.time() - 3600,) * 2)
    done = submission.submit(submission.prepare("t", "flow.py"))
    fake.answers["scontrol"] = [scontrol("PENDING", reason="Priority")]
    view = submission.refresh(submission.find("42"))
    assert view.record and view.record["submitted"] == json.loads((done.run_dir / "submit.json").read_text())["submitted"]
    assert view.state is None and view.summary() == "pending (Priority)"
    with pytest.raises(UserError, match="no log yet"):
        submission.logs(view, io.BytesIO())


# ------------------------------------------------------------------------------------ following a job


@pytest.mark.parametrize(
    ("status", "state", "summary"),
    [
        (JobStatus("1", "PENDING", "pending"), None, "pending"),
        (JobStatus("1", "PENDING", "pending", reason="Resources"), None, "pending (Resources)"),
        (JobStatus("1", "RUNNING", "running"), None, "running"),
        (JobStatus("1", "RUNNING", "running"), {"phase": "starting"}, "running (starting)"),
        (JobStatus("1", "RUNNING", "running"), {"phase": "workers", "workers": 3, "expected": 8}, "workers 3/8"),
        (JobStatus("1", "RUNNING", "running"), {"phase": "running", "workers": 8, "expected": 8}, "running (8 workers)"),
        (JobStatus("1", "RUNNING", "running"), {"phase": "running", "workers": 1}, "running (1 worker)"),
        (JobStatus("1", "RUNNING", "running"), {"phase": "winding down", "progress": {"done": 3, "running": 1}},
         "winding down: 3 done, 1 running, 0 failed, 0 waiting"),
        (JobStatus("1", "COMPLETED", "finished", exit_code=0), None, "done"),
        (JobStatus("1", "FAILED", "finished", exit_code=3), None, "failed (exit 3)"),
        (JobStatus("1", "CANCELLED", "finished", exit_code=143), None, "cancelled (exit 143)"),
        (JobStatus("1", "TIMEOUT", "finished", exit_code=1), None, "timeout (exit 1)"),
        (JobStatus("1", "C", "finished"), {"phase": "done", "exit_code": 0}, "done"),
        (JobStatus("1", "C", "finished"), {"phase": "failed", "exit_code": 2}, "failed (exit 2)"),
        (JobStatus("1", "C", "finished"), None, "finished (exit code unknown)"),
        (JobStatus("1", "F", "finished", exit_code=0), None, "done"),
        (None, {"phase": "done", "exit_code": 0}, "done"),
        (None, {"phase": "failed", "exit_code": 5}, "failed (exit 5)"),
        (JobStatus("1", "FAILED", "finished", exit_code=75), {"phase": "failed", "chain_ended": "no trial ran"},
         "failed (exit 75: no trial ran)"),  # why the sweep's chain of jobs ends here (cluster/wind_down.py)
        (JobStatus("1", "COMPLETED", "finished", exit_code=0), {"chain_ended": "no trial ran"}, "done"),
        (None, {"phase": "running"}, "left the queue (last seen running)"),
        (None, None, "left the queue; no state recorded"),
    ],
)
def test_summary(status: JobStatus | None, state: dict[str, Any] | None, summary: str) -> None:
    view = submission.JobView(job_id="1", record=None, run_dir=None, batch=Slurm(), status=status, state=state)
    assert view.summary() == summary


def test_wait_reports_each_change_and_returns_the_exit_code(lab: Path, fake: FakeSlurm) -> None:
    done = submission.submit(submission.prepare("t", "flow.py"))
    state_file = done.run_dir / "state.json"

    def running(state: dict[str, Any] | None, slurm_state: str = "RUNNING", code: str = "0:0") -> Any:
        def answer() -> str:
            if state is not None:
                state_file.write_text(json.dumps(state | {"updated": time.time()}))
            return scontrol(slurm_state, code)
        return answer

    fake.answers["scontrol"] = [
        running(None, "PENDING"),
        running(None),
        running({"phase": "workers", "workers": 1, "expected": 2}),
        running({"phase": "workers", "workers": 1, "expected": 2}),
        running({"phase": "running", "workers": 2, "expected": 2}),
        running({"phase": "failed", "workers": 2, "expected": 2, "exit_code": 3}, "FAILED", "3:0"),
    ]
    seen: list[str] = []
    report = seen.append
    assert submission.wait(submission.find("42"), report, interval=0, limit=0) == 3
    assert seen == ["job 42 pending", "job 42 running", "job 42 workers 1/2", "job 42 running (2 workers)",
                    "job 42 failed (exit 3)"]


def test_wait_follows_the_sweep_into_its_follow_up_job_and_shows_its_totals(lab: Path, fake: FakeSlurm) -> None:
    """`--wait` across a walltime follow-up: each job's own progress, and the sweep's trials across both jobs
    (done: what the epoch keeps; to go: the latest job's); `status JOB` reads the same (JobView.sweep)."""
    fake.answers["sbatch"] = ["42\n", "43\n"]
    first = submission.submit(submission.prepare("t", "flow.py"))
    follow_up = submission.submit(submission.prepare("t", "flow.py", resume=True))
    results = lab / "runs" / "sweeps" / first.record["sweep"]["name"] / "1"
    results.mkdir(parents=True)

    def state(run_dir: Path, progress: dict[str, int], **extra: Any) -> None:
        (run_dir / "state.json").write_text(json.dumps({"progress": progress, "updated": time.time(), **extra}))

    def finished_first() -> str:  # it wound down at walltime: 10 finished, 2 cut off, 28 never started
        for i in range(10):
            (results / f"key{i}").write_text("{}")
        state(first.run_dir, {"done": 10, "running": 2, "failed": 0, "waiting": 28}, phase="done", exit_code=0,
              next_job="43")
        return scontrol("COMPLETED")

    def running_second() -> str:
        state(follow_up.run_dir, {"done": 25, "running": 4, "failed": 1, "waiting": 11}, phase="running")
        return scontrol("RUNNING")

    def finished_second() -> str:
        for i in range(10, 40):
            (results / f"key{i}").write_text("{}")
        state(follow_up.run_dir, {"done": 40, "running": 0, "failed": 0, "waiting": 0}, phase="done", exit_code=0)
        return scontrol("COMPLETED")

    fake.answers["scontrol"] = [finished_first, running_second, finished_second]
    seen: list[str] = []
    assert submission.wait(submission.find("42"), seen.append, interval=0, limit=0) == 0
    assert seen == [
        "job 42 done | sweep: 10 done, 0 running, 0 failed, 30 to go (2 jobs)",
        "job 42: the sweep continues in job 43",
        "job 43 running: 25 done, 4 running, 1 failed, 11 waiting | sweep: 25 done, 4 running, 1 failed, 11 to go (2 jobs)",
        "job 43 done | sweep: 40 done, 0 running, 0 failed, 0 to go (2 jobs)",
    ]
    view = submission.refresh(submission.find("42"), None)
    assert sweep_text(view.to_dict(sweep=True)["sweep"]) == "40 done, 0 running, 0 failed, 0 to go (2 jobs)"


def test_wait_on_a_job_that_aged_out_uses_state_json(lab: Path, fake: FakeSlurm) -> None:
    done = submission.submit(submission.prepare("t", "flow.py"))
    (done.run_dir / "state.json").write_text(json.dumps({"phase": "done", "exit_code": 0, "updated": time.time()}))
    fake.answers["scontrol"] = [UserError("scontrol failed: slurm_load_jobs error: Invalid job id specified")]
    seen: list[str] = []
    assert submission.wait(submission.find("42"), seen.append, interval=0) == 0
    assert seen == ["job 42 done"]


def test_a_recycled_id_in_the_queue_is_not_our_job(lab: Path, fake: FakeSlurm) -> None:
    submission.submit(submission.prepare("t", "flow.py"))
    fake.answers["scontrol"] = [scontrol("RUNNING", name="someone-else")]
    assert submission.refresh(submission.find("42")).status is None


def test_logs_prints_and_follows(lab: Path, fake: FakeSlurm) -> None:
    done = submission.submit(submission.prepare("t", "flow.py"))
    log = Path(done.log)
    log.write_text("line 1\n")
    out = io.BytesIO()
    submission.logs(submission.find("42"), out)
    assert out.getvalue() == b"line 1\n"

    fake.answers["scontrol"] = [scontrol("RUNNING"), scontrol("COMPLETED")]
    out = io.BytesIO()

    class Growing(io.BytesIO):
        def flush(self) -> None:  # the job writes more while we follow
            if b"line 2" not in log.read_bytes():
                with log.open("a") as f:
                    f.write("line 2\n")

    out = Growing()
    submission.logs(submission.find("42"), out, follow=True, poll=0)
    assert out.getvalue() == b"line 1\nline 2\n"


def test_cancel_says_what_it_did(lab: Path, fake: FakeSlurm) -> None:
    submission.submit(submission.prepare("t", "flow.py"))
    fake.answers["scontrol"] = [scontrol("RUNNING")]
    assert submission.cancel(submission.find("42")).startswith("cancelled job 42 (it was running")
    assert fake.calls[-1] == ["scancel", "42"]
    fake.answers["scontrol"] = [scontrol("COMPLETED")]
    assert submission.cancel(submission.find("42")) == "job 42 already ended (COMPLETED); nothing to cancel"
    fake.answers["scontrol"] = [UserError("scontrol failed: Invalid job id specified")]
    with pytest.raises(UserError, match="not in the slurm queue"):
        submission.cancel(submission.find("42"))


def running_sweep(lab: Path, **state: Any) -> Path:
    """Job 42, submitted, with the state.json its `run` writes once its trials run."""
    done = submission.submit(submission.prepare("t", "flow.py"))
    (Path(done.run_dir) / "state.json").write_text(json.dumps(
        {"phase": "running", "checkpoint_grace": 20.0, "updated": time.time() + 10, **state}))
    return Path(done.run_dir)


@pytest.mark.parametrize(("why", "state", "status", "now", "grace"), [
    ("a running sweep", {}, "RUNNING", False, 20.0),
    ("already winding down (walltime)", {"phase": "winding down"}, "RUNNING", False, 20.0),
    ("--now", {}, "RUNNING", True, None),
    ("pending", {}, "PENDING", False, None),
    ("its workers not up yet: no trial runs", {"phase": "workers"}, "RUNNING", False, None),
    ("a run that notes no grace does not wind down for a cancel", {"checkpoint_grace": None}, "RUNNING", False,
     None),
    ("run already ended", {"exit_code": 0}, "RUNNING", False, None),
])
def test_which_cancels_give_the_trials_their_grace(lab: Path, fake: FakeSlurm, why: str, state: dict[str, Any],
                                                   status: str, now: bool, grace: float | None) -> None:
    running_sweep(lab, **state)
    fake.answers["scontrol"] = [scontrol(status)]
    view = submission.find("42")
    from hpc_garage.schedulers.submission.finding import refresh

    assert submission.following.wind_down_grace(refresh(view), now) == grace, why


def test_a_job_not_hpc_garages_or_a_batch_system_that_cannot_signal_is_cancelled_at_once(
        lab: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.answers["scontrol"] = [scontrol("RUNNING")]
    assert submission.cancel(submission.find("42", "t")).startswith("cancelled job 42 (it was running")
    assert fake.calls[-1] == ["scancel", "42"]  # no run directory: no wind-down
    running_sweep(lab)
    monkeypatch.setattr(FakeSlurm, "wind_down_argv", lambda self, job_id: None)
    assert submission.cancel(submission.find("42")).startswith("cancelled job 42 (it was running")
    assert fake.calls[-1] == ["scancel", "42"] and not any("--batch" in c for c in fake.calls)
    assert Pbs().wind_down_argv("7.srv") == ["qsig", "-s", "SIGURG", "7.srv"]
    assert Slurm().wind_down_argv("42") == ["scancel", "--batch", "--signal=URG", "42"]


def test_cancel_winds_a_running_sweep_down_then_says_how_it_ended(lab: Path, fake: FakeSlurm) -> None:
    run_dir = running_sweep(lab)
    fake.answers["scontrol"] = [scontrol("RUNNING"), scontrol("RUNNING"), scontrol("FAILED", "143:0")]
    said: list[str] = []
    line = submission.cancel(submission.find("42"), said.append, poll=0)
    assert fake.calls[-1][0] != "scancel" and ["scancel", "--batch", "--signal=URG", "42"] in fake.calls
    assert (run_dir / "cancel-requested").is_file()  # written before the signal: `run` reads it on the signal
    assert said == [("job 42: winding down; giving its running trials 20 s (checkpoint_grace) to checkpoint before "
                     "it is cancelled (`--now` cancels at once)")]
    state = json.loads((run_dir / "state.json").read_text())
    (run_dir / "state.json").write_text(json.dumps({**state, "cancelled": True, "exit_code": 143}))
    assert line.startswith("job 42 wound down and ended (failed (exit 143)); no follow-up job;")
    from hpc_garage.schedulers.submission.finding import refresh

    assert refresh(submission.find("42")).summary() == "cancelled (exit 143)"


def test_a_sweep_that_does_not_end_within_its_grace_is_cancelled(lab: Path, fake: FakeSlurm,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    running_sweep(lab, next_job="43")  # a walltime wind-down had submitted a follow-up before the cancel
    monkeypatch.setattr(submission.following, "CANCEL_MARGIN", 0.0)
    fake.answers["scontrol"] = [scontrol("RUNNING")]
    said: list[str] = []
    monkeypatch.setattr(submission.following.time, "monotonic", iter(range(0, 10_000, 30)).__next__)
    line = submission.cancel(submission.find("42"), said.append, poll=0)
    assert said[-1] == "job 42: its follow-up job 43 cancelled too" and ["scancel", "43"] in fake.calls
    assert line == "cancelled job 42 (it was running; `scancel 42`)" and fake.calls[-1] == ["scancel", "42"]


def test_status_all_newest_first_one_squeue(lab: Path, fake: FakeSlurm) -> None:
    fake.answers["sbatch"] = ["7\n", "8\n"]
    submission.submit(submission.prepare("t", "flow.py"))
    submission.submit(submission.prepare("t", "flow.py", request=Request(job_name="second")))
    fake.answers["squeue"] = ["8|RUNNING|second|None|node1\n7|PENDING|flow|Priority|\n"]
    views = submission.status_all([RunRoot(lab / "runs")])
    assert [v.job_id for v in views] == ["8", "7"]
    assert [v.summary() for v in views] == ["running", "pending (Priority)"]
    assert fake.commands().count("squeue") == 1


@pytest.mark.parametrize("job_id", ["../etc", "a/b", "", "-1", ".."])
def test_job_ids_are_checked(job_id: str) -> None:
    with pytest.raises(UserError, match="is not a job id"):
        submission.find(job_id)


# ------------------------------------------------------------------------------------ parsing answers


def test_scontrol_line() -> None:
    fields = parse_scontrol_job(scontrol("FAILED", "3:0"))
    assert fields == {"JobId": "42", "JobName": "flow", "JobState": "FAILED", "Reason": "None", "ExitCode": "3:0",
                      "NodeList": "node1"}


@pytest.mark.parametrize(
    ("state", "code", "expected"),
    [("COMPLETED", "0:0", 0), ("FAILED", "3:0", 3), ("CANCELLED", "0:15", 143), ("TIMEOUT", "0:0", 1),
     ("NODE_FAIL", "0:0", 1), ("FAILED", "", None), ("FAILED", "x:y", None)],
)
def test_slurm_exit_codes(state: str, code: str, expected: int | None) -> None:
    assert _exit_code(state, code) == expected


def test_slurm_log_patterns() -> None:
    import getpass

    s = Slurm()
    assert s.log_path("/r/%j.out", "12", "flow") == "/r/12.out"
    assert s.log_path("/r/%x-%5j-%u.%%", "12", "flow") == f"/r/flow-00012-{getpass.getuser()}.%"


def test_qstat_blocks_of_both_flavours() -> None:
    torque = parse_qstat_jobs((DATA / "qstat-f.txt").read_text())
    assert torque["13"]["job_state"] == "R" and torque["13"]["Job_Name"] == "pbsjob.sh"
    pro = parse_qstat_jobs(
        "Job Id: 7.server\n    Job_Name = flow\n    job_state = F\n    Exit_status = 3\n"
        "    Variable_List = PBS_O_HOME=/home/me,\n\tPBS_O_LANG=C\n\nJob Id: 8.server\n    job_state = Q\n"
    )
    assert pro["7.server"] == {"Job_Name": "flow", "job_state": "F", "Exit_status": "3",
                               "Variable_List": "PBS_O_HOME=/home/me,PBS_O_LANG=C"}
    assert pro["8.server"]["job_state"] == "Q"


@pytest.mark.parametrize(("value", "code"), [("0", 0), ("3", 3), ("271", 143), ("-11", 1), (None, None), ("x", None)])
def test_pbs_exit_status(value: str | None, code: int | None) -> None:
    assert _pbs_exit(value) == code


def test_pbs_status_falls_back_to_history(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def run(self: Pbs, argv: Sequence[str], **kw: Any) -> str:
        calls.append(list(argv))
        if argv[1] == "-f":
            raise UserError("qstat failed: qstat: 7.server Job has finished, use -x or -H to obtain historical job information")
        return "Job Id: 7.server\n    Job_Name = flow\n    job_state = F\n    Exit_status = 0\n"

    monkeypatch.setattr(Pbs, "run", run)
    status = Pbs().status("7.server")
    assert status and (status.phase, status.exit_code, status.name) == ("finished", 0, "flow")
    assert calls == [["qstat", "-f", "7.server"], ["qstat", "-fx", "7.server"]]
