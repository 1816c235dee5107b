"""How a terminal shows jobs (cli/status_text.py): `--wait`'s line, `status`'s lines and table, the lines that
say where to look while a job runs (Prefect UI and `ssh -L` lines: tests/test_progress.py, tests/test_prefect_ui.py)."""

from __future__ import annotations

import io
import time
from pathlib import Path

from hpc_garage.cli.status_text import job_lines, jobs_table, lost_nodes, progress_line, sweep_line
from hpc_garage.schedulers.base import JobStatus
from hpc_garage.schedulers.slurm import Slurm
from hpc_garage.schedulers.submission import JobView


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_one_rewritten_line_on_a_terminal_and_plain_lines_elsewhere() -> None:
    tty, pipe = Terminal(), io.StringIO()
    for stream in (tty, pipe):
        report = progress_line(stream)
        report("job 1 pending")
        report("job 1 running")
    assert tty.getvalue() == "\r\x1b[Kjob 1 pending\r\x1b[Kjob 1 running"
    assert pipe.getvalue() == "job 1 pending\njob 1 running\n"


def test_a_jobs_lines_show_what_is_known_and_skip_what_is_not(tmp_path: Path) -> None:
    at = time.mktime((2025, 1, 2, 23, 41, 7, 0, 0, -1))
    state = {"phase": "running", "updated": time.time(), "progress": {"done": 3, "running": 1, "failed": 0, "waiting": 4},
             "lost_nodes": [{"host": "node2", "at": at, "why": "killed by signal 9", "restarted": True}]}
    record = {"job_id": "7", "site": "lab", "job_name": "flow", "log": {"path": "/logs/7.out"}}
    view = JobView(job_id="7", record=record, run_dir=tmp_path / "7", batch=Slurm(),
                   status=JobStatus("7", "RUNNING", "running", nodes="node[1-2]", name="flow"), state=state)
    assert job_lines(view) == [
        "job 7 running: 3 done, 1 running, 0 failed, 4 waiting",
        "  site:           lab",
        "  name:           flow",
        "  slurm state:    RUNNING",
        "  nodes:          node[1-2]",
        "  lost nodes:     node2 at 23:41:07 (killed by signal 9; restarted)",
        "  log:            /logs/7.out",
        f"  run directory:  {tmp_path / '7'}",
        "  trials:         3 done, 1 running, 0 failed, 4 waiting",
    ]


def test_the_table_has_a_line_per_job_and_says_when_there_is_none() -> None:
    assert jobs_table([]) == ["no jobs: none that hpc-garage submitted or ran still has a run directory"]
    view = JobView(job_id="12", record={"site": "lab", "job_name": "a-very-long-job-name-cut", "submitted": None},
                   run_dir=None, batch=Slurm(), status=JobStatus("12", "PENDING", "pending", reason="Priority"))
    header, line = jobs_table([view])
    assert header.split() == ["JOBID", "SITE", "NAME", "SUBMITTED", "STATE"]
    assert line.split() == ["12", "lab", "a-very-long-job-name", "-", "pending", "(Priority)"]


def test_sweep_and_lost_node_lines_are_absent_without_data() -> None:
    assert sweep_line(None) is None and lost_nodes(None) is None and lost_nodes({"lost_nodes": []}) is None
    sweep = {"name": "lr", "epoch": 1, "results": 14, "jobs": [{"job_id": "93", "how": "submit"},
                                                              {"job_id": "98", "how": "follow-up"}]}
    assert sweep_line(sweep) == "lr epoch 1: 14 results kept; jobs 93 (submit), 98 (follow-up)"


def test_the_best_trial_and_counts_show_only_when_trials_reported(tmp_path: Path) -> None:
    """`status JOB`'s first and trials lines and `--wait`'s line (the job's summary) carry what the trials
    reported (progress's "metrics", cluster/trial_metrics.py); nothing where none reported, or it is malformed."""
    metrics = {"reporting": 3, "pruned": 5, "best": {"trial": "train-3", "task": "train", "metric": "loss",
                                                      "value": 0.29, "step": 11}}
    progress = {"done": 3, "running": 1, "failed": 0, "waiting": 4}
    shown = "best loss 0.29 (trial train-3 step 11), 3 reporting, 5 pruned"

    def view(metrics: object) -> JobView:
        state = {"phase": "running", "progress": {**progress, **({"metrics": metrics} if metrics is not None else {})}}
        return JobView(job_id="7", record={"job_id": "7"}, run_dir=tmp_path / "7", batch=Slurm(),
                       status=JobStatus("7", "RUNNING", "running"), state=state)

    lines = job_lines(view(metrics))
    assert lines[0] == f"job 7 running: 3 done, 1 running, 0 failed, 4 waiting; {shown}"
    assert f"  trials:         3 done, 1 running, 0 failed, 4 waiting; {shown}" in lines
    assert view(metrics).summary().endswith(shown)  # what --wait prints
    long_id = {**metrics, "pruned": 0, "best": {**metrics["best"], "trial": "3f2a9c" + "0" * 26}}
    assert view(long_id).summary().endswith("best loss 0.29 (trial train-3f2a9c00 step 11), 3 reporting")
    for nothing in (None, {}, {"reporting": 0, "pruned": 0, "best": None}, "text", {"reporting": "3"}):
        assert view(nothing).summary() == "running: 3 done, 1 running, 0 failed, 4 waiting", nothing
    assert view({"reporting": 2, "pruned": 0, "best": None}).summary().endswith("waiting; 2 reporting")
    ended = {**metrics, "reporting": 0}  # all ended: the best and the pruned still show
    assert view(ended).summary().endswith("best loss 0.29 (trial train-3 step 11), 0 reporting, 5 pruned")
