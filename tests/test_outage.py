"""prefect/outage.py's decisions without a Prefect server: which errors mean the API is gone, when a flow run's
state is kept here instead of raising, and what the run directory says it kept. The real outage (a server
SIGKILLed mid-sweep, then `hpc-garage replay`) is tests/test_prefect_faults.py and test_prefect_replay.py."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from hpc_garage.prefect import outage as outage_module
from hpc_garage.prefect.outage import ApiOutage, is_outage_error, keep_state_when_unreachable
from hpc_garage.rundir import RunDir
from hpc_garage.variables import BENCH_BYPASS_ENV, RUN_DIR_ENV


def status_error(code: int) -> httpx.HTTPStatusError:
    request = httpx.Request("POST", "http://127.0.0.1:4200/api/flow_runs/x/set_state")
    return httpx.HTTPStatusError("status", request=request, response=httpx.Response(code, request=request))


def test_unreachable_or_overloaded_is_an_outage_a_wrong_request_is_not() -> None:
    request = httpx.Request("GET", "http://127.0.0.1:4200/api/health")
    assert is_outage_error(httpx.ConnectError("refused", request=request))
    assert is_outage_error(httpx.ReadTimeout("slow", request=request))
    assert all(is_outage_error(status_error(code)) for code in (408, 429, 500, 502, 503))
    assert not any(is_outage_error(status_error(code)) for code in (400, 401, 404, 409, 422))
    assert is_outage_error(ConnectionRefusedError()) and is_outage_error(TimeoutError())
    assert not is_outage_error(ValueError("bad state")) and not is_outage_error(KeyError("id"))


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fresh outage record, an API whose answer the test sets, and no bench bypass."""
    api = {"answers": True, "probes": 0}

    def answers() -> bool:
        api["probes"] += 1
        return api["answers"]

    monkeypatch.setattr(outage_module, "outage", ApiOutage())
    monkeypatch.setattr(outage_module, "api_answers", answers)
    monkeypatch.delenv(BENCH_BYPASS_ENV, raising=False)
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    return api


def test_an_outage_is_probed_only_once_seen_or_before_a_final_state(fresh: dict[str, Any]) -> None:
    record = outage_module.outage
    assert record.still_down() is False and fresh["probes"] == 0  # nothing seen: no probe on every proposal
    assert record.still_down(final=True) is False and fresh["probes"] == 1  # the flow's last word: one probe
    fresh["answers"] = False
    assert record.still_down(final=True) is True and record.down
    assert record.still_down() is True  # seen down: probed again, still down
    fresh["answers"] = True
    assert record.still_down() is False and not record.down  # back


def state(kind: str = "COMPLETED", final: bool = True) -> Any:
    return SimpleNamespace(type=SimpleNamespace(value=kind), name=kind.title(), message="done", is_final=lambda: final,
                           timestamp=datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc),
                           state_details=SimpleNamespace(flow_run_id=None))


def test_a_flow_runs_state_is_kept_when_the_api_is_gone_and_the_run_directory_says_so(
        fresh: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    calls: list[Any] = []

    def propose(client: Any, new: Any, **kwargs: Any) -> Any:
        calls.append(new)
        raise httpx.ConnectError("refused")

    propose_state = keep_state_when_unreachable(propose, is_async=False)
    done = state()
    assert propose_state(None, done, flow_run_id="run-1") is done  # kept, not raised: the flow ends in its state
    assert calls == [done] and outage_module.outage.down and outage_module.outage.kept_states == ["COMPLETED"]
    # its run named in it, as the server would have: `flow(..., return_state=True)`'s caller reads it there (a
    # bench under CI's load asked the API about flow run "None")
    assert done.state_details.flow_run_id == "run-1"
    fresh["answers"] = False
    assert propose_state(None, state("FAILED"), flow_run_id="run-1").type.value == "FAILED"
    assert len(calls) == 1  # known down: the next proposal is kept without a minute of retries
    rundir = RunDir(tmp_path)
    kept = json.loads(rundir.kept_flow_states_file.read_text())
    assert kept["run-1"]["type"] == "FAILED" and kept["run-1"]["timestamp"] == "2026-01-02T03:04:05+00:00"
    assert json.loads(rundir.unrecorded_file.read_text())["flow_run_id"] == "run-1"


def test_a_task_runs_state_and_a_wrong_request_raise_as_before(fresh: dict[str, Any]) -> None:
    def gone(client: Any, new: Any, **kwargs: Any) -> Any:
        raise httpx.ConnectError("refused")

    def refused(client: Any, new: Any, **kwargs: Any) -> Any:
        raise status_error(409)

    with pytest.raises(httpx.ConnectError):
        keep_state_when_unreachable(gone, is_async=False)(None, state(), task_run_id="task-1")
    with pytest.raises(httpx.HTTPStatusError):
        keep_state_when_unreachable(refused, is_async=False)(None, state(), flow_run_id="run-1")
    assert not outage_module.outage.down


def test_the_bench_bypass_calls_prefect_straight_through(fresh: dict[str, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BENCH_BYPASS_ENV, "1")
    fresh["answers"] = False
    outage_module.outage.mark_down()

    def propose(client: Any, new: Any, **kwargs: Any) -> Any:
        return "recorded"

    assert keep_state_when_unreachable(propose, is_async=False)(None, state(), flow_run_id="run-1") == "recorded"
    assert outage_module.api_down() is False


def test_the_async_engine_keeps_states_alike(fresh: dict[str, Any]) -> None:
    import asyncio

    async def propose(client: Any, new: Any, **kwargs: Any) -> Any:
        raise httpx.ReadTimeout("slow")

    kept = asyncio.run(keep_state_when_unreachable(propose, is_async=True)(None, state(), flow_run_id="run-2"))
    assert kept.type.value == "COMPLETED" and outage_module.outage.kept_states == ["COMPLETED"]
