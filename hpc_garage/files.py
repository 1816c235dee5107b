"""Private files, run directories, and their writers' pids: the I/O every layer above the core shares.

A file that holds an address, a key or a token is written readable by its owner only, and atomically, so
no reader ever sees half of it. A file that several processes change is changed under `locked` (or appended
to whole lines at a time). A job's run directory is `<run root>/<job id>/`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def write_private(path: Path, text: str) -> None:
    """Write a file readable by its owner only, atomically: no reader ever sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def append_private(path: Path, lines: list[str]) -> None:
    """Append whole lines to a file readable by its owner only (created so); one write, so lines that several
    processes append do not interleave."""
    if not lines:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def run_root(run_directory: str | Path) -> Path:
    """A site's `run_directory` as a path here: `~` and variables expanded."""
    return Path(os.path.expandvars(str(run_directory))).expanduser()


def run_dir(run_directory: str | Path, job_id: str) -> Path:
    """One job's run directory under its site's run root."""
    return run_root(run_directory) / job_id


def pid_alive(pid: int) -> bool:
    """Whether process `pid` of this host still runs: the writer named in a state or scheduler file."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created 0600) for as long as the block runs; other hosts' processes too,
    where the filesystem supports flock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
