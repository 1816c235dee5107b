"""Real submissions to the local SLURM (scripts/local-slurm up): submit, sbatch, status, wait, logs, cancel.

The test site's `python` is a stand-in for the interpreter: asked to `-m hpc_garage run ... -- PY SCRIPT
ARGS`, it writes state.json the way `run` does and runs SCRIPT with the real Python, so these tests check
the submission side alone, in about a second per job. Every failure must be one line, exit 2, and leave
neither a run directory nor a job behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpc_garage.core.request import Request
from tests.conftest import outside_job_env

pytestmark = pytest.mark.slurm

FAKE_PYTHON = """#!/bin/bash
# stands in for `python -m hpc_garage run --site S -- python SCRIPT ARGS`: writes state.json as run does
[ "$1" = -m ] || exec {real} "$@"
while [ "$1" != -- ]; do shift; done
shift 2
dir={root}/${{PBS_JOBID:-$SLURM_JOB_ID}}
state() {{ printf '{{"phase": "%s", "workers": 2, "expected": 2, "exit_code": %s, "updated": %s}}' \\
  "$1" "$2" "$(date +%s)" > "$dir/state.json"; }}
state running null
{real} "$@"
code=$?
state $([ $code = 0 ] && echo done || echo failed) $code
exit $code
"""

JOB = """import os, sys, time
print("ARGV", sys.argv[1:], flush=True)
print("CWD", os.getcwd(), flush=True)
if sys.argv[1:2] == ["sleep"]:
    time.sleep(float(sys.argv[2]))
if sys.argv[1:2] == ["exit"]:
    sys.exit(int(sys.argv[2]))
"""


@pytest.fixture
def lab(tmp_path: Path) -> dict[str, Path]:
    """Sites `tsub` (SLURM) and `tpbs` (PBS, through Slurm's qsub wrapper), both small, runs under tmp_path."""
    root, sites, work = tmp_path / "runs", tmp_path / "sites", tmp_path / "work dir"
    sites.mkdir()
    work.mkdir()
    fake = tmp_path / "fakepy"
    fake.write_text(FAKE_PYTHON.format(real=sys.executable, root=root))
    fake.chmod(0o755)
    (sites / "tsub.yaml").write_text(
        f"scheduler: slurm\nqueue: cpu\nwalltime: '00:05:00'\nrun_directory: {root}\npython: {fake}\n"
        "node:\n  cores: 2\n  memory: 1GiB\nworkers:\n  per: process\n  processes: 2\n"
        "limits:\n  max_nodes: 2\n  max_walltime: '00:10:00'\n"
    )
    (sites / "tpbs.yaml").write_text(
        f"scheduler: pbs\nqueue: cpu\nwalltime: '00:05:00'\nrun_directory: {root}\npython: {fake}\n"
        "node:\n  cores: 2\n  memory: 1GiB\n"
    )
    (work / "job.py").write_text(JOB)
    return {"root": root, "sites": sites, "work": work}


def hpcg(lab: dict[str, Path], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = outside_job_env()
    env["HPC_GARAGE_SITES_PATH"] = str(lab["sites"])
    return subprocess.run([sys.executable, "-m", "hpc_garage", *args], capture_output=True, text=True, env=env,
                          cwd=lab["work"], timeout=timeout)


def unique() -> str:
    return f"hg-test-{uuid.uuid4().hex[:8]}"


def submitted_id(stdout: str) -> str:
    m = re.search(r"^submitted job (\d+) \(site tsub\)$", stdout, re.M)
    assert m, stdout
    return m.group(1)


def queued_by_name(name: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-n", name, "-o", "%i|%T"], capture_output=True, text=True)
    return out.stdout.split()


def active(job_id: str) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-t", "PENDING,RUNNING,COMPLETING,CONFIGURING", "-o", "%i"],
                         capture_output=True, text=True)
    return bool(out.stdout.strip())


def one_line_error(done: subprocess.CompletedProcess, fragment: str) -> None:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc-garage: error: "), done.stderr
    assert fragment in lines[0], lines[0]


def test_dry_run_prints_the_script_and_creates_nothing(lab: dict[str, Path]) -> None:
    name = unique()
    done = hpcg(lab, "submit", "--site", "tsub", "--dry-run", "-J", name, "job.py", "a b")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!/bin/bash\n") and f"#SBATCH --job-name={name}" in done.stdout
    assert not lab["root"].exists()
    assert queued_by_name(name) == []


def test_submit_wait_logs_and_status(lab: dict[str, Path]) -> None:
    name = unique()
    done = hpcg(lab, "submit", "--site", "tsub", "--wait", "-J", name, "job.py", "exit", "3", "it's $(x)")
    job_id = submitted_id(done.stdout)
    assert done.returncode == 3, (done.stdout, done.stderr)
    lines = done.stdout.splitlines()
    assert lines[1] == f"log: {lab['root']}/{job_id}.out"
    assert lines[-1] == f"job {job_id} failed (exit 3)"
    assert f"job {job_id} pending" in lines or f"job {job_id} running" in lines

    log = (lab["root"] / f"{job_id}.out").read_text()
    assert "ARGV ['exit', '3', \"it's $(x)\"]" in log and f"CWD {lab['work']}" in log
    assert hpcg(lab, "logs", job_id).stdout == log

    run_dir = lab["root"] / job_id
    assert sorted(p.name for p in run_dir.iterdir()) == ["job.sh", "state.json", "submit.json"]
    record = json.loads((run_dir / "submit.json").read_text())
    assert record["job_name"] == name and record["args"] == ["exit", "3", "it's $(x)"]

    status = json.loads(hpcg(lab, "status", job_id, "--json").stdout)
    assert status["summary"] == "failed (exit 3)" and status["batch"]["state"] == "FAILED"
    assert status["run"]["phase"] == "failed"
    table = hpcg(lab, "status", "--site", "tsub").stdout.splitlines()
    assert table[0].split() == ["JOBID", "SITE", "NAME", "SUBMITTED", "STATE"]
    assert table[1].startswith(f"{job_id} ") and table[1].endswith("failed (exit 3)")


def test_sbatch_options_reach_slurm(lab: dict[str, Path]) -> None:
    name = unique()
    done = hpcg(lab, "sbatch", "--site", "tsub", "-N2", "-c", "1", "-t", "3", "--comment=two words", "-J", name,
                "-W", "job.py")
    assert done.returncode == 0, (done.stdout, done.stderr)
    job_id = submitted_id(done.stdout)
    info = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    for field in ("NumNodes=2", "NumTasks=4", "CPUs/Task=1", "TimeLimit=00:03:00", "Comment=two words",
                  "JobState=COMPLETED", "Partition=cpu"):
        assert field in info, (field, info)


def test_cancel_takes_the_job_out_of_the_queue(lab: dict[str, Path]) -> None:
    done = hpcg(lab, "submit", "--site", "tsub", "-J", unique(), "job.py", "sleep", "120")
    job_id = submitted_id(done.stdout)
    try:
        deadline = time.monotonic() + 120
        while not json.loads(hpcg(lab, "status", job_id, "--json").stdout)["summary"].startswith("running"):
            assert time.monotonic() < deadline, "job did not start"  # pending (Resources) on a busy cluster too
            time.sleep(0.5)
        cancelled = hpcg(lab, "cancel", job_id)
        assert cancelled.returncode == 0 and cancelled.stdout.startswith(f"cancelled job {job_id} (it was running")
        deadline = time.monotonic() + 30
        while active(job_id):
            assert time.monotonic() < deadline, "job still in the queue"
            time.sleep(0.5)
        assert hpcg(lab, "status", job_id).stdout.startswith(f"job {job_id} cancelled")
        assert "already ended (CANCELLED)" in hpcg(lab, "cancel", job_id).stdout
    finally:
        subprocess.run(["scancel", job_id])


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        # sbatch's own refusal (was -p nosuch with --site, which is now refused before sbatch: issue 14)
        (["sbatch", "--site", "tsub", "-C", "nosuch", "job.py"], "Invalid feature specification"),
        (["sbatch", "--site", "tsub", "-p", "nosuch", "job.py"], "-p nosuch: site tsub describes partition cpu's"),
        (["sbatch", "-p", "nosuch", "job.py"], "-p nosuch: no SLURM site uses this partition"),
        (["submit", "--site", "tsub", "--nodes", "3", "job.py"], "--nodes 3: site tsub allows at most 2 nodes"),
        (["sbatch", "--site", "tsub", "-t", "1:00:00", "job.py"], "site tsub allows at most 00:10:00"),
        (["sbatch", "--site", "tsub", "-c", "2", "job.py"], "-c 2: site tsub puts 2 workers on a node"),
        (["submit", "--site", "tsub", "missing.py"], "missing.py does not exist"),
        (["submit", "--site", "nosuch", "job.py"], "unknown site 'nosuch'"),
        (["submit", "--site", "tsub", "-J", "x; rm -rf ~", "job.py"], "job name 'x; rm -rf ~'"),
        (["sbatch", "--site", "tsub", "--gres=gpu:5", "job.py"], "--gpus-per-node 5"),
    ],
)
def test_refusals_are_one_line_and_leave_nothing(lab: dict[str, Path], args: list[str], fragment: str) -> None:
    before = set(os.listdir(lab["work"]))
    one_line_error(hpcg(lab, *args), fragment)
    assert not lab["root"].exists()
    assert set(os.listdir(lab["work"])) == before


def test_a_failure_after_sbatch_cancels_the_job(lab: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from hpc_garage.schedulers import submission

    monkeypatch.setenv("HPC_GARAGE_SITES_PATH", str(lab["sites"]))
    monkeypatch.chdir(lab["work"])

    def full_disk(path: Path, text: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("hpc_garage.files.write_private", full_disk)  # the submit record's write (rundir)
    name = unique()
    with pytest.raises(OSError):
        submission.submit(submission.prepare("tsub", "job.py", ["sleep", "60"], Request(job_name=name)))
    (entry,) = queued_by_name(name)
    job_id, state = entry.split("|")
    assert state in ("CANCELLED", "COMPLETING") or not active(job_id)
    assert not lab["root"].exists()


@pytest.mark.skipif(not shutil.which("qsub"), reason="no qsub (Slurm's Torque wrapper, slurm-wlm-torque) here")
def test_pbs_flavour_through_the_qsub_wrapper(lab: dict[str, Path]) -> None:
    done = hpcg(lab, "submit", "--site", "tpbs", "--wait", "job.py", "exit", "4", "a b")
    m = re.search(r"^submitted job (\S+) \(site tpbs\)\nlog: (\S+)$", done.stdout, re.M)
    assert m, (done.stdout, done.stderr)
    job_id, log = m.groups()
    # the wrapper's qstat shows no Exit_status: the code comes from the state.json `run` writes
    assert done.returncode == 4 and done.stdout.splitlines()[-1] == f"job {job_id} failed (exit 4)"
    assert Path(log).parent == lab["root"] and "ARGV ['exit', '4', 'a b']" in Path(log).read_text()
    assert json.loads(hpcg(lab, "status", job_id, "--json").stdout)["batch"]["state"] == "C"

    done = hpcg(lab, "submit", "--site", "tpbs", "job.py", "sleep", "120")
    job_id = re.search(r"^submitted job (\S+)", done.stdout, re.M).group(1)  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + 60
        while not json.loads(hpcg(lab, "status", job_id, "--json").stdout)["summary"].startswith("running"):
            assert time.monotonic() < deadline, "job did not start"
            time.sleep(0.5)
        assert hpcg(lab, "cancel", job_id).stdout.startswith(f"cancelled job {job_id} (it was running; `qdel {job_id}`)")
        deadline = time.monotonic() + 30
        while active(job_id):
            assert time.monotonic() < deadline, "job still in the queue"
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", job_id])
