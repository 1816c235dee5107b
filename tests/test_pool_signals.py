"""How `hpc-garage worker` stops (hpc_garage/prefect/pool_signals.py), on a stand-in for Prefect's worker loop:
SIGINT (even where it was ignored) and SIGTERM cancel the loop, whose teardown runs; outside the loop they
raise Stopped; a second signal or a teardown that hangs ends the process at once. The real worker, following a
real job, is in test_work_pool.py (SLURM)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PY = sys.executable

# the stand-in: a loop that says when it is up, runs until cancelled, and tears down (for TEARDOWN s) after
LOOP = """
import asyncio, sys, time
from hpc_garage import log
from hpc_garage.prefect import pool_signals
log.setup()
pool_signals.GRACE_SECONDS = {grace}

async def worker_loop():
    print("started", flush=True)
    try:
        await asyncio.sleep(3600)
    finally:
        await asyncio.sleep({teardown})  # Prefect's teardown tells the API the worker stops
        print("torn down", flush=True)

pool_signals.stop_on_signals()
try:
    signum = asyncio.run(pool_signals.until_signalled(worker_loop()))
    print("after the loop", flush=True)
    time.sleep({after})  # the restart wait of `serve`: a signal here raises Stopped
    sys.exit(0)
except pool_signals.Stopped as stopped:
    print(f"stopped outside the loop by {{stopped}}", flush=True)
    sys.exit(stopped.exit_code)
"""


def _start(tmp_path: Path, ignored_sigint: bool, grace: float = 8, teardown: float = 0,
           after: float = 0) -> tuple[subprocess.Popen[str], int, Path]:
    """The stand-in started from `bash -c '... &'` (SIGINT ignored, as scripts/test's shards start pytest) or
    directly; what to wait on, its pid, its output."""
    script, out = tmp_path / "loop.py", tmp_path / "out.txt"
    script.write_text(LOOP.format(grace=grace, teardown=teardown, after=after))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    if ignored_sigint:
        proc = subprocess.Popen(["bash", "-c", f"{PY} {script} >{out} 2>&1 & echo $!; wait $!"], env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        pid = int(proc.stdout.readline())
    else:
        with out.open("w") as sink:
            proc = subprocess.Popen([PY, str(script)], env=env, stdout=sink, stderr=subprocess.STDOUT, text=True)
        pid = proc.pid
    deadline = time.monotonic() + 60
    while "started" not in (out.read_text() if out.exists() else ""):
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text() if out.exists() else ""
        time.sleep(0.05)
    return proc, pid, out


def test_started_with_ampersand_from_a_script_sigint_is_ignored_which_the_worker_must_overcome() -> None:
    done = subprocess.run(["bash", "-c", "grep SigIgn /proc/self/status & wait"], capture_output=True, text=True)
    assert int(done.stdout.split()[1], 16) & (1 << (signal.SIGINT - 1))


@pytest.mark.parametrize("ignored_sigint", [True, False], ids=["bash &", "Popen"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_cancels_the_loop_whose_teardown_runs(tmp_path: Path, ignored_sigint: bool,
                                                       sig: signal.Signals) -> None:
    proc, pid, out = _start(tmp_path, ignored_sigint)
    os.kill(pid, sig)
    assert proc.wait(10) == 0, out.read_text()  # the loop ended by the signal; the stand-in goes on, exits 0
    assert out.read_text().splitlines()[-2:] == ["torn down", "after the loop"]
    assert f"{sig.name}: the worker stops" in out.read_text()


def test_a_signal_outside_the_loop_raises_stopped_with_the_shells_exit_code(tmp_path: Path) -> None:
    """After the loop (the wait before a restart), the signals are taken still: SIGINT, ignored at the start."""
    proc, pid, out = _start(tmp_path, ignored_sigint=True, after=60)
    os.kill(pid, signal.SIGTERM)  # the first ends the loop
    deadline = time.monotonic() + 10
    while "after the loop" not in out.read_text():
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(0.05)
    os.kill(pid, signal.SIGINT)
    assert proc.wait(10) == 128 + signal.SIGINT, out.read_text()
    assert "stopped outside the loop by SIGINT" in out.read_text()


def test_a_teardown_that_hangs_ends_the_process_after_the_grace(tmp_path: Path) -> None:
    proc, pid, out = _start(tmp_path, ignored_sigint=True, grace=1, teardown=60)
    signalled = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    assert proc.wait(10) == 128 + signal.SIGTERM, out.read_text()
    assert time.monotonic() - signalled < 5
    assert "still stopping 1 s after SIGTERM: the worker ends now" in out.read_text()
    assert "torn down" not in out.read_text()


def test_a_second_signal_ends_the_process_at_once(tmp_path: Path) -> None:
    proc, pid, out = _start(tmp_path, ignored_sigint=True, teardown=60)
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + 10
    while "SIGINT: the worker stops" not in out.read_text():
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(0.05)
    os.kill(pid, signal.SIGINT)
    assert proc.wait(5) == 128 + signal.SIGINT, out.read_text()
    assert "SIGINT again: the worker ends now" in out.read_text()
