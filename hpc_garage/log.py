"""hpc-garage's messages: the `hpc_garage` logger and the one handler that writes its `hpc-garage: …` lines.

Every module logs through its own `logging.getLogger(__name__)`, as distributed and dask-jobqueue do, so that
a user tunes, silences or redirects hpc-garage with standard logging. A library that logs only that way
says nothing by default (Python drops INFO, and prints warnings bare), yet these lines are how a job's log
tells its story (workers up, a node lost, winding down, the report). So each process hpc-garage starts or
enters calls `setup()` once: `hpc-garage run`, a node or worker-job process (`launchers.common.run_entry`),
the Prefect server's keeper, a flow's task runner, a Dask worker's first Prefect task. It gives the
`hpc_garage` logger this handler, INFO and up, on whatever stderr is when a line is written (so in the job
log, and in a test's capture); a process forked after that inherits it.

The user's own configuration wins: a level already set on `hpc_garage` is kept, and a logger that already
has a handler (the user's) gets none. The level words (`warning: `, `error: `) come from the record's level,
so a handler of the user's own shows the plain message.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Literal, TextIO

ROOT = "hpc_garage"  # the logger every module's logger is a child of
LABEL = "hpc-garage"  # what each line starts with

_lock = threading.Lock()


class LineFormatter(logging.Formatter):
    """`hpc-garage: text`, `hpc-garage: warning: text`, `hpc-garage: error: text`: the lines users and tests
    know. A traceback, where one was logged, follows on its own lines."""

    def __init__(self, label: str = LABEL, clock: bool = False) -> None:
        super().__init__()
        self.label = label
        self.clock = clock  # `label [HH:MM:SS]: text`, for a long-lived daemon's own log file

    def format(self, record: logging.LogRecord) -> str:
        head = self.label
        if self.clock:
            head += f" [{time.strftime('%H:%M:%S', time.localtime(record.created))}]"
        level = "error: " if record.levelno >= logging.ERROR else "warning: " if record.levelno >= logging.WARNING \
            else ""
        text = f"{head}: {level}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text


class LineHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to `sys.stderr` (or `sys.stdout`) as it is at each line, not as it was at set-up: a
    redirected stream or a test's capture gets the line. Flushed per line (StreamHandler does)."""

    def __init__(self, stream: Literal["stderr", "stdout"] = "stderr") -> None:
        logging.Handler.__init__(self)
        self._stream_name = stream

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return getattr(sys, self._stream_name)

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.setStream; the stream is always looked up
        pass


def setup(*, label: str = LABEL, clock: bool = False,
          stream: Literal["stderr", "stdout"] = "stderr") -> logging.Logger:
    """Give the `hpc_garage` logger the line handler, once per process (idempotent); the logger.

    Left alone where it has a handler already (this one, or the user's own). Its level becomes INFO unless
    one was set; it stops propagating, or a root handler (Prefect's console handler in a flow) would print
    each line a second time in another format."""
    logger = logging.getLogger(ROOT)
    with _lock:
        if logger.handlers:
            return logger
        handler = LineHandler(stream)
        handler.setFormatter(LineFormatter(label, clock))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
