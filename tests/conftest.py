"""Shared test set-up: the `slurm` marker, and helpers to build sites in tmp dirs."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


@functools.cache
def slurm_reachable() -> str | None:
    """None if a SLURM controller answers here, else why not."""
    if not shutil.which("sinfo"):
        return "sinfo is not installed"
    try:
        done = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=15)
    except subprocess.TimeoutExpired:
        return "sinfo timed out"
    if done.returncode != 0:
        return f"sinfo failed: {done.stderr.strip()}"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "slurm" in item.keywords and (why := slurm_reachable()):
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM test cannot run under CI: {why} (scripts/local-slurm up should have started it)")
        pytest.skip(f"no SLURM reachable: {why}; run scripts/local-slurm up")


@pytest.fixture
def site_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private site directory first on the search path."""
    d = tmp_path / "sites"
    d.mkdir()
    monkeypatch.setenv("HPC_GARAGE_SITES_PATH", str(d))
    return d


def read_env_dump(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    return env


_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without running atexit handlers once pytest has reported.

    Prefect's API log and event workers drain at interpreter exit with no time limit; after a test module has
    stopped its Prefect server they retry for ever ("Still processing items"), and the finished run never exits.
    """
    import sys

    if _exit_status and "prefect" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])
