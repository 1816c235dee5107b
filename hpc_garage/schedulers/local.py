"""The `local` batch system: no queue, the machine you are on (a laptop, a login node, a test runner).

A `hpc-garage run` outside a batch job is a job all the same: its id is `local-YYYYmmdd-HHMMSS-PID` (`job_id`),
its run directory holds submit.json (scheduler `local`, the host it runs on), so `status`, `cancel`, `resume`
and `report` find it as they find a submitted job. It runs while that process lives on its host: the pid is
checked here only where it started no later than its id says (a recycled pid is another process), and a run
on another host (another login node) is known from its state file alone (schedulers/submission/finding.py).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_garage.core.errors import UserError
from hpc_garage.schedulers.base import WIND_DOWN_SIGNAL, BatchSystem, JobStatus

if TYPE_CHECKING:
    from hpc_garage.core.allocation import Allocation
    from hpc_garage.core.site import Site

LOCAL_ID = re.compile(r"local-(\d{8}-\d{6})-(\d+)")
# seconds a run's process may have started after the time its id names and still be that run: the id is written
# just after the start, and its local time read back across a daylight-saving change is an hour off
START_SLACK = 3600.0 + 10.0


def job_id(now: float | None = None, pid: int | None = None) -> str:
    """A run's id outside a batch job: when it started (local time, as a person reads it) and its pid."""
    return f"local-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{os.getpid() if pid is None else pid}"


class Local(BatchSystem):
    name = "local"
    takes_jobs = False

    def allocation_from_env(self, env: Mapping[str, str], site: Site) -> Allocation:
        from hpc_garage.core.allocation import Allocation

        return Allocation.from_request(site)

    def status(self, job_id: str) -> JobStatus | None:
        """RUNNING while the run's process lives on this host; None once it is gone (or never ran here)."""
        parsed = _parse(job_id)
        if parsed is None or not _is_the_run(*parsed):
            return None
        pid = parsed[0]
        return JobStatus(job_id=job_id, state="RUNNING", phase="running", reason=f"pid {pid} on {socket.gethostname()}")

    def cancel_argv(self, job_id: str) -> list[str]:
        """SIGTERM to the run, as the batch systems' cancel: it stops COMMAND and tears its workers down."""
        return ["kill", "-TERM", str(self._pid(job_id))]

    def wind_down_argv(self, job_id: str) -> list[str] | None:
        """WIND_DOWN_SIGNAL to the run: one given a walltime (`run --walltime`, a login-node driver) winds down
        on it as a job does; one without has no grace to give, noted in its state file, so `cancel` sends
        SIGTERM at once instead (submission.wind_down_grace)."""
        return ["kill", f"-{WIND_DOWN_SIGNAL}", str(self._pid(job_id))]

    def _pid(self, job_id: str) -> int:
        parsed = _parse(job_id)
        if parsed is None:
            raise UserError(f"job {job_id} is not a run outside a batch job (their ids are local-DATE-TIME-PID)")
        return parsed[0]


def _parse(job_id: str) -> tuple[int, float] | None:
    """(pid, the start its id names, epoch seconds) of a run's id; None for any other id."""
    found = LOCAL_ID.fullmatch(job_id)
    if found is None:
        return None
    return int(found.group(2)), time.mktime(time.strptime(found.group(1), "%Y%m%d-%H%M%S"))


def _is_the_run(pid: int, named: float) -> bool:
    """Whether process `pid` is the run whose id names start `named`: alive, an hpc-garage process, and started
    by then (Linux's /proc; elsewhere, alive is all that can be told)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: not this user's run
    proc = Path("/proc") / str(pid)
    if not proc.is_dir():
        return True
    try:
        command = (proc / "cmdline").read_bytes().split(b"\0")
        started = _started_at(proc)
    except OSError:
        return False  # it ended meanwhile
    if not any(b"hpc-garage" in part or b"hpc_garage" in part for part in command):
        return False
    return started is None or started <= named + START_SLACK


def _started_at(proc: Path) -> float | None:
    """When the process started (epoch seconds), from its stat and the boot time; None where not readable."""
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22, starttime, counted after the command's closing parenthesis
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
