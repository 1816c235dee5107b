"""compat/: the one gate to other packages' private names, and its agreement with pyproject.toml."""

from __future__ import annotations

import asyncio
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from hpc_garage import compat
from hpc_garage.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_bounds_are_the_verified_ranges() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    specs = {re.split(r"[<>=!~\[ ]", d, maxsplit=1)[0].lower(): d for d in dependencies}
    for package, (low, high) in compat.VERIFIED.items():
        assert specs[package].replace(" ", "") == f"{package}>={low},<{high}", package
    low, high = compat.VERIFIED["distributed"]
    assert specs["dask"].replace(" ", "") == f"dask>={low},<{high}"  # dask moves with distributed (noxfile.py)


def test_installed_versions_are_verified() -> None:
    assert compat.uses_outside_range() == []
    assert all(compat.in_range(p) for p in compat.VERIFIED)


def test_every_use_names_a_verified_package() -> None:
    assert compat.USES and all(u.package in compat.VERIFIED for u in compat.USES)


@pytest.mark.parametrize(("installed", "inside"), [("0.3.7", True), ("0.3.99", True), ("0.4.0", False),
                                                   ("0.3.6", False), ("(not installed)", False)])
def test_range_edges(installed: str, inside: bool) -> None:
    assert compat.in_range("prefect-dask", installed) is inside


def test_a_missing_private_name_is_one_line_not_an_attribute_error() -> None:
    class NotARunner:
        pass

    with pytest.raises(compat.CompatError) as caught:
        compat.runner_started(NotARunner())
    message = str(caught.value)
    assert isinstance(caught.value, UserError) and "\n" not in message
    assert "prefect-dask" in message and "_started" in message and ">=0.3.7,<0.4.0" in message


def test_a_missing_private_coroutine_is_a_compat_error() -> None:
    with pytest.raises(compat.CompatError, match="_correct_state"):
        asyncio.run(compat.correct_state(object()))


def test_fallbacks_leave_behaviour_alone_outside_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    import distributed.utils

    monkeypatch.setattr(compat.versions, "in_range", lambda package, installed=None: False)
    monkeypatch.setattr(distributed.utils, "_forkserver_preload_set", False, raising=False)
    assert compat.skip_forkserver_optional_preload() is False
    assert distributed.utils._forkserver_preload_set is False
    assert compat.stretch_no_tag_limits_cache(60.0) is False


def test_queued_logs_are_read_in_both_of_prefects_shapes() -> None:
    """Prefect 3.8's APILogWorker queues the LogCreate dict (with its size); 3.9 queues the log's JSON bytes."""
    line = {"name": "prefect.task_runs", "level": 20, "message": "hi", "flow_run_id": "f", "task_run_id": None}
    assert compat.queued_log({**line, "__payload_size__": 99}) == line
    assert compat.queued_log(b'{"name": "prefect.task_runs", "level": 20, "message": "hi", "flow_run_id": "f", '
                             b'"task_run_id": null}') == line
    assert compat.queued_log(memoryview(b'{"message": "m"}')) == {"message": "m"}
    assert compat.queued_log(b"not json") is None and compat.queued_log(None) is None


def test_prefects_own_log_queue_is_read() -> None:
    """What this Prefect's APILogWorker queues for a log, read back as the dict that was sent."""
    from prefect.logging.handlers import APILogWorker

    line = {"name": "n", "level": 20, "message": "m", "timestamp": "2026-01-01T00:00:00Z", "flow_run_id": None,
            "task_run_id": None}
    queued = []
    original = APILogWorker.__mro__[1].send  # the queue service's own send: what reaches its queue
    try:
        APILogWorker.__mro__[1].send = lambda self, item: queued.append(item)  # type: ignore[method-assign]
        APILogWorker.send(object.__new__(APILogWorker), {**line, "__payload_size__": 10})
    finally:
        APILogWorker.__mro__[1].send = original  # type: ignore[method-assign]
    assert [compat.queued_log(item) for item in queued] == [line]


# ---- the verified ranges against what is installed (`hpc-garage --version`) and what is released (--latest)


def test_installed_versions_say_whether_each_is_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    installed = {"distributed": "2026.8.0", "dask-jobqueue": "0.9.0", "prefect": "3.10.0",
                 "prefect-dask": "(not installed)"}
    monkeypatch.setattr(compat.versions, "version", installed.__getitem__)
    lines = dict(line.split(" ", 1) for line in compat.installed_versions())
    assert set(lines) == set(compat.VERIFIED)
    assert lines["distributed"].startswith("2026.8.0: in the verified range >=2026.8.0,<")
    low, high = compat.VERIFIED["prefect"]
    assert lines["prefect"] == (f"3.10.0: OUTSIDE the verified range >={low},<{high} (hpc-garage's uses of its "
                                f"private names fall back or refuse); pip install 'prefect>={low},<{high}'")
    assert lines["prefect-dask"].startswith("(not installed): OUTSIDE")


@pytest.mark.parametrize(("releases", "newest"), [
    (["3.9.1", "3.9.0", "3.10.0rc1", "3.8.8"], "3.9.1"),  # a pre-release is not what pip installs
    (["2026.10.0", "2026.9.1", "2026.11.0.dev0"], "2026.10.0"),  # compared as numbers, not text
    (["0.10.0", "0.9.0", "0.9.0.post1"], "0.10.0"),
    (["1.0b2"], None), ([], None)])
def test_newest_release(releases: list[str], newest: str | None) -> None:
    assert compat.newest_release(releases) == newest


def test_a_release_past_a_verified_range_is_news(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compat.versions, "VERIFIED", {"prefect": ("3.8.0", "3.10.0"),
                                                      "distributed": ("2026.8.0", "2026.9.0"),
                                                      "prefect-dask": ("0.3.7", "0.4.0")})
    news = compat.release_news({"prefect": "3.10.0", "distributed": "2026.8.3", "prefect-dask": None})
    assert [ok for ok, _ in news] == [False, True, False]
    assert news[0][1].startswith("prefect 3.10.0 is released, past the verified range >=3.8.0,<3.10.0: run the tests")
    assert news[1][1] == "distributed 2026.8.3 (newest): in the verified range >=2026.8.0,<2026.9.0"
    assert "no release found" in news[2][1]
    assert all(ok for ok, _ in compat.release_news({"prefect": "3.9.9", "distributed": "2026.8.0",
                                                    "prefect-dask": "0.3.99"}))


def test_latest_asks_the_index_and_exits_1_on_news(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    released = {p: [low] for p, (low, _) in compat.VERIFIED.items()} | {"prefect": ["3.8.0", "4.0.0", "3.9.1"]}
    monkeypatch.setattr(compat.versions, "registry_releases", released.__getitem__)
    monkeypatch.setattr(compat.versions, "version", lambda p: compat.VERIFIED[p][0])
    assert compat.main(["--latest"]) == 1
    assert "prefect 4.0.0 is released, past the verified range" in capsys.readouterr().out
    released["prefect"] = ["3.9.1"]
    assert compat.main(["--latest"]) == 0

    def unreachable(package: str) -> list[str]:
        raise UserError(f"`pip index versions {package}` failed (no network)")

    monkeypatch.setattr(compat.versions, "registry_releases", unreachable)
    assert compat.main(["--latest"]) == 2
    assert capsys.readouterr().err.startswith("hpc-garage: error: `pip index versions")


def test_the_index_listing_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    said = "prefect (3.9.1)\nAvailable versions: 3.9.1, 3.9.0, 3.8.8\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, said, ""))
    assert compat.registry_releases("prefect") == ["3.9.1", "3.9.0", "3.8.8"]
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, "", "ERROR: No matching distribution found for prefect\n"))
    with pytest.raises(UserError, match="No matching distribution found"):
        compat.registry_releases("prefect")


def test_an_expected_close_dask_logs_at_info_says_its_line_without_the_traceback(caplog) -> None:
    """distributed.batched logs "Batched Comm Closed" at INFO with exc_info while a cluster ends: the user sees
    the line; a warning keeps its traceback."""
    import logging

    from hpc_garage.compat import quiet_expected_closes

    quiet_expected_closes()
    quiet_expected_closes()  # once per process, however often asked
    log = logging.getLogger("distributed.batched")
    assert len(log.filters) == 1
    try:
        raise ConnectionError("closed")
    except ConnectionError:
        with caplog.at_level(logging.INFO, logger="distributed.batched"):
            log.info("Batched Comm Closed %r", "comm", exc_info=True)
            log.warning("something else", exc_info=True)
    info, warning = caplog.records
    assert info.getMessage() == "Batched Comm Closed 'comm'" and info.exc_info is None
    assert "Traceback" not in caplog.text.split("something else")[0]
    assert warning.exc_info is not None


@pytest.mark.slow  # a scheduler and a worker in this process, and a Nanny's worker process
def test_a_heartbeat_that_fails_as_its_worker_closes_is_one_info_line_and_one_that_fails_mid_run_is_an_error(
        caplog) -> None:
    """A worker's heartbeat in flight as the cluster ends logs "Failed to communicate with scheduler during
    heartbeat." at ERROR with a traceback (seen in the flow's stderr, after a refusal's one line, under load).
    While its worker closes: INFO, no traceback; while it runs: untouched. Every worker hpc-garage starts has
    the filter (its preload, launchers/worker_setup.py), in its own process."""
    import logging
    import os
    from unittest import mock

    from distributed import Client, Nanny, Scheduler, Worker

    from hpc_garage.compat.distributed import HEARTBEAT_FAILED, quiet_expected_closes
    from hpc_garage.launchers.common import WORKER_SETUP, dask_worker_preload

    def heartbeat_fails(log: logging.Logger) -> logging.LogRecord:
        caplog.clear()
        try:
            raise OSError("in <TLS (closed) ConnectionPool.heartbeat_worker>: Stream is closed")
        except OSError:
            with caplog.at_level(logging.INFO, logger="distributed.worker"):
                log.exception(HEARTBEAT_FAILED + ".")
        return caplog.records[0]

    def has_filter() -> bool:
        return any(type(f).__name__ == "_HeartbeatAsTheWorkerCloses"
                   for f in logging.getLogger("distributed.worker").filters)

    async def scenario() -> tuple[logging.LogRecord, logging.LogRecord, dict[str, bool]]:
        quiet_expected_closes()
        log = logging.getLogger("distributed.worker")
        async with Scheduler(host="127.0.0.1", dashboard_address=None) as scheduler:
            async with Nanny(scheduler.address, nthreads=1, preload=dask_worker_preload()) as nanny, \
                    Client(scheduler.address, asynchronous=True) as client:
                in_workers = await client.run(has_filter)
                await nanny.close()
            worker = Worker(scheduler.address, nthreads=1)
            await worker
            running = heartbeat_fails(log)
            await worker.close()
            closing = heartbeat_fails(log)
        return running, closing, in_workers

    with mock.patch.dict(os.environ):  # a Nanny sets its pre-spawn variables here (PYTHONHASHSEED): not for later tests
        running, closing, in_workers = asyncio.run(scenario())
    assert running.levelno == logging.ERROR and running.exc_info is not None  # a worker that runs: as it was
    assert closing.levelno == logging.INFO and closing.exc_info is None
    assert closing.getMessage() == HEARTBEAT_FAILED + "."
    assert WORKER_SETUP in dask_worker_preload() and list(in_workers.values()) == [True]


def test_trim_span_metadata_keeps_each_kind_once_on_a_real_scheduler() -> None:
    """distributed keeps a `{"type": "Future"}` per `Client.submit` in its span's metadata: a sweep's every
    trial, in the scheduler, for its life. trim_span_metadata leaves one of each kind."""
    from distributed import Client, Scheduler, Worker

    from hpc_garage.compat import trim_span_metadata

    def held(scheduler: Any) -> list[dict[str, Any]]:
        return [c for span in scheduler.extensions["spans"].spans.values()
                for c in (span._metadata or {}).get("collections", [])]

    async def main() -> None:
        async with Scheduler(port=0, dashboard_address=":0") as s, Worker(s.address, nthreads=1), \
                Client(s.address, asynchronous=True) as c:
            await c.gather([c.submit(int, i, pure=False) for i in range(200)])
            assert len(held(s)) == 200  # what distributed does: the reason for the trim
            assert trim_span_metadata(s) == 199 and held(s) == [{"type": "Future"}]
            await c.gather([c.submit(int, i, pure=False) for i in range(5)])
            assert trim_span_metadata(s) == 5 and held(s) == [{"type": "Future"}]

    asyncio.run(main())
