"""Past one scheduler (issue 32, item 5): the limit's line, and `show` (a note) and `submit` (a warning) saying it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.cli_speed import HUGE_SITE
from hpc_garage.core.scheduler_limit import HOW_TO, ONE_SCHEDULER_WORKERS, past_one_scheduler
from tests.conftest import outside_job_env

PER_NODE = 8  # HUGE_SITE: 8 GPUs a node, a worker per GPU
WITHIN = ONE_SCHEDULER_WORKERS // PER_NODE  # nodes whose workers one scheduler holds


def test_the_line_appears_only_past_the_limit() -> None:
    assert past_one_scheduler(ONE_SCHEDULER_WORKERS) is None
    assert past_one_scheduler(1) is None
    line = past_one_scheduler(ONE_SCHEDULER_WORKERS + 1)
    assert line is not None and "\n" not in line
    assert f"{ONE_SCHEDULER_WORKERS + 1:,} workers" in line and f"{ONE_SCHEDULER_WORKERS:,}" in line
    assert HOW_TO in line and "several jobs" in line
    assert past_one_scheduler(11, limit=10) is not None and past_one_scheduler(10, limit=10) is None


def test_how_to_named_by_the_line_exists() -> None:
    assert (Path(__file__).resolve().parents[1] / HOW_TO).is_file()


def _hpcg(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "huge.yaml").write_text(HUGE_SITE)
    env = outside_job_env() | {"HPC_GARAGE_SITES_PATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "hpc_garage", *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def test_show_notes_a_request_past_one_scheduler(tmp_path: Path) -> None:
    past = _hpcg(tmp_path, "show", "--site", "huge", "--nodes", str(WITHIN + 1))
    assert past.returncode == 0, past.stderr
    notes = [line for line in past.stdout.splitlines() if "one Dask scheduler" in line]
    assert len(notes) == 1 and notes[0].startswith(f"note: {(WITHIN + 1) * PER_NODE:,} workers"), past.stdout
    within = _hpcg(tmp_path, "show", "--site", "huge", "--nodes", str(WITHIN))
    assert within.returncode == 0 and "one Dask scheduler" not in within.stdout + within.stderr


def test_submit_warns_and_still_submits(tmp_path: Path) -> None:
    (tmp_path / "sweep.py").write_text("print('hi')\n")
    past = _hpcg(tmp_path, "submit", "--site", "huge", "--nodes", str(WITHIN + 1), "--dry-run", "sweep.py")
    assert past.returncode == 0, past.stderr
    warnings = [line for line in past.stderr.splitlines() if "one Dask scheduler" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: "), past.stderr
    assert "#SBATCH" in past.stdout  # the job script is still written
    within = _hpcg(tmp_path, "submit", "--site", "huge", "--nodes", str(WITHIN), "--dry-run", "sweep.py")
    assert within.returncode == 0 and "one Dask scheduler" not in within.stderr, within.stderr
