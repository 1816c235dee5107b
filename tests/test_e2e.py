"""The sweep end to end, as a user runs it: login node, `submit --wait`, the sbatch wrapper, two nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from tests.conftest import outside_job_env

SWEEP = Path(__file__).resolve().parent.parent / "examples" / "sweep.py"
PY = sys.executable

pytestmark = pytest.mark.slow


def hpcg(args: list[str], cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    env = outside_job_env()
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def check_placement(summary: dict, *, gpus: bool) -> dict[str, list]:
    """Right result; every GPU experiment saw exactly one GPU; no GPU ran two experiments at once."""
    assert summary["result"] == summary["expected"] and summary["experiments"] == len(summary["records"])
    by_gpu: dict[tuple[str, str], list] = defaultdict(list)
    for r in summary["records"]:
        if gpus:
            device = r["cuda_visible_devices"]
            assert device is not None and device.strip() and "," not in device, r
            node = r["worker"].rsplit("-gpu", 1)[0]  # `<job>-n<node>`: fake nodes share one hostname
            by_gpu[(node, device)].append((r["start"], r["end"]))
    for spans in by_gpu.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])), spans
    return by_gpu


def test_login_node_run_of_the_sweep(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = hpcg(["run", "--site", "lab-gpu", "--", PY, str(SWEEP), "--gpu", "yes", "--seeds", "3",
                 "--duration", "0.3", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["gpu"] is True and summary["experiments"] == 6
    # no real GPUs here: the workers advertise GPU=1 but see none, and the sweep is still placed one per worker
    assert {r["cuda_visible_devices"] for r in summary["records"]} == {""}
    assert summary["result"] == summary["expected"]


@pytest.mark.slurm
def test_submit_wait_runs_the_sweep_one_experiment_per_gpu(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = hpcg(["submit", "--site", "lab-gpu", "--gpus-per-node", "2", "--wait", str(SWEEP), "--gpu", "yes",
                 "--seeds", "4", "--duration", "0.5", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    by_gpu = check_placement(json.loads(out.read_text()), gpus=True)
    assert {device for _, device in by_gpu} == {"0", "1"}


@pytest.mark.slurm
def test_sbatch_wrapper_runs_the_same_sweep(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = hpcg(["sbatch", "-p", "gpu", "--gres=gpu:2", "-t", "10", "--wait", str(SWEEP), "--gpu", "yes",
                 "--seeds", "3", "--duration", "0.3", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    check_placement(json.loads(out.read_text()), gpus=True)


@pytest.mark.slurm
def test_two_nodes_two_gpus_each_run_experiments_on_both(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = hpcg(["submit", "--site", "lab-gpu", "--nodes", "2", "--gpus-per-node", "2", "--wait", str(SWEEP),
                 "--gpu", "yes", "--seeds", "6", "--duration", "0.5", "--out", str(out)], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(out.read_text())
    by_gpu = check_placement(summary, gpus=True)
    assert len(summary["workers"]) == 4
    assert {node.rsplit("-", 1)[-1] for node, _ in by_gpu} == {"n0", "n1"}


def test_garage_guides_four_tag_task_is_placed_on_workers_that_hold_it(tmp_path: Path) -> None:
    import ast

    env = outside_job_env()
    done = subprocess.run([PY, str(SWEEP.parent / "garage_tags.py")], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [ast.literal_eval(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(records) == 4
    for r in records:
        res = r["resources"]
        assert res["GPU"] >= 1 and res["CPU"] >= 18 and res["MEMORY"] >= 10e9 and res["PROCESS"] >= 1
