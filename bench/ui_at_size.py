"""(Issue 32, item 3) The Prefect UI after a large flow run: its flow-run page and task-runs tab in chromium.

    python -m bench.ui_at_size --tasks 30000 --databases sqlite,postgresql --out DIR

Per database: a fresh managed server in a private HOME, one flow of `--tasks` trivial tagged task runs
(bench/scripts/server_cost_flow.py), then Debian's chromium (Playwright, as tests/browser.py drives it) logs in
and opens the flow run's page: seconds from `goto` to the page's flow-run name shown, and from clicking the
Task Runs tab to its first task run shown. A screenshot of the tab goes to DIR/ui-<database>-<tasks>.png.
Writes DIR/ui-at-size.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PYTHON, ROOT, SCRIPTS, say
from bench.concurrent_sweeps import _post

FLOW = SCRIPTS / "server_cost_flow.py"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ui_at_size", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=30_000)
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    results = [measure(db, args.tasks, args.out) for db in args.databases.split(",")]
    (args.out / "ui-at-size.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0 if all(r.get("task_runs_tab_s") is not None for r in results) else 1


def measure(database: str, tasks: int, out: Path) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix=f"hpc-garage-ui-{database}-"))
    env = {**os.environ, "HOME": str(home), "HPC_GARAGE_PREFECT_DATABASE": database}
    for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE", "PREFECT_HOME"):
        env.pop(name, None)
    api = managed_api(env)
    result: dict[str, Any] = {"database": database, "tasks": tasks}
    try:
        began = time.monotonic()
        subprocess.run([PYTHON, str(FLOW), str(tasks), str(home / "flow.json")], cwd=home, env={**env, **api},
                       capture_output=True, text=True, check=True)
        flow_run = json.loads((home / "flow.json").read_text())["flow_run_id"]
        body = {"flow_runs": {"id": {"any_": [flow_run]}}}
        while int(_post(api, "/task_runs/count", body)) < tasks and time.monotonic() - began < 7200:
            time.sleep(2)
        result |= {"flow_run_id": flow_run, "flow_and_recorded_s": round(time.monotonic() - began, 1),
                   "task_runs_in_api": int(_post(api, "/task_runs/count", body))}
        result["caught_up_s"] = caught_up(env)  # its events stored too: the page as a user opens it later
        result |= browse(api, flow_run, out / f"ui-{database}-{tasks}.png")
    except Exception as exc:  # noqa: BLE001 - a bench: the failure is the result
        result["error"] = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        subprocess.run([PYTHON, "-m", "hpc_garage", "server", "stop", "--force"], env=env, cwd=ROOT,
                       capture_output=True)
    say(f"UI at size: {json.dumps(result)}")
    return result


def managed_api(env: dict[str, str]) -> dict[str, str]:
    """The managed server's API for the HOME in `env` (started if none runs): asked in a process of that HOME."""
    code = "import json; from hpc_garage.prefect.server import ensure_api; print(json.dumps(ensure_api(timeout=600)))"
    return json.loads(subprocess.run([PYTHON, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                                     check=True).stdout)


def caught_up(env: dict[str, str], quiet: float = 0.2, timeout: float = 1800) -> float:
    """Seconds until the server's CPU stays under `quiet` of a core for 3 s: it has stored and checked every
    event of the flow (events are stored after the task runs are recorded)."""
    import psutil

    code = "import json; from hpc_garage.prefect.server import server_status; print(json.dumps(server_status()))"
    status = json.loads(subprocess.run([PYTHON, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                                       check=True).stdout)
    server, began = psutil.Process(int(status["server_pid"])), time.monotonic()
    while time.monotonic() - began < timeout:
        before = sum(server.cpu_times()[:2])
        time.sleep(3)
        if sum(server.cpu_times()[:2]) - before < 3 * quiet:
            break
    return round(time.monotonic() - began, 1)


def browse(api: dict[str, str], flow_run: str, shot: Path) -> dict[str, Any]:
    """Log in, open the flow run's page, then its Task Runs tab: seconds to each shown, and a screenshot."""
    from playwright import sync_api

    ui = api["PREFECT_UI_URL"].rstrip("/")
    with tempfile.TemporaryDirectory(prefix="hpc-garage-chromium-") as profile, sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(profile, executable_path="/usr/bin/chromium", headless=True,
                                                       args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 900})
        try:
            page = browser.pages[0] if browser.pages else browser.new_page()
            sent: dict[Any, float] = {}
            took: list[tuple[float, str]] = []  # each API call's seconds, request to last byte
            page.on("request", lambda r: sent.__setitem__(r, time.monotonic()))
            page.on("requestfinished", lambda r: "/api/" in r.url and took.append(
                (time.monotonic() - sent.pop(r, time.monotonic()),
                 f"{r.method} {r.url.split('/api', 1)[1]} {(r.post_data or '')[:300]}".rstrip()
                 + f" (network {r.timing['responseEnd'] / 1000:.2f} s)")))
            page.goto(f"{ui}/runs/flow-run/{flow_run}")
            password = page.locator("input[type=password]")
            password.wait_for(timeout=60_000)
            password.fill(api["PREFECT_API_AUTH_STRING"])
            page.get_by_role("button", name="Login").click()
            page.wait_for_url(f"**/runs/flow-run/{flow_run}**", timeout=60_000)
            started = time.monotonic()  # the page again, logged in: what a user waits for
            page.goto(f"{ui}/runs/flow-run/{flow_run}")
            page.get_by_role("tab", name="Task Runs").wait_for(timeout=120_000)
            page_s = time.monotonic() - started
            started = time.monotonic()
            took.clear()
            page.get_by_role("tab", name="Task Runs").click()
            page.get_by_text(re.compile(r"^trial-")).first.wait_for(timeout=120_000)
            tab_s = time.monotonic() - started
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=False)
        finally:
            browser.close()
    slowest = [f"{what} {seconds:.2f} s" for seconds, what in sorted(took, reverse=True)[:5]]
    return {"flow_run_page_s": round(page_s, 2), "task_runs_tab_s": round(tab_s, 2), "screenshot": str(shot),
            "tab_slowest_calls": slowest}


if __name__ == "__main__":
    raise SystemExit(main())
