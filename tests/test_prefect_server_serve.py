"""prefect/server/serve.py: the managed server's process, whose SQLite finds task runs by their natural key's
index instead of reading the whole table for each batch the task-run recorder writes."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from hpc_garage.prefect.server import serve


def test_a_tuple_in_list_of_placeholders_becomes_a_subquery_and_nothing_else_changes() -> None:
    assert serve.indexed_tuple_in("SELECT t.id FROM t WHERE t.id IN (?, ?) OR (t.a, t.b) IN (VALUES (?, ?), (?, ?))") \
        == "SELECT t.id FROM t WHERE t.id IN (?, ?) OR (t.a, t.b) IN (SELECT * FROM (VALUES (?, ?), (?, ?)))"
    assert serve.indexed_tuple_in("x IN (VALUES (?, ?, ?)) AND y IN (VALUES (?, ?, ?))") \
        == "x IN (SELECT * FROM (VALUES (?, ?, ?))) AND y IN (SELECT * FROM (VALUES (?, ?, ?)))"
    # Prefect's engine (paramstyle `named`) spells the same statement with named placeholders
    assert serve.indexed_tuple_in("WHERE t.id IN (:id_1_1) OR (t.a, t.b) IN (VALUES (:param_1_1_1, :param_1_1_2), "
                                  "(:param_1_2_1, :param_1_2_2))") \
        == ("WHERE t.id IN (:id_1_1) OR (t.a, t.b) IN (SELECT * FROM (VALUES (:param_1_1_1, :param_1_1_2), "
            "(:param_1_2_1, :param_1_2_2)))")
    for unchanged in ("INSERT INTO t (a, b) VALUES (?, ?), (?, ?)", "SELECT 1 WHERE x IN (?, ?)",
                      "SELECT 1 WHERE (a, b) IN (VALUES (1, ?))", "SELECT 1 WHERE (a, b) IN (VALUES (?, ?), (?, 'x'))",
                      "INSERT INTO t (a, b) VALUES (:a_m0, :b_m0), (:a_m1, :b_m1)",
                      "SELECT 1 WHERE (a, b) IN (VALUES (:a, 1))", "SELECT 1 WHERE (a, b) IN (VALUES (:a, :b), (:c, 'x'))"):
        assert serve.indexed_tuple_in(unchanged) == unchanged


def _table(metadata: sa.MetaData) -> sa.Table:
    """task_run's shape where it matters: an id and a unique natural key."""
    return sa.Table("task_run", metadata, sa.Column("id", sa.String, primary_key=True),
                    sa.Column("flow_run_id", sa.String), sa.Column("task_key", sa.String),
                    sa.Column("dynamic_key", sa.String), sa.Column("padding", sa.String),
                    sa.UniqueConstraint("flow_run_id", "task_key", "dynamic_key", name="uq_natural_key"))


def _lookup(table: sa.Table, keys: list[tuple[str, str, str]]) -> sa.Select:
    """The recorder's existence check: `id IN (...) OR (flow_run_id, task_key, dynamic_key) IN (...)`."""
    return sa.select(table.c.id).where(sa.or_(table.c.id.in_(["absent"]), sa.tuple_(
        table.c.flow_run_id, table.c.task_key, table.c.dynamic_key).in_(keys)))


def _plan(path: Path, statement: str, parameters: tuple) -> str:
    import sqlite3

    with sqlite3.connect(path) as db:
        return " | ".join(row[3] for row in db.execute(f"EXPLAIN QUERY PLAN {statement}", parameters))


@pytest.mark.parametrize(("driver", "paramstyle"), [("sqlite", "qmark"), ("sqlite+aiosqlite", "named")])
def test_the_natural_key_lookup_uses_the_index_and_finds_the_same_rows(driver: str, paramstyle: str,
                                                                       tmp_path: Path) -> None:
    """Through plain SQLAlchemy (`?` placeholders) and as Prefect's server makes its engine (aiosqlite, paramstyle
    `named`: `:param_1_1_1`; before the rewrite knew that form, Prefect's lookups went unrewritten)."""
    serve.install()
    serve.install()  # once is enough: installed twice, it rewrites once
    metadata = sa.MetaData()
    table = _table(metadata)
    rows = [{"id": f"id-{i}", "flow_run_id": "f", "task_key": f"trial-{i % 7}", "dynamic_key": str(i),
             "padding": "x" * 200} for i in range(3000)]
    keys = [("f", f"trial-{i % 7}", str(i)) for i in range(0, 3000, 29)] + [("f", "trial-0", "absent")]
    seen: list[tuple[str, tuple]] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:  # noqa: ANN001
        if statement.startswith("SELECT"):
            seen.append((statement, parameters))

    url = f"{driver}:///{tmp_path / 'prefect.db'}"
    if driver == "sqlite":
        engine = sa.create_engine(url)
        sa.event.listen(engine, "before_cursor_execute", record)
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(table.insert(), rows)
            found = {r[0] for r in conn.execute(_lookup(table, keys))}
    else:
        async def run() -> set[str]:
            from prefect.server.database.configurations import AioSqliteConfiguration

            engine = await AioSqliteConfiguration(connection_url=url).engine()  # Prefect's server's own engine
            assert engine.dialect.paramstyle == paramstyle
            sa.event.listen(engine.sync_engine, "before_cursor_execute", record)
            async with engine.begin() as conn:
                await conn.run_sync(metadata.create_all)
                await conn.execute(table.insert(), rows)
                found = {r[0] for r in await conn.execute(_lookup(table, keys))}
            await engine.dispose()
            return found

        found = asyncio.run(run())
    assert found == {f"id-{i}" for i in range(0, 3000, 29)}
    statement, parameters = seen[-1]
    assert "IN (SELECT * FROM (VALUES (" in statement and ("?" if paramstyle == "qmark" else ":param_1_1_1") in statement
    plan = _plan(tmp_path / "prefect.db", statement, parameters)
    assert "SEARCH task_run USING INDEX sqlite_autoindex_task_run_2" in plan and "SCAN task_run" not in plan, plan
    # without the rewrite, SQLite reads the whole table for the same statement
    unrewritten = statement.replace("IN (SELECT * FROM (VALUES ", "IN (VALUES ").replace(")))", "))")
    assert "SCAN task_run" in _plan(tmp_path / "prefect.db", unrewritten, parameters)


FLOW = """
import sys
from prefect import flow, task

@task
def trial(i: int) -> int:
    return i

@flow
def sweep() -> list[int]:
    return [f.result() for f in trial.map(range(5))]

sys.exit(0 if sweep() == list(range(5)) else 1)
"""


@pytest.mark.slow
def test_the_managed_server_records_task_runs_through_the_rewrite(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A real managed server (SQLite): a flow's task runs are recorded, and its recorder's lookups were
    rewritten (said once in the server's log)."""
    import base64
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    from hpc_garage.prefect.server import ServerDir, ensure_api, stop_server

    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_HOME", "PREFECT_API_AUTH_STRING"):
        monkeypatch.delenv(name, raising=False)
    api = ensure_api()
    try:
        done = subprocess.run([sys.executable, "-c", FLOW], env={**os.environ, **api}, capture_output=True,
                              text=True, timeout=300, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

        def ask(path: str, body: bytes | None = b"{}") -> Any:
            request = urllib.request.Request(
                api["PREFECT_API_URL"] + path, data=body, method="POST" if body is not None else "GET",
                headers={"Content-Type": "application/json", "Authorization": "Basic "
                         + base64.b64encode(api["PREFECT_API_AUTH_STRING"].encode()).decode()})
            return json.loads(opener.open(request, timeout=10).read())

        deadline = time.monotonic() + 60
        while (count := ask("/task_runs/count")) < 5 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert count == 5
        # each task run's states, recorded from its events (compat.prefect_server's executemany on SQLite)
        for task_run in ask("/task_runs/filter"):
            states = ask(f"/task_run_states/?task_run_id={task_run['id']}", None)
            assert [s["type"] for s in states] == ["PENDING", "RUNNING", "COMPLETED"], states
            assert states[-1]["id"] == task_run["state"]["id"]
        said = ServerDir.of().log_file.read_text()
        assert said.count("task runs are looked up by their natural key's index (hpc-garage)") == 1, said[-3000:]
        assert said.count("each batch of events and task-run states is inserted through one cached statement") == 1
    finally:
        stop_server()


def test_prefects_line_per_dropped_event_becomes_one_line_a_minute_with_the_count() -> None:
    """Prefect's own in-memory bus, one subscriber's queue full: 25 events dropped over 3 minutes are said in 4
    lines (the first at once, then at most one a minute, the rest as the server stops), each with the count since
    the last and in all."""
    import logging

    from prefect.server.utilities.messaging.memory import MemoryMessage, Topic

    name, starts = next(iter(serve.DROP_LINES.items()))
    bus = logging.getLogger(name)
    now = [0.0]
    quiet = serve.DroppedEvents(starts, every=60.0, clock=lambda: now[0])
    said: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    bus.addFilter(quiet)
    bus.addHandler(catch)
    try:
        subscription = Topic("events-test").subscribe()
        for i in range(subscription._queue.maxsize):
            subscription._queue.put_nowait(MemoryMessage(data=b"{}", attributes={}))

        async def deliver(count: int) -> None:
            for _ in range(count):
                await subscription.deliver(MemoryMessage(data=b"{}", attributes={}))

        for seconds, count in ((0.0, 10), (30.0, 5), (61.0, 4), (185.0, 6)):
            now[0] = seconds
            asyncio.run(deliver(count))
        quiet.flush(bus)
        quiet.flush(bus)  # nothing left to say
    finally:
        bus.removeFilter(quiet)
        bus.removeHandler(catch)
    assert [line.split(" event(s)")[0] for line in said] == [f"{starts}: {n}" for n in (1, 15, 4, 5)], said
    assert [line.split("last said, ")[1].split(" (")[0] for line in said] == [f"{n} in all" for n in (1, 16, 20, 25)]


def test_the_dropping_lines_quieted_are_the_ones_prefect_logs() -> None:
    """The start of each line matched is in the source of Prefect's module that logs it (a reworded line would
    go unquieted, each event on a line of its own again)."""
    import importlib
    import inspect
    import logging

    for name, starts in serve.DROP_LINES.items():
        assert starts in inspect.getsource(importlib.import_module(name)), name
    serve.quiet_drops()
    serve.quiet_drops()  # once per logger however often it is called
    for name in serve.DROP_LINES:
        assert sum(isinstance(f, serve.DroppedEvents) for f in logging.getLogger(name).filters) == 1


def test_drops_that_no_later_drop_says_are_said_by_the_timer_within_its_period() -> None:
    """The last drops of a burst (none follows to say them) are said by `say_the_rest`'s thread."""
    import logging
    import re
    import threading
    import time

    starts = serve.DROP_LINES["prefect.server.utilities.messaging.memory"]
    quiet = serve.DroppedEvents(starts, every=0.05)
    said: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    out = logging.getLogger("tests.drops")
    out.addHandler(catch)
    out.propagate = False
    for _ in range(4):
        record = logging.LogRecord("bus", logging.WARNING, __file__, 1, starts + " for topic=%r", ("events",), None)
        if quiet.filter(record):
            out.handle(record)
    threading.Thread(target=quiet.say_the_rest, args=(out,), daemon=True).start()

    def counted() -> int:
        return sum(int(re.search(r": (\d+) event\(s\) dropped", line)[1]) for line in said)

    deadline = time.monotonic() + 10
    while counted() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    out.removeHandler(catch)
    assert counted() == 4 and said[-1].split("last said, ")[1].startswith("4 in all"), said


def test_the_docs_say_what_the_server_does_with_the_events_it_drops() -> None:
    """docs/how-to/large-jobs.md, literally: Prefect's bound, the line a minute and its words."""
    from pathlib import Path

    from prefect.server.utilities.messaging.memory import Subscription, Topic

    text = " ".join((Path(__file__).parents[1] / "docs" / "how-to" / "large-jobs.md").read_text().split())
    assert Subscription(Topic("docs-test"))._queue.maxsize == 10_000 and "past 10,000 events waiting" in text
    assert serve.DROPS_SAID_EVERY == 60.0 and "once a minute" in text
    assert "event(s) dropped since this was last said, N in all" in text
    assert "event(s) dropped since this was last said, %d in all" in serve.DroppedEvents.SAYS
