"""The scheduler-file handoff between `hpc-garage run` and the user's flow.

In the job's run directory (rundir.py owns its names and its clean-up):
  scheduler.json   Dask's scheduler-file format (`Client(scheduler_file=…)` reads its `address`) plus an
                   `hpc_garage` section: job id, TLS file paths, the Prefect API, the workers started. It is
                   written last, once every worker has registered, so its presence means "ready". 0600.
                   COMMAND starts before that (its imports overlap the workers' start) and waits for it.
  tls/             per-job key and certificate (Security.temporary), 0600: without them a client is refused.
  dask-scheduler.json  what the Dask scheduler itself writes; internal.
The flow finds the file through $HPC_GARAGE_SCHEDULER_FILE, which `run` exports to COMMAND.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_garage.core.errors import UserError
from hpc_garage.files import pid_alive
from hpc_garage.rundir import RunDir
from hpc_garage.schedulers.job_env import job_id
from hpc_garage.variables import JOB_ID_ENV, SCHEDULER_FILE_ENV, START_TIMEOUT, seconds

if TYPE_CHECKING:
    from distributed.security import Security

HALF_WRITTEN_SECONDS = 3.0  # how long a scheduler file that is not valid JSON may still be being written


@dataclass(frozen=True)
class Handoff:
    """What a client needs to use the cluster a job started."""

    address: str
    job_id: str
    tls: dict[str, str] | None = None  # Security keyword arguments (file paths); None for --insecure
    prefect_api_url: str | None = None
    workers: list[str] = field(default_factory=list)
    site: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        # top-level keys are Dask's scheduler-file format; ours live under "hpc_garage"
        return {
            "type": "Scheduler",
            "address": self.address,
            "hpc_garage": {
                "job_id": self.job_id,
                "tls": self.tls,
                "prefect_api_url": self.prefect_api_url,
                "workers": self.workers,
                "site": self.site,
                "created": time.time(),
                "host": socket.gethostname(),  # with pid: a file whose run has died is recognised as stale
                "pid": os.getpid(),
                **self.extra,
            },
        }

    def security(self) -> Security | None:
        if self.tls is None:
            return None
        from distributed.security import Security

        return Security(require_encryption=True, **self.tls)

    @classmethod
    def read(cls, path: str | Path, *, expect_job: str | None = None, timeout: float = 0,
             given_up: Callable[[], bool] = lambda: False) -> Handoff:
        """Read a scheduler file, waiting up to `timeout` s for it (less if `given_up()`: its writer stopped);
        refuse one from another job."""
        path = Path(path).expanduser()
        deadline, broken_since = time.monotonic() + timeout, 0.0
        while True:
            try:
                data = json.loads(path.read_text())
                break
            except IsADirectoryError:
                raise UserError(f"scheduler file {path} is a directory; point {SCHEDULER_FILE_ENV} at the "
                                "scheduler.json inside a run directory") from None
            except PermissionError:
                raise UserError(f"scheduler file {path} is not readable by you (it belongs to another user's "
                                "job?); use your own job's scheduler.json") from None
            except UnicodeDecodeError:
                raise UserError(f"scheduler file {path} is not text; point {SCHEDULER_FILE_ENV} at the "
                                "scheduler.json that `hpc-garage run` wrote") from None
            except FileNotFoundError:
                if given_up():
                    raise UserError(f"`hpc-garage run` stopped before its workers were up (no {path}); "
                                    "see its messages above") from None
                if time.monotonic() >= deadline:
                    waited = f" after waiting {timeout:.0f} s" if timeout else ""
                    raise UserError(
                        f"scheduler file {path} does not exist{waited}; is `hpc-garage run` up for this job? "
                        f"(unset {SCHEDULER_FILE_ENV} to use a local cluster)"
                    ) from None
            except json.JSONDecodeError:
                # a file being written is whole within milliseconds: one still broken after that was left broken
                broken_since = broken_since or time.monotonic()
                if time.monotonic() >= min(deadline, broken_since + HALF_WRITTEN_SECONDS):
                    raise UserError(f"scheduler file {path} is not valid JSON; delete it and rerun the job") from None
            time.sleep(0.05)
        ours = data.get("hpc_garage") if isinstance(data, dict) else None
        if not isinstance(ours, dict) or not isinstance(data.get("address"), str):
            raise UserError(f"{path} is not an hpc-garage scheduler file (no 'hpc_garage' section); point "
                            f"{SCHEDULER_FILE_ENV} at the scheduler.json that `hpc-garage run` wrote")
        if expect_job and str(ours.get("job_id")) != str(expect_job):
            raise UserError(
                f"scheduler file {path} belongs to job {ours.get('job_id')}, not this job {expect_job}; "
                "it is left over from an earlier job: rerun, or point at this job's run directory"
            )
        _refuse_stale(path, ours)
        return cls(
            address=data["address"],
            job_id=str(ours.get("job_id")),
            tls=ours.get("tls"),
            prefect_api_url=ours.get("prefect_api_url"),
            workers=list(ours.get("workers") or []),
            site=ours.get("site"),
        )


def _refuse_stale(path: Path, ours: dict[str, Any]) -> None:
    """A scheduler file left by a run that is gone (killed, or its node lost) is said to be stale at once,
    rather than after a connect timeout: its writer's process is gone, or its TLS files are."""
    if ours.get("host") == socket.gethostname() and isinstance(ours.get("pid"), int) and not pid_alive(ours["pid"]):
        raise UserError(f"scheduler file {path} is stale: the `hpc-garage run` that wrote it (pid {ours['pid']}) "
                        "has ended; rerun the job, or delete the file")
    tls = ours.get("tls")
    if tls is not None and not isinstance(tls, dict):
        raise UserError(f"scheduler file {path} is damaged (its 'tls' entry is not a mapping); delete it and rerun")
    missing = [str(v) for v in (tls or {}).values() if not Path(str(v)).is_file()]
    if missing:
        raise UserError(f"scheduler file {path} is stale: its run's TLS credentials are gone ({missing[0]}); the "
                        "run that wrote it has ended: rerun the job")


def workers_now(client: Any) -> dict[str, dict[str, Any]]:
    """Every worker the scheduler has now (address → its info), asked of the scheduler itself.

    Not `client.scheduler_info(n_workers=-1)["workers"]`: that returns an attribute the client's own 2-s
    refresh overwrites with a copy that lists no worker, so a thread can read none while there are six.
    """
    return dict(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def handoff_from_env(env: Mapping[str, str] | None = None, timeout: float | None = None) -> Handoff | None:
    """The cluster this process was handed through $HPC_GARAGE_SCHEDULER_FILE, or None when it is unset.

    Under `hpc-garage run` this waits while the workers start: as long as `run` gives them, and no longer
    than `run` itself is starting (its state.json says when it gave up)."""
    env = os.environ if env is None else env
    path = env.get(SCHEDULER_FILE_ENV)
    if not path:
        return None
    if timeout is None:
        timeout = seconds(env, START_TIMEOUT, 60) + 30
    rundir = RunDir.of_this_run(env)

    def given_up() -> bool:
        return rundir is not None and (rundir.state() or {}).get("phase") in ("failed", "done")

    # under `run`, its job; else the batch job this process runs in: another job's file is refused
    expect = env.get(JOB_ID_ENV) or job_id(env)
    return Handoff.read(path, expect_job=expect, timeout=timeout, given_up=given_up)


ANNOUNCED = ("hpc-garage", "announced")  # the scheduler's metadata: trials each flow's runner said it will submit


def announce_trials(client: Any, runner: str, count: int) -> None:
    """A flow's runner tells the scheduler how many trials it has been given so far (its maps' lengths): the
    back-pressure holds most of a big map in the flow, where the scheduler's progress (`status`'s total, waiting
    and ETA) would not see them. Bookkeeping: never fails the flow."""
    try:
        client.set_metadata([*ANNOUNCED, runner], int(count))
    except Exception:  # noqa: BLE001 - a busy or closing scheduler: the progress counts what it sees
        pass


def announced_trials(scheduler: Any) -> int:
    """The scheduler side: the trials every runner announced (announce_trials), 0 where none did."""
    try:
        said = scheduler.get_metadata(keys=list(ANNOUNCED), default={})
    except Exception:  # noqa: BLE001 - never fails the progress
        return 0
    return sum(v for v in said.values() if isinstance(v, int)) if isinstance(said, dict) else 0
