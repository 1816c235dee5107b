"""The processes around a managed server, read from /proc: who uses it, which are its own, and stopping them.

A lease (leases/<pid>, with the process's start time against pid reuse) marks a process that was handed the
server; the keeper stops it only when no leaseholder runs. A keeper is signalled only when /proc says it is
ours on our port, and a keeper killed outright is cleaned up through its process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from hpc_garage.files import pid_alive, write_private
from hpc_garage.prefect.server.state import ServerDir, ServerState

children: dict[int, subprocess.Popen[bytes]] = {}  # servers started by this process, to see early exits


def process_alive(pid: int) -> bool:
    """Whether `pid` runs: for a server this process started, whether it has not exited yet."""
    if (child := children.get(pid)) is not None:
        return child.poll() is None  # our own child: poll() also reaps it, a zombie is not alive
    return pid_alive(pid)


def hold_lease(directory: ServerDir) -> None:
    """Mark this process as a user of the server, until it exits (the keeper checks)."""
    directory.leases.mkdir(mode=0o700, exist_ok=True)
    write_private(directory.lease(os.getpid()), str(start_ticks(os.getpid())))


def leases_last_use(directory: ServerDir, now: float) -> float:
    """`now` while a leaseholder runs; else the newest lease's time. Leases of ended processes are removed
    (the keeper calls this)."""
    holders, last = _leases(directory, remove_ended=True)
    return now if holders else last


def leaseholders(directory: ServerDir) -> list[int]:
    """The pids of the processes that hold a lease and still run (a run, a flow, a worker using the server).
    Only reads: `server status` and `server stop` change nothing."""
    return _leases(directory, remove_ended=False)[0]


def _leases(directory: ServerDir, *, remove_ended: bool) -> tuple[list[int], float]:
    """(live leaseholders' pids, the newest lease's time)."""
    holders, last = [], 0.0
    for lease in directory.leases.glob("*"):
        try:
            pid, ticks = int(lease.name), lease.read_text().strip()
            last = max(last, lease.stat().st_mtime)
        except (OSError, ValueError):
            continue
        if pid_alive(pid) and ticks == str(start_ticks(pid)):
            holders.append(pid)
        elif remove_ended:
            lease.unlink(missing_ok=True)
    return sorted(holders), last


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot): a reused pid has another."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def terminate(state: ServerState, grace: float = 10.0) -> bool:
    """Stop the server's whole session (uvicorn and any children); False if it was not running."""
    running = process_alive(state.pid) and _is_our_server(state)
    # a keeper killed outright may leave its children (the server, PostgreSQL) in its process group: a group
    # id is never reused while it has members, so these are its own
    leftovers = not running and bool(_members(state))
    if running or leftovers:
        _signal_group(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while (process_alive(state.pid) or _members(state)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if process_alive(state.pid) or _members(state):
            _signal_group(state.pid, signal.SIGKILL)
    if (child := children.pop(state.pid, None)) is not None:
        child.wait(timeout=5)  # reap it
    return running


def _signal_group(group: int, how: signal.Signals) -> None:
    """Signal the group; its last member may end between our look and the signal (that is no error)."""
    try:
        os.killpg(group, how)
    except ProcessLookupError:
        pass


def _is_our_server(state: ServerState) -> bool:
    """Guard against pid reuse: only our keeper (or an older `prefect server start`) on our port is signalled."""
    try:
        argv = Path(f"/proc/{state.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    ours = b"hpc_garage.prefect.server" in argv and b"keep" in argv
    return (ours or b"prefect" in b" ".join(argv) and b"server" in argv) and str(state.port).encode() in argv


def _members(state: ServerState) -> list[int]:
    """Live processes of the keeper's process group other than itself, if one of them is our server."""
    members, ours = [], False
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int(proc.name) == state.pid:
                continue
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) != state.pid or fields[0] == "Z":
                continue
            members.append(int(proc.name))
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ours = ours or (b"server" in argv and str(state.port).encode() in argv) or argv[0].endswith(b"postgres")
        except (OSError, IndexError, ValueError):
            continue
    return members if ours else []


def stop_child(process: subprocess.Popen[bytes], how: signal.Signals, grace: float) -> None:
    if process.poll() is None:
        process.send_signal(how)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def die_with_parent(how: signal.Signals) -> Callable[[], None]:
    """For Popen's preexec_fn: the child gets `how` when the keeper dies, even by SIGKILL (Linux prctl)."""

    def arrange() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(how), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    return arrange
