"""The managed Prefect server's UI: the "View at" link of the README's first command opens; nothing the server
exposes answers without its auth string (the API, the UI's data calls, the event and log websockets); a real
browser logs in with the auth string and sees a sweep's task runs; `server status`/`status JOB` say where the
UI is, the `ssh -L` line and how to read the auth string, never the string itself."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpc_garage.cli.status_text import progress_links
from hpc_garage.cluster.progress import managed_server, prefect_ui_url
from hpc_garage.core.errors import UserError
from hpc_garage.core.tunnel import ssh_tunnel
from hpc_garage.prefect import server as prefect_server

ROOT = Path(__file__).resolve().parent.parent
VIEW_AT = re.compile(r"View at (http\S+/runs/flow-run/([0-9a-f-]{36}))")
# every websocket route of Prefect 3.8.8 and 3.9.1's server (`grep -rn "websocket(" prefect/server`)
WEBSOCKETS = ("/events/in", "/events/out", "/logs/out", "/task_runs/subscriptions/scheduled",
              "/work_pools/any/workers/connect")
HTML = {"Accept": "text/html,application/xhtml+xml"}  # what a browser sends for a page


# ------------------------------------------------------------------------------------------- pure parts


def test_the_ssh_line_forwards_the_same_port_so_printed_links_work_with_localhost() -> None:
    assert ssh_tunnel("10.0.0.5", 4200, "me@login", "/v2/runs/flow-run/abc") == \
        "ssh -N -L 4200:10.0.0.5:4200 me@login  then open http://localhost:4200/v2/runs/flow-run/abc"
    assert ssh_tunnel("node1", 8789, "me@login", "status", local_port=8787) == \
        "ssh -N -L 8787:node1:8789 me@login  then open http://localhost:8787/status"
    assert ssh_tunnel("fe80::1", 80, "me@login").startswith("ssh -N -L 80:[fe80::1]:80 ")


def test_the_ui_asks_for_the_api_where_its_page_came_from_and_is_copied_into_our_home(tmp_path: Path) -> None:
    on = prefect_server.ui_settings(tmp_path, "http://10.0.0.5:4200/v2")
    assert on["PREFECT_SERVER_UI_ENABLED"] == "true"
    assert on["PREFECT_SERVER_UI_API_URL"] == "/api"  # through any ssh -L port or host name
    assert on["PREFECT_SERVER_UI_STATIC_DIRECTORY"] == str(tmp_path / "ui_build")  # not the (read-only) package
    assert on["PREFECT_UI_URL"] == "http://10.0.0.5:4200/v2"
    assert prefect_server.ui_settings(tmp_path, "") == {"PREFECT_SERVER_UI_ENABLED": "false"}
    assert prefect_server.ui_base("http://h:1", {"PREFECT_SERVER_UI_V2_ENABLED": "false"}) == "http://h:1"
    with pytest.raises(UserError, match="PREFECT_SERVER_UI_V2_ENABLED='maybe'"):
        prefect_server.ui_base("http://h:1", {"PREFECT_SERVER_UI_V2_ENABLED": "maybe"})


def test_the_flow_runs_link_follows_the_servers_ui_url() -> None:
    state = prefect_server.ServerState(url="http://10.0.0.5:4200/api", pid=1, auth="hpc-garage:s", host="10.0.0.5",
                                       port=4200, started=0.0, ui="http://10.0.0.5:4200/v2")
    env = state.client_env()
    assert env["PREFECT_UI_URL"] == "http://10.0.0.5:4200/v2"  # Prefect's own "View at" link goes there
    assert prefect_ui_url(env["PREFECT_API_URL"], "abc", env["PREFECT_UI_URL"]) == \
        "http://10.0.0.5:4200/v2/runs/flow-run/abc"
    assert managed_server(env) == {"server": {"machine": prefect_server.machine_name(), "host": "10.0.0.5"}}
    assert managed_server({"PREFECT_API_URL": "http://mine:4200/api"}) == {}
    assert "PREFECT_UI_URL" not in prefect_server.ServerState(**{**vars(state), "ui": ""}).client_env()


def test_status_job_prints_the_ui_the_ssh_line_and_where_the_auth_string_is() -> None:
    progress = {"prefect": {"api": "http://10.0.0.5:4200/api", "ui": True,
                            "flow_runs": [{"id": "abc", "url": "http://10.0.0.5:4200/v2/runs/flow-run/abc"}],
                            "server": {"machine": "node1", "host": "10.0.0.5"}}}
    lines = progress_links(progress, login="me@login")
    assert lines[0] == "Prefect UI: http://10.0.0.5:4200/v2/runs/flow-run/abc"
    assert "from a laptop: ssh -N -L 4200:10.0.0.5:4200 me@login  then open " \
           "http://localhost:4200/v2/runs/flow-run/abc" in lines[1]
    assert "`hpc-garage server auth --host 10.0.0.5 --machine node1`" in lines[2]
    # the user's own server: its auth is theirs, no hpc-garage command for it
    del progress["prefect"]["server"]
    assert progress_links(progress, login="me@login") == ["Prefect UI: http://10.0.0.5:4200/v2/runs/flow-run/abc"]


def test_server_status_says_where_the_auth_string_is_never_the_string(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    directory = prefect_server.ServerDir.here()
    state = prefect_server.ServerState(url="http://127.0.0.1:9/api", pid=os.getpid(), auth="hpc-garage:s3cr3t",
                                       host="127.0.0.1", port=9, started=0.0, ui="http://127.0.0.1:9/v2")
    directory.state_file.write_text(json.dumps(vars(state)))
    status = prefect_server.server_status()
    assert status["ui"] == "http://127.0.0.1:9/v2/"
    assert status["from_a_laptop"].startswith("ssh -N -L 9:127.0.0.1:9 ")
    assert "`hpc-garage server auth`" in status["auth_string"] and str(directory.state_file) in status["auth_string"]
    assert "s3cr3t" not in json.dumps(status)
    assert prefect_server.auth_string() == "hpc-garage:s3cr3t"  # only when asked
    directory.state_file.write_text(json.dumps(vars(state) | {"ui": ""}))
    assert prefect_server.server_status()["ui"].startswith("off: ")
    with pytest.raises(UserError, match=r"^--host 10\.1\.2\.3 --machine node9: no hpc-garage Prefect server runs "
                                         r"there \(.*/node9/bind-10\.1\.2\.3/server\.json does not exist\)"):
        prefect_server.auth_string("10.1.2.3", "node9")


# ------------------------------------------------------------------- the README's first command, for real


@dataclass
class Served:
    home: Path
    output: str
    view_at: str
    flow_run: str
    state: prefect_server.ServerState

    def env(self) -> dict[str, str]:
        return {**_clean_env(), "HOME": str(self.home)}


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "HPC_GARAGE_SCHEDULER"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """`hpc-garage run -- python examples/sweep.py` (small) in a private HOME; its server stays up for the module."""
    home = tmp_path_factory.mktemp("ui-home")
    env = {**_clean_env(), "HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "hpc_garage", "run", "--", sys.executable,
                           str(ROOT / "examples" / "sweep.py"), "--seeds", "2", "--lrs", "0.1", "--duration", "0.1",
                           "--out", str(home / "sweep.json")], env=env, cwd=home, capture_output=True, text=True,
                          timeout=400)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    match = VIEW_AT.search(output)
    assert match, f"no 'View at' link in the run's output: {output[-2000:]}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(home))
        state = prefect_server.ServerDir.here().state()
        assert state is not None
        try:
            yield Served(home, output, match.group(1), match.group(2), state)
        finally:
            prefect_server.stop_server()


def _call(url: str, auth: str | None = None, body: object = None,
          headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, method="GET" if body is None else "POST", headers=headers or {},
                                     data=None if body is None else json.dumps(body).encode())
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if auth is not None:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=10) as answer:
            return answer.status, answer.headers.get("content-type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("content-type", "")


@pytest.mark.slow
def test_the_view_at_link_of_the_readmes_first_command_opens(served: Served) -> None:
    assert served.view_at.startswith(served.state.ui + "/runs/flow-run/")
    status, kind = _call(served.view_at, headers=HTML)  # a browser: the page (its data needs the login)
    assert (status, kind.split(";")[0]) == (200, "text/html")
    assert _call(served.view_at, served.state.auth, headers=HTML)[0] == 200
    # `server status` says where the UI is, the ssh line and how to read the auth string, never the string
    shown = subprocess.run([sys.executable, "-m", "hpc_garage", "server", "status"], env=served.env(),
                           capture_output=True, text=True, timeout=60)
    status_json = json.loads(shown.stdout)
    assert status_json["ui"] == served.state.ui + "/"
    port = served.state.port
    assert status_json["from_a_laptop"].startswith(f"ssh -N -L {port}:127.0.0.1:{port} ")
    assert "hpc-garage server auth" in status_json["auth_string"]
    assert served.state.auth not in shown.stdout
    asked = subprocess.run([sys.executable, "-m", "hpc_garage", "server", "auth"], env=served.env(),
                           capture_output=True, text=True, timeout=60)
    assert asked.stdout.strip() == served.state.auth


@pytest.mark.slow
def test_nothing_answers_without_the_auth_string(served: Served) -> None:
    api, auth, run = served.state.url, served.state.auth, served.flow_run
    # the API, and what the UI's flow-run page asks it for (its data)
    calls = [(f"{api}/flow_runs/filter", {}), (f"{api}/flow_runs/{run}", None), (f"{api}/task_runs/paginate", {}),
             (f"{api}/logs/filter", {}), (f"{api}/flow_runs/{run}/graph-v2", None), (f"{api}/events/filter", {}),
             (f"{api}/ui/flow_runs/count-task-runs", {"flow_run_ids": [run]}), (f"{api}/admin/settings", None),
             (f"{api}/openapi.json", None)]
    for url, body in calls:
        assert _call(url, None, body)[0] == 401, url
        assert _call(url, "hpc-garage:wrong", body)[0] == 401, url
        assert _call(url, auth, body)[0] == 200, url
    # the UI's own files are public (its login page must load); they hold no data
    assert _call(f"{served.state.ui}/", headers=HTML)[0] == 200
    # the websockets: no handshake, a wrong or missing token, or no auth message at all: refused
    base = api.replace("http://", "ws://", 1)
    results = asyncio.run(_websockets(base, auth))
    for path in WEBSOCKETS:
        got = results[path]
        assert got["no subprotocol"] in ("refused 403", "closed 1002", "closed 1008"), (path, got)
        assert got["wrong token"] == "closed 1008", (path, got)
        assert got["no token"] == "closed 1008", (path, got)
        assert got["no auth message"] == "closed 1008", (path, got)
        assert got["the auth string"] == "auth_success", (path, got)


async def _websockets(base: str, auth: str) -> dict[str, dict[str, str]]:
    import websockets

    async def attempt(url: str, subprotocols: list[str] | None, first: dict[str, str] | None) -> str:
        try:
            async with websockets.connect(url, subprotocols=subprotocols, open_timeout=30,  # type: ignore[arg-type]
                                          proxy=None) as ws:
                if first is not None:
                    await ws.send(json.dumps(first))
                message = json.loads(await asyncio.wait_for(ws.recv(), 30))
                return str(message.get("type"))
        except websockets.InvalidStatus as exc:
            return f"refused {exc.response.status_code}"
        except websockets.ConnectionClosed as exc:
            return f"closed {exc.rcvd.code if exc.rcvd else None}"

    results = {}
    for path in WEBSOCKETS:
        url = f"{base}{path}"
        results[path] = {
            "no subprotocol": await attempt(url, None, None),
            "wrong token": await attempt(url, ["prefect"], {"type": "auth", "token": "hpc-garage:wrong"}),
            "no token": await attempt(url, ["prefect"], {"type": "auth"}),
            "no auth message": await attempt(url, ["prefect"], {"type": "filter"}),
            "the auth string": await attempt(url, ["prefect"], {"type": "auth", "token": auth}),
        }
    return results


@pytest.mark.slow
def test_a_real_browser_logs_in_and_sees_the_sweeps_task_runs(served: Served) -> None:
    """Debian's chromium (tests/browser.py): the "View at" link shows the login page and no data; with the auth
    string it opens the flow run, whose Task Runs tab lists the sweep's trials; the screenshot is kept."""
    from tests.browser import artifacts_dir, chromium_page

    shot = artifacts_dir() / "prefect-ui-flow-run.png"
    with chromium_page() as page:
        page.goto(served.view_at)
        password = page.locator("input[type=password]")
        password.wait_for(timeout=30_000)
        assert page.get_by_text("experiment-").count() == 0  # no data before the login
        password.fill("hpc-garage:wrong")
        page.get_by_role("button", name="Login").click()
        page.wait_for_timeout(1_000)
        assert "/login" in page.url and page.get_by_text("experiment-").count() == 0
        password.fill(served.state.auth)
        page.get_by_role("button", name="Login").click()
        page.wait_for_url(f"**/runs/flow-run/{served.flow_run}**", timeout=30_000)
        page.get_by_role("tab", name="Task Runs").click()
        trials = page.get_by_text(re.compile(r"^experiment-"))
        trials.first.wait_for(timeout=30_000)
        page.get_by_text(re.compile(r"^aggregate-")).first.wait_for(timeout=30_000)
        assert trials.count() >= 2
        page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 20_000
