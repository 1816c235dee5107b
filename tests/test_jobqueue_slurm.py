"""The jobqueue launcher on the real local SLURM: worker jobs through sbatch, pinned GPUs, two pools on one
scheduler, adaptive scaling, lifetimes, and an empty queue after every kind of ending."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import DATA, outside_job_env
from tests.slurm_jobs import QueueWatch, poll

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

PY = sys.executable
SWEEP = Path(__file__).resolve().parent.parent / "examples" / "sweep.py"
PROBE = DATA / "jobqueue_probe.py"
LAB = {"scheduler": "slurm", "launcher": "jobqueue", "queue": "gpu", "walltime": "00:10:00", "interface": "lo",
       "node": {"cores": 8, "memory": "15GiB", "gpus": 4}, "workers": {"per": "gpu", "reserve_memory": "512MiB"}}


def clean_env(**extra: str) -> dict[str, str]:
    env = outside_job_env()
    return env | extra


def write_site(directory: Path, name: str, **jobqueue: object) -> dict[str, str]:
    """A lab site in a private directory; returns the environment that finds it."""
    directory.mkdir(exist_ok=True)
    (directory / f"{name}.yaml").write_text(json.dumps({**LAB, "jobqueue": {"gpus_per_job": 2, **jobqueue}}))
    return clean_env(HPC_GARAGE_SITES_PATH=str(directory))


def in_queue(ids: list[str]) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    return [i for i in ids if i in out]


def run_dir_of(stderr: str) -> Path:
    m = re.search(r"logs in (\S+)/worker-logs", stderr)
    assert m, stderr[-3000:]
    return Path(m.group(1))


def worker_jobs(run_dir: Path) -> dict:
    return json.loads((run_dir / "worker-jobs.json").read_text())


def wait_submitted(run_dir: Path, jobs: int, timeout: float = 60) -> None:
    """Until the run's record holds `jobs` worker job ids (sbatch answered: the jobs are in the queue)."""
    poll(lambda: len([j for j in worker_jobs(run_dir).get("jobs", []) if j.get("job_id")]) >= jobs, timeout,
         f"{jobs} worker jobs not submitted after {timeout} s (see {run_dir})")


def hpcg_run(site: str, command: list[str], env: dict[str, str], cwd: Path,
             timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_garage", "run", "--site", site, "--", *command], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=timeout)


# ------------------------------------------------------------------------------------------------ the sweep


def test_sweep_through_a_driver_job_on_worker_jobs_with_one_gpu_per_worker(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    with QueueWatch() as queue:
        done = subprocess.run([PY, "-m", "hpc_garage", "submit", "--site", "lab-jobqueue", "--wait", str(SWEEP),
                               "--gpu", "yes", "--seeds", "4", "--duration", "0.5", "--out", str(out)],
                              capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    driver = re.search(r"submitted job (\S+)", done.stdout).group(1)  # type: ignore[union-attr]
    summary = json.loads(out.read_text())
    assert summary["result"] == summary["expected"] and summary["experiments"] == 8 and summary["gpu"] is True

    # the worker jobs were real batch jobs, named after the driver job, seen running in squeue
    ours = queue.named(f"hpcg-lab-jobqueue-{driver}")
    assert len(ours) == 2 and all("RUNNING" in s["states"] for s in ours.values()), queue.jobs
    run_dir = Path.home() / ".hpc-garage" / "runs" / driver
    jobs = {j["name"]: j for j in worker_jobs(run_dir)["jobs"]}
    assert {j["job_id"] for j in jobs.values()} == set(ours)

    # one GPU per experiment, two different GPUs inside each two-GPU worker job, no GPU shared in time
    by_job: dict[str, set[str]] = defaultdict(set)
    spans: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for r in summary["records"]:
        device, job = r["cuda_visible_devices"], r["worker"].rsplit("-", 1)[0]
        assert device and "," not in device, r
        by_job[job].add(device)
        node = ours[jobs[job]["job_id"]]["node"]
        spans[(node, device)].append((r["start"], r["end"]))
    assert all(len(devices) == 2 for devices in by_job.values()), by_job
    for intervals in spans.values():
        intervals.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(intervals, intervals[1:])), intervals
    assert in_queue([driver, *ours]) == []


# ------------------------------------------------------------------------------------------------ two pools


def test_two_pools_on_one_scheduler_place_every_task_on_its_pool(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    done = hpcg_run("lab-pools", [PY, str(PROBE), str(out), "--gpu", "4", "--bigmem", "2", "--plain", "6"],
                    clean_env(), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    kinds: dict[str, set[str]] = defaultdict(set)
    for r in records:
        kinds[r["kind"]].add(r["worker"])
    assert kinds["gpu"] == {"gpu-0-0", "gpu-0-1"}  # GPU=1: the gpu pool (partition gpu), both of its workers
    assert kinds["bigmem"] == {"cpu-0"} and kinds["plain"] == {"cpu-0"}  # never in a GPU worker's slot
    assert sorted(r["cuda"] for r in records if r["kind"] == "gpu") in (["0", "0", "1", "1"], ["2", "2", "3", "3"])
    assert all(r["cuda"] is None for r in records if r["kind"] != "gpu")
    jobs = worker_jobs(run_dir_of(done.stderr))["jobs"]
    partitions = {j["name"]: subprocess.run(["scontrol", "show", "job", "-o", j["job_id"]], capture_output=True,
                                            text=True).stdout for j in jobs}
    assert "Partition=gpu" in partitions["gpu-0"] and "Partition=cpu" in partitions["cpu-0"]
    assert in_queue([j["job_id"] for j in jobs]) == []


# ------------------------------------------------------------------------------------------------- adaptive


def test_adaptive_pool_grows_with_the_work_and_cancels_idle_jobs(tmp_path: Path) -> None:
    env = write_site(tmp_path / "sites", "jq-adaptive", minimum_jobs=0, maximum_jobs=3, max_jobs_in_queue=3,
                     idle_timeout="3s")
    out = tmp_path / "a.json"
    done = hpcg_run("jq-adaptive", [PY, str(PROBE), str(out), "--gpu", "12", "--duration", "2", "--watch"],
                    env | {"PROBE_SHRINK_WAIT": "60"}, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "0 workers registered" in done.stderr  # minimum_jobs 0: COMMAND starts at once
    probe = json.loads(out.read_text())
    counts = [n for _, n in probe["samples"]]
    data = worker_jobs(run_dir_of(done.stderr))
    assert counts[0] == 0 and max(counts) == 6 and counts[-1] == 0, (counts, data["events"], done.stderr[-2000:])
    assert len(probe["records"]) == 12
    data = worker_jobs(run_dir_of(done.stderr))
    events = [(e["event"], e["job"]) for e in data["events"]]
    assert sum(1 for e, _ in events if e == "submitted") == 3  # maximum_jobs, never more
    assert sum(1 for e, _ in events if e == "retire") == 3  # idle jobs retired while COMMAND still ran
    live, most = 0, 0
    for event, _ in events:
        live += {"submitted": 1, "retire": -1, "cancel": -1, "ended": -1, "failed": -1}.get(event, 0)
        most = max(most, live)
    assert most <= 3
    assert in_queue([j["job_id"] for j in data["jobs"]]) == []


def test_workers_retire_before_the_walltime_and_are_replaced_ahead(tmp_path: Path) -> None:
    # 90 s walltime, retire 78 s before it: each job's workers live ~12 s, so the work spans generations
    env = write_site(tmp_path / "sites", "jq-life", jobs=1, lifetime_margin="78s", lifetime_stagger=0)
    (tmp_path / "sites" / "jq-life.yaml").write_text(
        (tmp_path / "sites" / "jq-life.yaml").read_text().replace('"00:10:00"', '"00:01:30"'))
    out = tmp_path / "l.json"
    done = hpcg_run("jq-life", [PY, str(PROBE), str(out), "--gpu", "30", "--duration", "1"], env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]  # no KilledWorker: a replacement was there in time
    records = json.loads(out.read_text())["records"]
    assert len(records) == 30 and len({r["job"] for r in records}) >= 2
    events = [(e["event"], e["job"]) for e in worker_jobs(run_dir_of(done.stderr))["events"]]
    first_expiring = events.index(("expiring", "jq-life-0"))
    # its replacement is submitted in the same step (a 12-s life drains at once: its window is past half of it)
    assert ("submitted", "jq-life-1") in events[first_expiring + 1:first_expiring + 3], events
    assert events.index(("submitted", "jq-life-1")) < events.index(("retired", "jq-life-0"))  # drained, retired


# -------------------------------------------------------------------------------------- nothing left behind


@pytest.mark.parametrize("how, when, code", [
    ("exit 3", None, 3),
    (signal.SIGINT, "worker jobs:", 130),  # Ctrl-C while the worker jobs are queued
    (signal.SIGINT, "registered", 130),  # Ctrl-C while COMMAND runs (it gets the signal, then teardown)
    (signal.SIGTERM, "worker jobs:", 143),  # scancel of a driver job, or kill
])
def test_nothing_is_left_in_the_queue_after_a_failed_or_interrupted_run(tmp_path: Path, how: object,
                                                                        when: str | None, code: int) -> None:
    command = ["sh", "-c", "exit 3"] if how == "exit 3" else ["sleep", "300"]  # COMMAND starts with the workers
    proc = subprocess.Popen([PY, "-m", "hpc_garage", "run", "--site", "lab-jobqueue", "--", *command],
                            stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=tmp_path)
    lines = []
    assert proc.stderr is not None
    for line in proc.stderr:
        lines.append(line)
        if when and when in line:
            if when == "worker jobs:":  # the line comes before the first scaling step submits them
                wait_submitted(run_dir_of(line), 2)
            time.sleep(0.3)
            proc.send_signal(how)  # type: ignore[arg-type]
            break
    lines.append(proc.stderr.read())
    assert proc.wait(timeout=120) == code, "".join(lines)
    stderr = "".join(lines)
    assert "Traceback" not in stderr, stderr
    data = worker_jobs(run_dir_of(stderr))
    ids = [j["job_id"] for j in data["jobs"] if j["job_id"]]
    assert len(ids) == 2 and in_queue(ids) == []
    state = json.loads((run_dir_of(stderr) / "state.json").read_text())
    assert state["phase"] in ("done", "failed") and not (run_dir_of(stderr) / "jobqueue-lab-jobqueue.json").exists()
