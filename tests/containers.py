"""The container tests' image, site file and checks (tests/test_container_slurm.py, tests/test_work_pool.py):
a Charliecloud directory image built by scripts/container-image, whose Python has `garage_image_probe`, which
the host's lacks, and the sweep tests/data/container_sweep.py, whose flow and trials report from inside."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.conftest import outside_job_env

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "tests" / "data" / "container_sweep.py"
PY = sys.executable
IMAGE_PYTHON = "/opt/python/bin/python3"


def build_image(path: Path) -> Path:
    """scripts/container-image into `path`."""
    if shutil.which("ch-run") is None:
        pytest.fail("ch-run not found: install charliecloud (scripts/test installs it)")
    done = subprocess.run(["bash", str(ROOT / "scripts" / "container-image"), str(path)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHON": PY, "USER": os.environ.get("USER", "root")})
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def site_file(tmp_path: Path, image: Path, *, runs: bool = True, **extra: str) -> Path:
    """A site whose container is `image` under Charliecloud, its run directories under tmp_path/runs (`runs`;
    else HOME's), and the sweep copied beside it (the working directory and the site's folder are bound)."""
    lines = {"scheduler": "local", "node": "{cores: 4, memory: 8GiB, gpus: 2}", "workers": "{per: gpu}"} | extra
    container = (f"{{runtime: charliecloud, image: {image}, python: {IMAGE_PYTHON}, gpus: none, "
                 "binds: [/run/munge]}")  # srun inside (the mpi launcher) authenticates through munged
    text = "".join(f"{k}: {v}\n" for k, v in lines.items())
    path = tmp_path / "ct.yaml"
    path.write_text(text + (f"run_directory: {tmp_path}/runs\n" if runs else "") + f"container: {container}\n")
    shutil.copy(SWEEP, tmp_path / SWEEP.name)  # in the working directory, which `run` binds (the checkout is not)
    return path


def hpcg(args: list[str], cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpc_garage", *args], capture_output=True, text=True, cwd=cwd,
                          env={**outside_job_env(), "USER": os.environ.get("USER", "root")}, timeout=timeout)


def check_inside(out: Path, seeds: int) -> list[dict]:
    """The sweep's summary: the right result, and the flow and every trial ran in the image's Python."""
    summary = json.loads(out.read_text())
    assert summary["result"] == summary["expected"] and len(summary["records"]) == seeds
    assert summary["flow_image"] == "hpc-garage-test-image" and summary["flow_python"] == IMAGE_PYTHON
    for r in summary["records"]:
        assert r["image"] == "hpc-garage-test-image" and r["in_image"] and r["python"] == IMAGE_PYTHON, r
    return summary["records"]
