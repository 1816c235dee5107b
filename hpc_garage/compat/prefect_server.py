"""Prefect server's private names, used in the managed server's own process only (prefect/server/serve.py):
the batches its event persister and task-run recorder insert into SQLite go through one cached statement.

Why. Prefect writes each batch of events, event resources and task-run states as one multi-row
`INSERT ... VALUES (...), (...), ...`. SQLAlchemy cannot cache such a statement (its log says "[no key]"), so
it compiles every batch anew, a bind parameter per cell: 12-15 % of the server's CPU in a 10,000-trial run
(py-spy, `bench/results/profiles/20261129-scale-server-inserts.md`). The same rows given to the single-row
statement as executemany are the same rows with the same Python-side defaults, in the same transaction, and
the statement is compiled once per process.

Each replacement is installed only where Prefect's function is the very one verified (the hash of its source:
the same in Prefect 3.8.0 and 3.9.1) and only acts on SQLite; anywhere else Prefect's own function runs.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from hpc_garage.compat import versions
from hpc_garage.compat.versions import uses

logger = logging.getLogger(__name__)

# (module, function) → (the sha256, first 16 hex digits, of the source verified to be replaced; what it inserts)
VERIFIED_SOURCES = {
    ("prefect.server.events.storage.database", "_write_sqlite_events"): ("df0fa1ecaf56fa30", "events"),
    ("prefect.server.services.task_run_recorder", "_insert_task_run_states"): ("4671667badf11227",
                                                                                "task-run states"),
}


def source_hash(function: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


async def _insert(session: Any, statement: Any, rows: list[dict[str, Any]]) -> None:
    """`rows` through one statement, executemany; nothing for no rows (an empty list would insert defaults)."""
    if rows:
        await session.execute(statement, rows)


def _write_sqlite_events(storage: Any) -> Callable[..., Any]:
    """Prefect's `_write_sqlite_events`, each batch's events and their resources as executemany."""
    import sqlalchemy as sa
    from prefect.server.database import db_injector

    @db_injector
    async def write(db: Any, session: Any, events: list[Any]) -> None:
        for batch in storage._in_safe_batches(events):
            found = await session.scalars(sa.select(db.Event.id).where(db.Event.id.in_({e.id for e in batch})))
            known = set(found.all())
            fresh = [event for event in batch if event.id not in known]
            await _insert(session, sa.insert(db.Event.__table__), [event.as_database_row() for event in fresh])
            await _insert(session, sa.insert(db.EventResource.__table__),
                          [row for event in fresh for row in event.as_database_resource_rows()])

    return write


def _insert_task_run_states(recorder: Any, original: Callable[..., Any]) -> Callable[..., Any]:
    """Prefect's `_insert_task_run_states` (insert, skipping a state id already there), executemany on SQLite."""
    from prefect.server.database import db_injector
    from prefect.types._datetime import now

    @db_injector
    async def insert(db: Any, session: Any, task_runs: list[Any]) -> None:
        if db.dialect.name != "sqlite":
            return await original(session, task_runs)
        created = now("UTC")
        statement = db.queries.insert(db.TaskRunState.__table__).on_conflict_do_nothing(index_elements=["id"])
        await _insert(session, statement, [{"created": created, "task_run_id": task_run.id,
                                            **task_run.state.model_dump()} for task_run in task_runs])
        recorder.logger.debug(f"Recorded {len(task_runs)} task run state change(s)")

    return insert


@uses("prefect", "prefect.server.events.storage.database._write_sqlite_events / _in_safe_batches; "
                 "prefect.server.services.task_run_recorder._insert_task_run_states; prefect.types._datetime.now")
def insert_batches_once_compiled() -> list[str]:
    """Replace the verified functions in this process; what their replacements insert ([]: none replaced)."""
    import importlib

    if not versions.in_range("prefect"):
        return []
    replaced = []
    for (module_name, name), (digest, what) in VERIFIED_SOURCES.items():
        try:  # a speed-up only: whatever is not the verified code is left to Prefect, and the server still starts
            module = importlib.import_module(module_name)
            function = getattr(module, name)
            if getattr(function, "hpc_garage", False):  # replaced already
                replaced.append(what)
                continue
            if source_hash(function) != digest:
                raise LookupError("another source")
            replacement = (_write_sqlite_events(module) if name == "_write_sqlite_events"
                           else _insert_task_run_states(module, function))
        except (ImportError, AttributeError, LookupError, OSError) as exc:
            logger.info("Prefect's %s.%s is not the one verified (%s): it runs unchanged", module_name, name, exc)
            continue
        replacement.hpc_garage = True
        setattr(module, name, replacement)
        replaced.append(what)
    return replaced
