"""Private files, the paths a site file names, and their writers' pids: the I/O every layer above the core shares.

A file that holds an address, a key or a token is written readable by its owner only, and atomically, so
no reader ever sees half of it. A file that several processes change is changed under `locked` (or appended
to whole lines at a time). Where runs live and what a run directory holds is rundir.py's.
A JSON file another process writes is read with `read_json`: missing, half-written or not an object is None.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError


def write_private(path: Path, text: str | Iterable[str]) -> None:
    """Write a file readable by its owner only, atomically: no reader ever sees half of it. `text` may come in
    pieces (a report of 300,000 trials is written a trial at a time, never held as one string)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines([text] if isinstance(text, str) else text)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, path)


def write_json(path: Path, data: Any, *, indent: int | None = None) -> None:
    """`data` as JSON in a private file, atomically (`write_private`)."""
    write_private(path, json.dumps(data, indent=indent))


def read_json(path: Path, *, broken: str | None = None) -> dict[str, Any] | None:
    """A JSON object from `path`; None when there is none. A file that exists but cannot be read or is not
    JSON is None too (its writer may still be at it, or was killed), unless `broken` says why it matters: then
    it is refused in one line, `broken` being the hint (what wrote it, what to do)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        if broken is None:
            return None
        raise UserError(f"{path} cannot be read ({exc}); {broken}") from None
    return data if isinstance(data, dict) else None


def read_secrets(path: str, source: str) -> dict[str, str]:
    """Environment variables kept out of every job script (an API's auth string): a JSON object of names to
    values in a private file of this user's. Anything else is refused in one line naming `source` (the
    variable that named the file): a secret others may read is no longer one, and a job without its API's
    credentials would only fail later, less clearly."""
    where = f"{source}={path}"
    try:
        info = os.stat(path)
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{where}: no such file; the process that submitted this job writes it before submitting "
                        "(a deployment's worker); run the flow run again") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{where} cannot be read ({exc}); run the flow run again") from None
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise UserError(f"{where}: mode {info.st_mode & 0o777:o}, owner uid {info.st_uid}: a file of secrets must "
                        f"be yours and private; `chmod 600 {path}`")
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise UserError(f"{where} is not a JSON object of variable names and values; run the flow run again")
    return data


def append_private(path: Path, lines: list[str]) -> None:
    """Append whole lines to a file readable by its owner only (created so); one write, so lines that several
    processes append do not interleave."""
    if not lines:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def expand_path(configured: str | Path) -> Path:
    """A directory a site file names (`run_directory`, `results_directory`) as a path here: `~` and variables
    expanded, as the shell would."""
    return Path(os.path.expandvars(str(configured))).expanduser()


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
