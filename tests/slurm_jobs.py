"""Submitting small real jobs to the local SLURM from tests, and waiting for them."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def poll(check: Callable[[], T], timeout: float, failed: str, every: float = 0.1) -> T:
    """`check()`'s first truthy answer within `timeout` s, asked every `every` s; else AssertionError(`failed`).
    A check that raises OSError or ValueError (a file half-written) counts as no answer yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if answer := check():
                return answer
        except (OSError, ValueError):
            pass
        time.sleep(every)
    raise AssertionError(failed)


def wait_gone(job_id: str, timeout: float = 120) -> str:
    """Wait until the job left the queue; return its final state from scontrol."""
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        state = m.group(1) if (m := re.search(r"JobState=(\S+)", out)) else ""
        if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return out
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} still {state} after {timeout} s (cancelled)")


def release_requeued(job_id: str, timeout: float = 60) -> None:
    """Slurm holds a requeued job back (BeginTime, about two minutes after the requeue); as the admin, let it
    start at once: the tests are about what the job does then, not about Slurm's delay."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        if "JobState=PENDING" in out:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
            return
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} was not requeued within {timeout:g} s")


def job_logs(root: Path, lines: int = 80) -> str:
    """The last `lines` of every batch job's log under `root` (`<job id>.out` in a run directory), oldest
    first: what a failing test shows of the jobs it started, since the run's own account of a wind-down or
    a follow-up is there, not in `submit --wait`'s lines."""
    logs = sorted(root.rglob("*.out"), key=lambda p: p.stat().st_mtime)
    parts = []
    for log in logs:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log} (last {len(tail)} lines)\n" + "\n".join(tail))
    return "\n".join(parts) or f"(no job log under {root})"


def exit_code(scontrol_line: str) -> int:
    m = re.search(r"ExitCode=(\d+):(\d+)", scontrol_line)
    assert m, scontrol_line
    return int(m.group(1))


def submit(argv: list[str], script: Path) -> str:
    done = subprocess.run([*argv, str(script)], capture_output=True, text=True, timeout=60, cwd=script.parent)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0].split(".")[0]


def queue_ids() -> set[str]:
    out = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    return set(out.split())


class QueueWatch:
    """Samples squeue in the background: every job seen, its name, node, time limit, the states it was seen
    in, and when it was last seen (`with QueueWatch() as queue: ...; queue.jobs[job_id]`)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.jobs: dict[str, dict] = {}
        self.interval = interval
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> QueueWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def named(self, name: str) -> dict[str, dict]:
        return {j: s for j, s in self.jobs.items() if s["name"] == name}

    def _watch(self) -> None:
        while not self.stop.is_set():
            out = subprocess.run(["squeue", "-h", "-o", "%i|%j|%T|%N|%l"], capture_output=True, text=True).stdout
            now = time.time()
            for line in out.splitlines():
                job, name, state, node, limit = line.split("|")
                seen = self.jobs.setdefault(job, {"states": set(), "node": ""})
                seen.update(name=name, limit=limit, last=now, node=node or seen["node"])
                seen["states"].add(state)
            self.stop.wait(self.interval)
