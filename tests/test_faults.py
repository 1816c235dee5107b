"""Faults inside one running allocation (issue 11), on the real local SLURM: a node process SIGKILLed
mid-sweep. Trials are counted by the files each one writes (tests/data/fault_sweep.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import DATA, outside_job_env
from tests.slurm_jobs import exit_code, wait_gone

SWEEP = DATA / "fault_sweep.py"
PY = sys.executable
TRIALS, DURATION = 16, 2.0  # 4 GPU workers on 2 nodes: about 8 s of work

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def hpcg(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = outside_job_env()
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=120)


def site_file(tmp_path: Path, mpi: str) -> Path:
    site = tmp_path / "lab-gpu-faults.yaml"
    site.write_text((Path(__file__).parent.parent / "site-configs" / "lab-gpu.yaml").read_text() + f"mpi: {mpi}\n")
    return site


def submit_sweep(tmp_path: Path, site: str | Path) -> tuple[str, Path, Path]:
    marks, out = tmp_path / "marks", tmp_path / "out.json"
    done = hpcg(["submit", "--site", str(site), "--nodes", "2", "--gpus-per-node", "2", "--time", "10", str(SWEEP),
                 "--trials", str(TRIALS), "--duration", str(DURATION), "--marks", str(marks), "--out", str(out)],
                tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job, log = re.search(r"submitted job (\S+)", done.stdout), re.search(r"log: (\S+)", done.stdout)
    assert job and log, done.stdout
    LOGS[job.group(1)] = Path(log.group(1))
    return job.group(1), marks, out


def node_process(job: str, node: int, timeout: float = 90) -> int:
    """The pid of the job's node process for `node` (its last argument), once running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")[:-1]
            except OSError:
                continue
            text = [a.decode(errors="replace") for a in argv]
            if "hpc_garage.launchers.mpi" in text and text[0] != "srun" and text[-1] == str(node) \
                    and f"/{job}/ranks.json" in text[-2]:
                return int(entry.name)
        time.sleep(0.2)
    raise AssertionError(f"no node process for node {node} of job {job}")


def wait_marks(marks: Path, prefix: str, count: int, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marks.is_dir() and len(list(marks.glob(f"{prefix}-*"))) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} {prefix} marks after {timeout} s")


def runs(marks: Path, prefix: str) -> Counter[int]:
    return Counter(int(p.name.split("-")[1]) for p in marks.glob(f"{prefix}-*"))


LOGS: dict[str, Path] = {}


def log_of(tmp_path: Path, job: str) -> str:
    return LOGS[job].read_text(errors="replace")


def kill_node_mid_sweep(tmp_path: Path, site: str | Path, node: int = 1) -> tuple[str, Path, Path, float]:
    job, marks, out = submit_sweep(tmp_path, site)
    pid = node_process(job, node)
    wait_marks(marks, "done", 4)  # the sweep is under way: some trials finished, others running
    os.kill(pid, signal.SIGKILL)
    return job, marks, out, time.time()


def test_a_killed_node_process_takes_only_its_own_workers_and_is_started_again(tmp_path: Path) -> None:
    started = time.monotonic()
    job, marks, out, killed = kill_node_mid_sweep(tmp_path, "lab-gpu")
    final = wait_gone(job, 240)
    elapsed = time.monotonic() - started
    log = log_of(tmp_path, job)
    assert exit_code(final) == 0, log[-4000:]
    summary = json.loads(out.read_text())
    assert summary["result"] == sum(i * i for i in range(TRIALS))
    done = runs(marks, "done")
    assert set(done) == set(range(TRIALS)), done  # 0 trials lost
    print(f"finished trials that ran again: {sum(n - 1 for n in done.values())}; trials started again: "
          f"{sum(runs(marks, 'start').values()) - TRIALS}; {elapsed:.0f} s submit to end (walltime 600 s)")
    assert "node 1 (node2) lost at" in log and "started again (1 of 1 restarts)" in log, log[-4000:]
    # one GPU each, and a restarted worker keeps its pin (which of the node's 4 GPUs depends on what else runs)
    pins: dict[str, set[str]] = {}
    for r in summary["records"]:
        pins.setdefault(r["worker"], set()).add(r["gpu"])
    assert all(len(p) == 1 and next(iter(p)) in ("0", "1", "2", "3") for p in pins.values()), pins
    status = hpcg(["status", job], tmp_path).stdout
    assert re.search(r"lost nodes:\s+node2 at \d\d:\d\d:\d\d \(.*signal 9.*restarted\)", status), status
    assert elapsed < 300, elapsed  # walltime is 600 s; on this 2-core machine start-up alone takes 10-30 s


def test_without_restarts_the_sweep_completes_on_the_other_node(tmp_path: Path) -> None:
    job, marks, out, killed = kill_node_mid_sweep(tmp_path, site_file(tmp_path, "{node_restarts: 0}"))
    final = wait_gone(job, 240)
    log = log_of(tmp_path, job)
    assert exit_code(final) == 0, log[-4000:]
    summary = json.loads(out.read_text())
    assert summary["result"] == sum(i * i for i in range(TRIALS))
    assert set(runs(marks, "done")) == set(range(TRIALS))
    assert all("-n0-" in r["worker"] for r in summary["records"] if r["start"] > killed + 1)
    assert "node 1 (node2) lost at" in log and "started again" not in log, log[-4000:]


def test_a_site_that_says_stop_ends_the_run_at_once_and_non_zero(tmp_path: Path) -> None:
    job, marks, out, killed = kill_node_mid_sweep(tmp_path, site_file(tmp_path, "{on_node_loss: stop}"))
    final = wait_gone(job, 120)
    ended = time.time()
    log = log_of(tmp_path, job)
    assert exit_code(final) != 0, log[-4000:]
    assert "stopping the run: node 1 (node2) was lost and the site's mpi.on_node_loss is stop" in log, log[-4000:]
    assert ended - killed < 45, ended - killed  # not walltime (600 s)
    assert not out.exists()
    status = hpcg(["status", job], tmp_path).stdout
    assert "lost nodes:" in status and "node2" in status, status
