"""How `hpc-garage worker` stops: within seconds of SIGINT or SIGTERM, however it was started; its jobs go on.

A process that a non-interactive shell starts with `&` (a script, a CI step, a test shard) inherits SIGINT
as *ignored*, and Python then never raises KeyboardInterrupt: a worker that relied on it ran on for minutes
after `kill -INT`, while SIGTERM killed it without its teardown. So both signals are taken here, whatever
they were before: outside Prefect's event loop (starting, waiting to start again) they raise `Stopped`;
inside it they cancel the worker's main task, and Prefect's worker tears down as on Ctrl-C of `prefect
worker start` (its loops stopped, its client closed, its runs cancelled: a run here only follows its batch
job, which goes on, and a worker started again follows it). A second signal, or a teardown still going
after GRACE_SECONDS, ends the process at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable
from types import FrameType

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_SECONDS = 8.0  # the teardown's time (the API told the worker stops); the promise is 10 s in all


class Stopped(BaseException):
    """A stop signal outside the event loop (a BaseException, as KeyboardInterrupt: no `except Exception`
    on its way out holds it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


def exit_code(signum: int) -> int:
    """A process's exit code after a stop signal, as a shell reports one that the signal ended: 130, 143."""
    return 128 + signum


def stop_on_signals() -> None:
    """From now on SIGINT and SIGTERM raise Stopped (SIGINT even where it was ignored)."""
    for sig in SIGNALS:
        signal.signal(sig, _raise_stopped)


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signum)


async def until_signalled(main: Awaitable[None]) -> int | None:
    """Await `main` (Prefect's worker loop) in the current task until a stop signal cancels it; that signal's
    number, or None when `main` ended by itself. Signals go back to `stop_on_signals()` afterwards."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    received: list[int] = []

    def stop(signum: int) -> None:
        name = signal.Signals(signum).name
        if received:
            _exit_now(signum, f"{name} again")
        received.append(signum)
        logger.info("%s: the worker stops (its jobs go on; `hpc-garage worker` started again follows them)", name)
        why = f"still stopping {GRACE_SECONDS:g} s after {name}"
        deadline = threading.Timer(GRACE_SECONDS, _exit_now, (signum, why))
        deadline.daemon = True
        deadline.start()
        task.cancel()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        await main
    except asyncio.CancelledError:
        if not received:
            raise
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
        stop_on_signals()
    return received[0] if received else None


def _exit_now(signum: int, why: str) -> None:
    """The hard stop: no teardown (Prefect's API may not answer); the jobs are not touched either."""
    logger.warning("%s: the worker ends now", why)
    sys.stderr.flush()
    os._exit(exit_code(signum))
