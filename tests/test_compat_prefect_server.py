"""compat/prefect_server.py: the managed server's SQLite batches through one cached statement (executemany),
the same rows as Prefect's own multi-row INSERT writes."""

from __future__ import annotations

import asyncio
import datetime
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from hpc_garage.compat import prefect_server


def _events(count: int) -> list[Any]:
    from prefect.server.events.schemas.events import ReceivedEvent

    start = datetime.datetime(2026, 11, 29, 12, tzinfo=datetime.timezone.utc)
    flow_run = str(uuid.UUID(int=7))
    return [ReceivedEvent(
        id=uuid.UUID(int=1000 + i), occurred=start + datetime.timedelta(seconds=i),
        received=start + datetime.timedelta(seconds=i, milliseconds=5), event="prefect.task-run.Completed",
        resource={"prefect.resource.id": f"prefect.task-run.{uuid.UUID(int=100 + i)}", "prefect.resource.name": f"t-{i}"},
        related=[{"prefect.resource.id": f"prefect.flow-run.{flow_run}", "prefect.resource.role": "flow-run"},
                 {"prefect.resource.id": "prefect.tag.dask-resource:CPU=1", "prefect.resource.role": "tag"}][: 1 + i % 2],
        payload={"intended": {"from": "RUNNING", "to": "COMPLETED"}, "i": i}) for i in range(count)]


def _write(url: str, events: list[Any], times: int) -> tuple[list[tuple], list[tuple], list[bool]]:
    """Write `events` `times` times (after the first they are all there) with Prefect's `write_events` into a
    fresh database at `url`; its events and event_resources rows (less the times of writing), and whether each
    INSERT was an executemany."""
    from prefect.server.database import dependencies, provide_database_interface
    from prefect.server.events.storage.database import write_events
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL, temporary_settings

    inserts: list[bool] = []

    def seen(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        if statement.startswith("INSERT"):
            inserts.append(executemany)

    async def run() -> tuple[list[tuple], list[tuple]]:
        db = provide_database_interface()
        await db.create_db()
        engine = await db.engine()
        sa.event.listen(engine.sync_engine, "before_cursor_execute", seen)
        for _ in range(times):
            async with db.session_context(begin_transaction=True) as session:
                await write_events(session, events)
        async with engine.connect() as conn:
            rows = (await conn.execute(sa.text(
                "SELECT id, occurred, event, resource_id, resource, related_resource_ids, related, payload, received, "
                "follows FROM events ORDER BY id"))).all()
            resources = (await conn.execute(sa.text(
                "SELECT event_id, occurred, resource_id, resource_role, resource FROM event_resources "
                "ORDER BY event_id, resource_id"))).all()
        sa.event.remove(engine.sync_engine, "before_cursor_execute", seen)
        await engine.dispose()
        return [tuple(r) for r in rows], [tuple(r) for r in resources]

    saved = dict(dependencies.MODELS_DEPENDENCIES)  # Prefect keeps the first database it was given
    dependencies.MODELS_DEPENDENCIES.clear()
    try:
        with temporary_settings({PREFECT_API_DATABASE_CONNECTION_URL: url}):
            rows, resources = asyncio.run(run())
    finally:
        dependencies.MODELS_DEPENDENCIES.clear()
        dependencies.MODELS_DEPENDENCIES.update(saved)
    return rows, resources, inserts


@pytest.mark.slow  # three fresh Prefect databases: ~20 s
def test_events_written_through_one_statement_are_the_rows_prefect_writes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.server.events.storage import database as storage
    from prefect.server.services import task_run_recorder

    monkeypatch.setattr(storage, "_write_sqlite_events", storage._write_sqlite_events)  # put back after the test
    monkeypatch.setattr(task_run_recorder, "_insert_task_run_states", task_run_recorder._insert_task_run_states)
    events = _events(150)  # more than one of Prefect's safe batches' worth of resources
    prefects, prefects_resources, prefects_inserts = _write(f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}", events, 1)
    assert prefects_inserts and not any(prefects_inserts)  # Prefect's own: multi-row INSERTs
    with pytest.raises(sa.exc.IntegrityError, match="NOT NULL constraint failed: events.occurred"):
        _write(f"sqlite+aiosqlite:///{tmp_path / 'again.db'}", events[:10], 2)  # Prefect's: a batch known already

    assert prefect_server.insert_batches_once_compiled() == ["events", "task-run states"]
    assert prefect_server.insert_batches_once_compiled() == ["events", "task-run states"]  # once is enough
    ours, ours_resources, our_inserts = _write(f"sqlite+aiosqlite:///{tmp_path / 'ours.db'}", events, 2)
    assert our_inserts and all(our_inserts)  # every INSERT an executemany
    assert len(our_inserts) == len(prefects_inserts)  # the same batches; the second write inserted nothing
    assert len(ours) == 150 and len(ours_resources) == 150 + 150 + 75  # written once, though written twice
    assert ours == prefects and ours_resources == prefects_resources


def test_a_function_that_is_not_the_verified_one_runs_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.server.events.storage import database as storage
    from prefect.server.services import task_run_recorder

    before = (storage._write_sqlite_events, task_run_recorder._insert_task_run_states)
    monkeypatch.setattr(storage, "_write_sqlite_events", before[0])
    monkeypatch.setattr(task_run_recorder, "_insert_task_run_states", before[1])
    monkeypatch.setattr(prefect_server, "VERIFIED_SOURCES", {
        key: ("0" * 16, what) for key, (_, what) in prefect_server.VERIFIED_SOURCES.items()})
    assert prefect_server.insert_batches_once_compiled() == []
    assert (storage._write_sqlite_events, task_run_recorder._insert_task_run_states) == before
    monkeypatch.setattr(prefect_server, "VERIFIED_SOURCES", {  # a name or module gone: no error, the server starts
        ("prefect.server.events.storage.database", "_gone"): ("0" * 16, "events"),
        ("prefect.server.no_such_module", "f"): ("0" * 16, "states")})
    assert prefect_server.insert_batches_once_compiled() == []
    monkeypatch.setattr(prefect_server.versions, "in_range", lambda package: False)
    assert prefect_server.insert_batches_once_compiled() == []
