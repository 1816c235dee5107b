"""The managed server's own process: Prefect's `prefect server start`, with SQLite finding task runs by index.

Prefect's task-run recorder looks up each batch of task runs by their natural key,
`(flow_run_id, task_key, dynamic_key) IN (...)`. SQLAlchemy spells that for SQLite as
`IN (VALUES (?, ?, ?), ...)`, and SQLite (3.40, Debian's) answers it by reading the whole task_run table: two
scans per batch, so the server's CPU per trial grew with every trial recorded (12 ms a query at 2,000 task runs,
20 ms at 4,500; a 100,000-trial sweep's last 1,000 trials took 3× its second 1,000). The same rows as a
subquery, `IN (SELECT * FROM (VALUES ...))`, are looked up in the table's unique index on those columns: about
1 ms at any size. Same rows, same answer; only the query plan changes.

And where SQLite is the database, the batches Prefect's event persister and task-run recorder insert go through
one cached statement (compat.insert_batches_once_compiled: executemany, not a multi-row INSERT compiled anew).

And Prefect's line per event it drops (its in-memory bus holds 10,000 events a subscriber; on a busy SQLite its
event persister falls behind: a 2-node job of 10,000 trivial trials dropped about half of its 30,000 events)
becomes one line a minute with the count (`DroppedEvents`): rendered one by one they took a tenth of the server's
CPU (py-spy) and 41 MB of its log per 100,000 trials.

keeper.py starts it as `python -m hpc_garage.prefect.server prefect server start --host … --port …`.
"""

from __future__ import annotations

import atexit
import logging
import re
import sys
import threading
import time
from typing import Any, Callable

from hpc_garage import log

logger = logging.getLogger(__name__)

# `IN (VALUES (?, ?), (?, ?))` made of placeholders only: nothing else SQLAlchemy writes has this shape. Prefect's
# engine uses the `named` paramstyle (`(:param_1_1_1, :param_1_1_2)`), plain SQLAlchemy `qmark`: either is one.
_PLACEHOLDER = r"(?:\?|:[A-Za-z_][A-Za-z0-9_]*)"
_ROW = rf"\({_PLACEHOLDER}(?:, {_PLACEHOLDER})*\)"
_VALUES_LIST = re.compile(rf"IN \(VALUES ({_ROW}(?:, {_ROW})*)\)")
_said: list[bool] = []  # the first rewrite is said once in the server's log


def indexed_tuple_in(statement: str) -> str:
    """The statement with each tuple `IN (VALUES ...)` list as a subquery SQLite can answer from an index."""
    return _VALUES_LIST.sub(r"IN (SELECT * FROM (VALUES \1))", statement)


def _rewrite(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
             executemany: bool) -> tuple[str, Any]:
    if conn.dialect.name == "sqlite" and "IN (VALUES (" in statement:
        statement = indexed_tuple_in(statement)
        if not _said:
            _said.append(True)
            logger.info("SQLite: task runs are looked up by their natural key's index (hpc-garage)")
    return statement, parameters


# Prefect's loggers and the start of the line each logs per event dropped (3.8, 3.9: tests check their source)
DROP_LINES = {"prefect.server.utilities.messaging.memory": "Subscription queue is full, dropping message",
              "prefect.server.events.services.event_persister": "Event queue full"}
DROPS_SAID_EVERY = 60.0  # s between two lines saying how many events were dropped


class DroppedEvents(logging.Filter):
    """Prefect's per-event "dropping" lines, said as one line per DROPS_SAID_EVERY with their count."""

    def __init__(self, starts: str, every: float = DROPS_SAID_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.starts, self.every, self.clock = starts, every, clock
        self.dropped = self.total = 0  # since the last line said; in all
        self.said: float | None = None
        self._lock = threading.Lock()  # the server's loop counts, say_the_rest's thread says

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.starts):
            return True
        with self._lock:
            self.dropped += 1
            self.total += 1
            now = self.clock()
            if self.said is not None and now - self.said < self.every:
                return False
            record.msg, record.args = self.SAYS, (self.starts, self.dropped, self.total)
            self.dropped, self.said = 0, now
        return True

    SAYS = ("%s: %d event(s) dropped since this was last said, %d in all (a subscriber of Prefect's server fell "
            "behind, on SQLite most often its event persister: the event feed lacks them; hpc-garage says this once "
            "a minute)")

    def flush(self, logger: logging.Logger) -> None:
        """The drops not yet said (a minute on, or the server is stopping)."""
        with self._lock:
            if not self.dropped:
                return
            self.said, dropped, self.dropped = self.clock(), self.dropped, 0
        logger.warning(self.SAYS, self.starts, dropped, self.total)

    def say_the_rest(self, logger: logging.Logger) -> None:
        """Each `every` s, the drops not yet said (none may follow to say them), until the process ends."""
        while True:
            time.sleep(self.every)
            self.flush(logger)


def quiet_drops() -> None:
    """One `DroppedEvents` on each of Prefect's loggers that says a line per event dropped."""
    for name, starts in DROP_LINES.items():
        found = logging.getLogger(name)
        if not any(isinstance(f, DroppedEvents) for f in found.filters):
            quiet = DroppedEvents(starts)
            found.addFilter(quiet)
            atexit.register(quiet.flush, logger)
            threading.Thread(target=quiet.say_the_rest, args=(logger,), daemon=True, name="hpc-garage-drops").start()


def install() -> None:
    """For every SQLAlchemy engine of this process (Prefect's async ones included, through their sync engine)."""
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    if not event.contains(Engine, "before_cursor_execute", _rewrite):
        event.listen(Engine, "before_cursor_execute", _rewrite, retval=True)


def main(argv: list[str]) -> int:
    """Prefect's own command line (`prefect server start ...`), in this process, with the rewrite installed."""
    log.setup(clock=True)  # hpc-garage's lines (this module's, compat's) in the server's log, beside Prefect's
    install()
    quiet_drops()
    from hpc_garage.compat import insert_batches_once_compiled

    if replaced := insert_batches_once_compiled():
        logger.info("SQLite: each batch of %s is inserted through one cached statement (hpc-garage)",
                    " and ".join(replaced))
    from prefect.cli import app

    sys.argv = ["prefect", *argv]
    app()
    return 0
