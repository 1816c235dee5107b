"""What every launcher does the same way: worker options from a WorkerSpec, and waiting for workers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

from hpc_garage.errors import UserError
from hpc_garage.layout import WorkerSpec


def worker_options(spec: WorkerSpec, *, env: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    """Keyword arguments for a distributed Nanny that starts exactly this worker."""
    return {
        "name": spec.name,
        "nthreads": spec.nthreads,
        "memory_limit": spec.memory_limit,
        "resources": dict(spec.resources),
        "env": {**(env or {}), **spec.env},
        **extra,
    }


async def wait_for_workers(
    registered: Callable[[], Iterable[str]],
    expected: list[str],
    timeout: float,
    *,
    alive: Callable[[], str | None] = lambda: None,
    progress: Callable[[int, int], None] = lambda k, n: None,
) -> None:
    """Wait until every expected worker name has registered; name the missing ones on timeout.

    `alive()` returns a reason when the processes that should bring the workers up have died, so a crash
    is reported at once instead of after the timeout.
    """
    deadline = time.monotonic() + timeout
    last = -1
    while True:
        present = set(map(str, registered()))
        missing = [name for name in expected if name not in present]
        if len(expected) - len(missing) != last:
            last = len(expected) - len(missing)
            progress(last, len(expected))
        if not missing:
            return
        if reason := alive():
            raise UserError(f"workers did not start: {reason}; missing {_names(missing)}")
        if time.monotonic() > deadline:
            raise UserError(
                f"{len(missing)} of {len(expected)} workers did not register within {timeout:.0f} s: "
                f"{_names(missing)}; see the job log, or raise --timeout"
            )
        await asyncio.sleep(0.1)


def _names(names: list[str]) -> str:
    return ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


class Launcher:
    """Starts a plan's workers against a running scheduler, says if they died, and stops them."""

    scheduler_host: dict[str, Any] = {"host": "127.0.0.1"}  # Scheduler(...) keywords: where it listens
    command_env: dict[str, str] = {}  # exported to COMMAND besides the scheduler file

    async def start(self, address: str, tls: dict[str, str] | None, worker_env: dict[str, str],
                    rundir: Any) -> None:
        raise NotImplementedError

    def failure(self) -> str | None:
        """Why the workers cannot come up any more (their launcher exited), or None."""
        return None

    def draining(self) -> None:
        """Teardown begins: the workers are about to leave on purpose, so nothing may replace them."""

    async def stop(self) -> None:
        raise NotImplementedError

    def abandon(self) -> None:
        """Last resort once the event loop is gone (a teardown cut short): release what outlives this
        process, such as batch jobs. Must be synchronous, quick, and safe to call after `stop`."""


def security_from(tls: dict[str, str] | None) -> Any:
    """A distributed Security from the run directory's TLS files; None means plain tcp (--insecure)."""
    if tls is None:
        return None
    from distributed.security import Security

    return Security(require_encryption=True, **tls)
