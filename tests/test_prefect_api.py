"""hpc-garage's own Prefect HTTP client (hpc_garage/prefect_api.py): its auth header, its one proxy policy, its
timeouts, against a small local `http.server`; and the README's first command and a 2-node SLURM sweep with
every proxy variable pointing at a dead port and no no_proxy (issue 23): hpc-garage's own addresses bypass it."""

from __future__ import annotations

import base64
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpc_garage.prefect_api import ApiError, PrefectApi, auth_headers, no_proxy_for, proxy_for, server_host
from tests.conftest import outside_job_env

PY = sys.executable
SWEEP = Path(__file__).resolve().parent.parent / "examples" / "sweep.py"
DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens on the discard port here: a proxy that refuses everything
PROXY_VARIABLES = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")


def proxied_env(home: Path | None = None) -> dict[str, str]:
    """This environment without batch-system, hpc-garage, Prefect or proxy settings, then every proxy variable
    at a dead port and no no_proxy, as a site's login node might have it."""
    env = {k: v for k, v in outside_job_env(("PREFECT_",)).items() if not k.lower().endswith("_proxy")}
    env |= dict.fromkeys(PROXY_VARIABLES, DEAD_PROXY)
    if home is not None:
        env["HOME"] = str(home)
    return env


class Recorder:
    """A tiny HTTP server on 127.0.0.1 that records each request (its request line's target and headers) and
    answers JSON: `{"path": ...}`, or the status a path asks for (`/status/404`), or 503 with Retry-After: 0 to
    the first N requests for `/busy/N`. As a proxy it is sent the absolute URL."""

    def __init__(self, bind: str = "127.0.0.1") -> None:
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                seen.append({"target": self.path, "headers": dict(self.headers),
                             "body": self.rfile.read(length) if length else b""})
                status = int(m.group(1)) if (m := re.search(r"/status/(\d+)", self.path)) else 200
                if (m := re.search(r"/busy/(\d+)", self.path)) and sum(
                        1 for request in seen if request["target"] == self.path) <= int(m.group(1)):
                    status = 503
                body = json.dumps({"path": self.path}).encode()
                self.send_response(status)
                if status == 503 and "/busy/" in self.path:
                    self.send_header("Retry-After", "0")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_DELETE = answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((bind, 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()  # shutdown(): 0.05 s

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    server = Recorder()
    yield server
    server.close()


@pytest.fixture
def dead_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every proxy variable at a dead port, and no no_proxy, in this process."""
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    for name in PROXY_VARIABLES:
        monkeypatch.setenv(name, DEAD_PROXY)


def test_auth_header_is_prefects_basic_auth_string_else_the_bearer_key(recorder: Recorder) -> None:
    assert auth_headers({"PREFECT_API_AUTH_STRING": "hpc-garage:s3cret", "PREFECT_API_KEY": "k"}) == {
        "Authorization": "Basic " + base64.b64encode(b"hpc-garage:s3cret").decode()}
    assert auth_headers({"PREFECT_API_KEY": "pnu_key"}) == {"Authorization": "Bearer pnu_key"}
    assert auth_headers({"PREFECT_API_URL": "http://x/api"}) == {}
    client = PrefectApi.from_env({"PREFECT_API_URL": f"{recorder.url}/api/", "PREFECT_API_AUTH_STRING": "u:p"})
    assert client is not None
    assert client.post("/flow_runs/count", {"a": 1}) == {"path": "/api/flow_runs/count"}
    assert client.get("/health") == {"path": "/api/health"}
    posted, got = recorder.seen
    assert posted["headers"]["Authorization"] == "Basic " + base64.b64encode(b"u:p").decode()
    assert posted["headers"]["Content-Type"] == "application/json" and json.loads(posted["body"]) == {"a": 1}
    assert got["headers"]["Authorization"] == posted["headers"]["Authorization"] and "Content-Type" not in got["headers"]
    assert PrefectApi.from_env({}) is None  # no API: nothing is asked


def test_an_error_status_is_an_answer_or_an_api_error(recorder: Recorder) -> None:
    client = PrefectApi(f"{recorder.url}/api")
    assert client.answer("GET", "/status/404").status == 404
    assert client.answer("GET", "/status/503").status == 503
    with pytest.raises(ApiError) as refused:
        client.get("/status/401")
    assert refused.value.status == 401 and isinstance(refused.value, OSError)
    assert len(recorder.seen) == 3  # an error that is not "busy" is not asked again


def test_a_busy_server_is_asked_again_as_prefects_client_does(recorder: Recorder) -> None:
    """A Prefect server answers 503 for a database error a client may retry (SQLite locked on a loaded node):
    seen in CI on a work-pool heartbeat. Prefect's client retries it; hpc-garage's does too, and only it."""
    client = PrefectApi(f"{recorder.url}/api")
    assert client.call("PATCH", "/busy/2", {"paused": True}) == {"path": "/api/busy/2"}
    assert [r["target"] for r in recorder.seen] == ["/api/busy/2"] * 3  # twice 503, then the answer
    assert client.call("DELETE", "/busy/0") == {"path": "/api/busy/0"}
    recorder.seen.clear()
    with pytest.raises(ApiError) as refused:
        client.get("/busy/99")  # busy for ever: 1 + BUSY_RETRIES tries, then the error
    assert refused.value.status == 503 and len(recorder.seen) == 6
    recorder.seen.clear()
    started = time.monotonic()
    with pytest.raises(ApiError):  # no Retry-After: a doubling delay, and the budget ends the tries
        PrefectApi(f"{recorder.url}/api", budget=2.0).get("/status/503")
    assert len(recorder.seen) == 3 and 1.4 < time.monotonic() - started < 2.0  # at 0, 0.5 and 1.5 s, not 3.5 s


def test_a_dead_proxy_in_the_environment_does_not_catch_our_loopback_calls(recorder: Recorder,
                                                                          dead_proxy: None) -> None:
    with pytest.raises(urllib.error.URLError):  # what urlopen did for progress and crash marking before
        # an opener of its own: urlopen() would install one with the dead proxy for the rest of this process
        urllib.request.build_opener().open(f"{recorder.url}/api/health", timeout=5)
    assert recorder.seen == []
    assert PrefectApi(f"{recorder.url}/api").get("/health") == {"path": "/api/health"}
    assert PrefectApi(f"http://localhost:{recorder.server.server_port}/api").get("/x") == {"path": "/api/x"}
    assert proxy_for(f"{recorder.url}/api") is None and proxy_for("http://[::1]:4200/api") is None


def test_a_users_proxy_still_applies_to_other_hosts() -> None:
    env = dict.fromkeys(PROXY_VARIABLES, DEAD_PROXY)
    assert proxy_for("http://prefect.example:4200/api", env) == DEAD_PROXY
    assert proxy_for("https://api.prefect.cloud/api/accounts/a", env | {"https_proxy": "http://p:3128"}) \
        == "http://p:3128"  # the scheme's own, lowercase spelling first (as urllib, curl and httpx)
    assert proxy_for("http://prefect.example:4200/api", {"HTTPS_PROXY": DEAD_PROXY}) is None  # none for http
    for no_proxy in ("prefect.example", ".example", "example", "a.b, prefect.example", "*"):
        assert proxy_for("http://prefect.example:4200/api", env | {"no_proxy": no_proxy}) is None, no_proxy
    assert proxy_for("http://prefect.example:4200/api", env | {"no_proxy": "other.example"}) == DEAD_PROXY
    assert proxy_for("http://prefect.example:4200/api", env | {"NO_PROXY": "prefect.example"}) is None
    assert proxy_for("http://10.1.2.3:4200/api", env, own=True) is None  # the managed server
    assert proxy_for("http://10.1.2.3:4200/api", env) == DEAD_PROXY


def test_a_users_proxy_is_where_a_call_to_another_host_goes(recorder: Recorder, monkeypatch: pytest.MonkeyPatch,
                                                             dead_proxy: None) -> None:
    monkeypatch.setenv("http_proxy", recorder.url)  # the recorder plays the user's proxy
    assert PrefectApi("http://prefect.example:4200/api").get("/health") == {
        "path": "http://prefect.example:4200/api/health"}
    assert recorder.seen[-1]["target"] == "http://prefect.example:4200/api/health"  # a proxy's request line
    managed = {"PREFECT_API_URL": "http://10.255.255.1:9/api", "HPC_GARAGE_PREFECT_SERVER": "{}"}
    assert server_host(managed) == "10.255.255.1" and server_host({"PREFECT_API_URL": "http://a/api"}) is None
    client = PrefectApi.from_env(managed, timeout=0.3)
    assert client is not None and client.own
    with pytest.raises(OSError):
        client.get("/health")  # straight to a host that is not there, not to the proxy
    assert len(recorder.seen) == 1


def test_no_proxy_for_appends_our_hosts_to_both_spellings() -> None:
    assert no_proxy_for(["127.0.0.1", "10.0.0.5"], {}) == {"NO_PROXY": "127.0.0.1,10.0.0.5",
                                                           "no_proxy": "127.0.0.1,10.0.0.5"}
    assert no_proxy_for(["10.0.0.5"], {"no_proxy": ".corp, localhost", "NO_PROXY": ".site"}) == {
        "NO_PROXY": ".site,10.0.0.5", "no_proxy": ".corp,localhost,10.0.0.5"}
    assert no_proxy_for(["10.0.0.5"], {"no_proxy": ".corp"}) == {"NO_PROXY": ".corp,10.0.0.5",
                                                                 "no_proxy": ".corp,10.0.0.5"}
    again = no_proxy_for(["10.0.0.5", "10.0.0.5", None, "0.0.0.0", "[::1]"], {"NO_PROXY": "10.0.0.5"})
    assert again == {"NO_PROXY": "10.0.0.5,::1", "no_proxy": "10.0.0.5,::1"}


def test_prefects_own_http_client_skips_the_proxy_for_hosts_no_proxy_for_lists(monkeypatch: pytest.MonkeyPatch,
                                                                             dead_proxy: None) -> None:
    """What the flow's and the workers' Prefect clients (httpx; websockets asks urllib) do with NO_PROXY as
    `run` and the managed server set it. Loopback included: to httpx it is a host like any other."""
    import httpx

    recorder = Recorder(bind="0.0.0.0")
    try:
        for host in ("127.0.0.1", socket.gethostname()):
            url = f"http://{host}:{recorder.server.server_port}/health"
            with pytest.raises(httpx.TransportError):
                httpx.get(url, timeout=5)  # to the dead proxy: Prefect's "Failed to reach API" before
            assert recorder.seen == []
            env = no_proxy_for([host], os.environ)
            monkeypatch.setenv("NO_PROXY", env["NO_PROXY"])
            monkeypatch.setenv("no_proxy", env["no_proxy"])
            assert httpx.get(url, timeout=5).json() == {"path": "/health"}
            assert urllib.request.proxy_bypass(f"{host}:{recorder.server.server_port}")  # as websockets asks
            recorder.seen.clear()
            monkeypatch.delenv("NO_PROXY")
            monkeypatch.delenv("no_proxy")
    finally:
        recorder.close()


def test_each_call_has_its_timeout_and_all_of_them_the_budget() -> None:
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/api"
    try:
        started = time.monotonic()
        with pytest.raises(OSError):
            PrefectApi(url, timeout=0.5).get("/health")
        assert 0.4 < time.monotonic() - started < 1.5
        client = PrefectApi(url, timeout=0.6, budget=1.0)
        started = time.monotonic()
        for _ in range(2):  # 0.6 s, then the 0.4 s left
            with pytest.raises(OSError):
                client.post("/artifacts/", {})
        assert 0.9 < time.monotonic() - started < 1.8
        with pytest.raises(TimeoutError, match="out of time"):
            client.get("/health")  # none left: not even tried
        assert time.monotonic() - started < 1.9
    finally:
        silent.close()


@pytest.mark.slow
def test_readme_first_command_with_a_dead_proxy_and_no_no_proxy(tmp_path: Path) -> None:
    """`hpc-garage run -- python examples/sweep.py`, as the README says, on a fresh HOME (its own managed server)."""
    home = tmp_path / "home"
    home.mkdir()
    env = proxied_env(home)
    try:
        done = subprocess.run([PY, "-m", "hpc_garage", "run", "--", PY, str(SWEEP)], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=400)
    finally:
        subprocess.run([PY, "-m", "hpc_garage", "server", "stop", "--force"], capture_output=True, env=env, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "sweep-results.json").read_text())
    assert summary["result"] == summary["expected"] and summary["experiments"] == 8, summary
    assert f"result {summary['result']} (expected {summary['expected']})" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.slurm
def test_two_node_slurm_sweep_with_a_dead_proxy_keeps_its_progress_and_report(tmp_path: Path) -> None:
    """`submit --wait` of a sweep on 2 nodes x 2 fake GPUs, every proxy variable dead in the environment the job
    inherits: the right result, progress to the end, the report, and the flow run Completed in the managed
    server's API (the flow's and the workers' Prefect clients reached it), with every trial's task run. The site
    is lab-gpu without its `interface: lo`: the scheduler and the server listen on this machine's address, as on
    a real cluster, where loopback's exemption would not help."""
    from urllib.parse import urlsplit

    from hpc_garage.prefect.server import ensure_api, stop_server

    site = tmp_path / "lab-gpu-routed.yaml"
    lines = (SWEEP.parent.parent / "site-configs" / "lab-gpu.yaml").read_text().splitlines()
    site.write_text("\n".join(line for line in lines if not line.startswith("interface:")) + "\n")
    env = proxied_env()  # this user's HOME
    out = tmp_path / "r.json"
    done = subprocess.run([PY, "-m", "hpc_garage", "submit", "--site", str(site), "--nodes", "2", "--gpus-per-node",
                           "2", "--wait", str(SWEEP), "--gpu", "yes", "--seeds", "4", "--duration", "0.5", "--out",
                           str(out)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(out.read_text())
    assert summary["result"] == summary["expected"] and summary["experiments"] == 8, summary
    assert {w.rsplit("-", 2)[-2] for w in summary["workers"]} == {"n0", "n1"}, summary["workers"]

    def hpcg(*args: str) -> Any:
        shown = subprocess.run([PY, "-m", "hpc_garage", *args, "--json"], capture_output=True, text=True,
                               cwd=tmp_path, env=env, timeout=60)
        assert shown.returncode == 0, shown.stderr
        return json.loads(shown.stdout)

    job = done.stdout.split()[2]  # "submitted job N (site lab-gpu)"
    status = hpcg("status", job)
    progress = status["run"]["progress"]
    assert (progress["done"], progress["failed"], progress["running"], progress["waiting"]) == (9, 0, 0, 0)
    [flow_run] = progress["prefect"]["flow_runs"]
    report = hpcg("report", job)
    assert len(report["trials"]) == 9 and len(report["gpus"]) == 4, report
    log = Path(status["log"]).read_text()
    assert "hpc-garage: report: written to " in log and "could not check" not in log, log
    host = urlsplit(progress["prefect"]["api"]).hostname
    assert host is not None and not host.startswith("127."), progress["prefect"]  # not loopback
    saved = dict(os.environ)
    try:  # the server the job used, and its auth string
        api = PrefectApi.from_env(ensure_api(host, env=clean_env()))
        assert api is not None and api.url == progress["prefect"]["api"].rstrip("/")
        assert api.get(f"/flow_runs/{flow_run['id']}")["state_type"] == "COMPLETED"
        assert api.post("/task_runs/count", {"flow_runs": {"id": {"any_": [flow_run["id"]]}},
                                             "task_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}) == 9
    finally:
        stop_server(host)  # this test's own: no other test binds there
        os.environ.clear()
        os.environ.update(saved)


def clean_env() -> dict[str, str]:
    return outside_job_env()


def test_the_outage_probe_asks_health_through_the_client(recorder: Recorder, dead_proxy: None) -> None:
    """prefect/outage.py's probe: Prefect's settings' URL and auth string, straight to our loopback server; a
    busy server's 503 is an answer, a proxy's 502 is not, and no answer at all is not."""
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from hpc_garage.prefect.outage import api_answers

    with temporary_settings(updates={PREFECT_API_URL: f"{recorder.url}/api", PREFECT_API_AUTH_STRING: "u:p"}):
        assert api_answers()
    assert recorder.seen[-1]["target"] == "/api/health"
    assert recorder.seen[-1]["headers"]["Authorization"] == "Basic " + base64.b64encode(b"u:p").decode()
    for status, answers in ((503, True), (502, False)):
        with temporary_settings(updates={PREFECT_API_URL: f"{recorder.url}/status/{status}"}):
            assert api_answers() is answers, status
    refused = socket.socket()
    refused.bind(("127.0.0.1", 0))  # bound, not listening
    try:
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{refused.getsockname()[1]}/api"}):
            assert not api_answers()
    finally:
        refused.close()
