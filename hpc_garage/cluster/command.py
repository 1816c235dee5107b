"""COMMAND, the child `hpc-garage run` serves: started, the signals `run` receives handed on to it, its exit code.

Signals follow the run's phases. Until COMMAND runs, SIGINT/SIGTERM stop the start-up (`stop_on_signals`);
while it runs they go to COMMAND first, so that the flow can finish its bookkeeping, and still stop a start-up
under way (`start_command`); during teardown they are ignored (`on_signals` with a handler that only says so), so that
teardown completes and no worker job is left in the queue.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

from hpc_garage.launchers.common import end_process
from hpc_garage.variables import SCHEDULER_FILE_ENV

__all__ = ["command_exit", "end_command", "on_signals", "start_command", "stop_on_signals"]


def on_signals(handler: Callable[[int], Any]) -> None:
    """SIGINT and SIGTERM to `handler(sig)`, on the running loop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handler, sig)


def stop_on_signals() -> list[int]:
    """Until COMMAND runs, SIGINT/SIGTERM cancel the current task (the start-up, which then tears down what
    it started); the signals received, appended to the list returned."""
    main = asyncio.current_task()
    received: list[int] = []

    def stop(sig: int) -> None:
        received.append(sig)
        if main is not None:
            main.cancel()

    on_signals(stop)
    return received


async def start_command(command: list[str], env: dict[str, str], interrupted: list[int],
                on_signal: Callable[[int], None] | None = None) -> asyncio.subprocess.Process:
    """Start COMMAND; from now on SIGINT/SIGTERM to `run` go to COMMAND first (and `on_signal`), and while the
    scheduler file is not published yet they also stop the start-up (appended to `interrupted`)."""
    proc = await asyncio.create_subprocess_exec(*command, env=env)
    main = asyncio.current_task()

    def forward(sig: int) -> None:
        if on_signal is not None:
            on_signal(sig)
        if proc.returncode is None:
            proc.send_signal(sig)
        if not os.path.exists(env[SCHEDULER_FILE_ENV]):
            interrupted.append(sig)  # still starting up: stop that too
            if main is not None:
                main.cancel()

    on_signals(forward)
    return proc


async def command_exit(proc: asyncio.subprocess.Process) -> int:
    """COMMAND's exit code as a shell reports it: killed by signal N is 128+N."""
    code = await proc.wait()  # the handlers stay until teardown installs its own: no moment without one
    return 128 - code if code < 0 else code


async def end_command(proc: asyncio.subprocess.Process) -> None:
    """COMMAND outlived a failed start-up: it is waiting for a cluster that will not come."""
    await end_process(proc, ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)))
