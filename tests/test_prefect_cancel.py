"""A Cancel in Prefect seen by `run` (cluster/prefect_cancel.py), against a stand-in for Prefect's API."""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from hpc_garage.cluster import prefect_cancel
from hpc_garage.cluster.prefect_cancel import PrefectCancel


class FakeApi:
    """GET /api/flow_runs/ID answers its state_type; POST .../set_state records the body and applies it."""

    def __init__(self, states: dict[str, str]) -> None:
        self.states, self.posted = states, []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.reply({"state_type": api.states[self.path.rsplit("/", 1)[-1]]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                flow_run = self.path.split("/")[-2]
                api.posted.append((flow_run, body))
                api.states[flow_run] = body["state"]["type"]
                self.reply({"status": "ACCEPT"})

            def reply(self, answer: Any) -> None:
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/api"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def fake_api() -> Iterator[FakeApi]:
    server = FakeApi({"a": "RUNNING", "b": "RUNNING"})
    yield server
    server.server.shutdown()


def test_a_cancelling_flow_run_is_seen_and_ends_cancelled(fake_api: FakeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    watch = PrefectCancel({"PREFECT_API_URL": fake_api.url}, lambda: ["a", "b"])
    assert watch.due() and not watch.poll() and not watch.due()  # asked every POLL_SECONDS, not more
    monkeypatch.setattr(prefect_cancel, "POLL_SECONDS", 0.0)
    fake_api.states["b"] = "CANCELLING"
    assert watch.due() and watch.poll() and watch.cancelling == ["b"]
    watch.settle()
    assert fake_api.posted == [("b", {"state": {"type": "CANCELLED", "message": "Cancelled: the job wound down (hpc-garage)"},
                                 "force": True})]
    assert fake_api.states == {"a": "RUNNING", "b": "CANCELLED"}
    watch.settle()  # already Cancelled: left alone
    assert len(fake_api.posted) == 1
    fake_api.states["b"] = "CRASHED"  # its engine's word once the interrupted trials ended the flow: the cancel's
    watch.settle()
    assert fake_api.states["b"] == "CANCELLED" and len(fake_api.posted) == 2
    fake_api.states["b"] = "COMPLETED"  # it finished before the cancel took: kept
    watch.settle()
    assert fake_api.states["b"] == "COMPLETED" and len(fake_api.posted) == 2


def test_no_api_no_watch_and_an_api_that_does_not_answer_is_no_cancel() -> None:
    assert not PrefectCancel({}, lambda: ["a"]).due()
    gone = PrefectCancel({"PREFECT_API_URL": "http://127.0.0.1:9/api"}, lambda: ["a"])
    assert not gone.poll() and gone.cancelling == []
