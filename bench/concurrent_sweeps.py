"""Two sweeps of N short trials each, started at the same moment against one managed Prefect server.

    python -m bench.concurrent_sweeps --tasks 2000 --databases sqlite,postgresql --out DIR

For each database (a fresh managed server under a private HOME each time): both sweeps' outcome, every task
run's state as the API holds it, the 503 and "database is locked" lines the sweeps and the server logged
(the server runs with PREFECT_API_LOG_RETRYABLE_ERRORS=true, so each retryable error it answered is in its
log), and the server's peak RSS (the keeper, `prefect server start` and PostgreSQL's processes together)
and CPU seconds per task run. Writes DIR/concurrent-sweeps.json and .md; tests/test_prefect_server_sweeps.py
runs the same at a CI size.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import PYTHON, ROOT, SCRIPTS, say

SWEEP = SCRIPTS / "concurrent_sweep.py"
TICKS = os.sysconf("SC_CLK_TCK")
# a 503 as httpx and Prefect's client word it, SQLite's lock, and the server's PREFECT_API_LOG_RETRYABLE_ERRORS line
RETRYABLE = re.compile(r"503 Service Unavailable|status code 503|database is locked|Encountered retryable exception")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.concurrent_sweeps", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000, help="trials per sweep (two sweeps at once)")
    parser.add_argument("--databases", default="sqlite,postgresql")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [run_pair(db, args.tasks) for db in args.databases.split(",")]
    (args.out / "concurrent-sweeps.json").write_text(json.dumps(results, indent=2))
    (args.out / "concurrent-sweeps.md").write_text(markdown(results))
    print(markdown(results))
    return 0 if all(r["complete"] for r in results) else 1


def run_pair(database: str, tasks: int, home: Path | None = None, timeout: float = 1800) -> dict[str, Any]:
    """Start a managed server on `database` under `home`, run two sweeps of `tasks` at once, read the API."""
    home = home or Path(tempfile.mkdtemp(prefix=f"hpc-garage-sweeps-{database}-"))
    env = {**os.environ, "HOME": str(home), "HPC_GARAGE_PREFECT_DATABASE": database,
           "PREFECT_API_LOG_RETRYABLE_ERRORS": "true"}
    for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE", "PREFECT_HOME"):
        env.pop(name, None)
    code = "import json; from hpc_garage.prefect.server import ensure_api; print(json.dumps(ensure_api(timeout=600)))"
    began = time.monotonic()
    api = json.loads(subprocess.run([PYTHON, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout)
    server_up = time.monotonic() - began
    status = json.loads(subprocess.run([PYTHON, "-m", "hpc_garage", "server", "status"], env=env, cwd=ROOT,
                                       capture_output=True, text=True, check=True).stdout)
    keeper = int(status["pid"])
    sampler = SessionSampler(keeper)
    sampler.start()
    say(f"concurrent sweeps on {database}: server up in {server_up:.1f} s, 2 x {tasks} trials")
    sweeps = []
    started = time.monotonic()
    for i in range(2):
        out = home / f"sweep-{i}.json"
        log = open(home / f"sweep-{i}.log", "w")
        sweeps.append((out, log, subprocess.Popen([PYTHON, str(SWEEP), str(tasks), str(out)], cwd=home,
                                                  env={**env, **api}, stdout=log, stderr=subprocess.STDOUT)))
    codes = []
    for out, log, process in sweeps:
        try:
            codes.append(process.wait(timeout=max(1.0, timeout - (time.monotonic() - started))))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
        log.close()
    wall = time.monotonic() - started
    sampler.stop()
    flows = []
    for i, (out, _, _) in enumerate(sweeps):
        record = json.loads(out.read_text()) if out.exists() else {"state": "NO RESULT"}
        flow_run_id = record.get("flow_run_id")
        text = (home / f"sweep-{i}.log").read_text(errors="replace")
        if flow_run_id in (None, "None"):  # the flow never had a run at the API: say why, ask the API nothing
            record["log_tail"] = text.splitlines()[-15:]
        counts = task_run_counts(api, flow_run_id) if flow_run_id not in (None, "None") else {}
        flows.append({**record, "exit": codes[i], "task_runs": counts,
                      "retryable_lines": sum(1 for line in text.splitlines() if RETRYABLE.search(line)),
                      # what the sweep warned of (hpc-garage's own lines: an API that had not recorded every task)
                      "warnings": [line for line in text.splitlines() if "WARNING" in line][:10]})
    server_log = Path(status["log"]).read_text(errors="replace")
    result = {
        "database": database, "tasks_per_sweep": tasks, "flows": flows, "wall_s": round(wall, 1),
        "server_start_s": round(server_up, 1),
        "server_retryable_errors": sum(1 for line in server_log.splitlines() if RETRYABLE.search(line)),
        # each 503 the server answered (one "Encountered retryable exception" line each), by endpoint
        "server_503": server_log.count("Encountered retryable exception in request"),
        "server_503_by_endpoint": {name: n for name, n in _endpoints(server_log).items()},
        # what else the server logged as an error (its task-run recorder dropping events says so here)
        "server_errors": [line for line in server_log.splitlines()
                          if " ERROR " in line or "Dropping event" in line][:10],
        "server_peak_rss_mb": round(sampler.peak_rss / 2**20, 1),
        "server_cpu_s": round(sampler.cpu_seconds(), 1),
        "server_cpu_ms_per_task": round(1000 * sampler.cpu_seconds() / (2 * tasks), 2),
        "home": str(home),
    }
    result["complete"] = all(f["state"] == "COMPLETED" and f["task_runs"].get("COMPLETED") == tasks
                             and sum(f["task_runs"].values()) == tasks for f in flows)
    subprocess.run([PYTHON, "-m", "hpc_garage", "server", "stop", "--force"], env=env, cwd=ROOT, capture_output=True)
    if database == "postgresql" and os.geteuid() == 0:  # as root its data lives outside HOME, in /var/tmp
        from hpc_garage.prefect.server import ManagedPostgres, ServerDir

        shutil.rmtree(ManagedPostgres(ServerDir(Path(status["state_file"]).parent)).base, ignore_errors=True)
    say(f"concurrent sweeps on {database}: {json.dumps({k: v for k, v in result.items() if k != 'flows'})}")
    return result


def _endpoints(server_log: str) -> dict[str, int]:
    """The API function of each retryable error's traceback (its innermost frame in prefect/server/api/)."""
    counts: dict[str, int] = {}
    for trace in server_log.split("Encountered retryable exception in request")[1:]:
        frames = re.findall(r'prefect/server/api/(\w+)\.py", line \d+, in (\w+)', trace.split("\nERROR:")[0])
        frames = [f for f in frames if f[0] != "server"]
        if frames:
            name = f"{frames[0][0]}.{frames[0][1]}"
            counts[name] = counts.get(name, 0) + 1
    return counts


def task_run_counts(api: dict[str, str], flow_run_id: str) -> dict[str, int]:
    """Task runs of one flow run by state type, as the API holds them."""
    counts = {}
    for state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED", "PENDING", "RUNNING", "SCHEDULED", "PAUSED",
                  "CANCELLING"):
        body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "task_runs": {"state": {"type": {"any_": [state]}}}}
        if n := _post(api, "/task_runs/count", body):
            counts[state] = int(n)
    return counts


def _post(api: dict[str, str], path: str, body: dict[str, Any]) -> Any:
    token = base64.b64encode(api["PREFECT_API_AUTH_STRING"].encode()).decode()
    request = urllib.request.Request(api["PREFECT_API_URL"] + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Basic {token}", "Content-Type": "application/json"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=60) as response:
        return json.loads(response.read())


class SessionSampler(threading.Thread):
    """Every 0.2 s: the summed RSS of every process in the server's session (keeper, uvicorn, PostgreSQL and
    its backends), its peak, and each process's CPU seconds as last seen (a backend that exits keeps its last)."""

    def __init__(self, session: int) -> None:
        super().__init__(daemon=True)
        self.session, self.peak_rss, self.cpu = session, 0, {}
        self._stop_event = threading.Event()
        self.baseline = dict(self._snapshot()[1])

    def run(self) -> None:
        while not self._stop_event.wait(0.2):
            rss, cpu = self._snapshot()
            self.peak_rss = max(self.peak_rss, rss)
            self.cpu.update(cpu)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
        self.cpu.update(self._snapshot()[1])

    def cpu_seconds(self) -> float:
        return sum(v - self.baseline.get(k, 0.0) for k, v in self.cpu.items())

    def _snapshot(self) -> tuple[int, dict[tuple[int, int], float]]:
        rss, cpu = 0, {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) != self.session:  # field 6 of stat: the session id
                    continue
                rss += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
                cpu[(int(proc.name), int(fields[19]))] = (int(fields[11]) + int(fields[12])) / TICKS
            except (OSError, IndexError, ValueError):
                continue
        return rss, cpu


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| database | trials | flows COMPLETED | task runs COMPLETED in the API | 503 or lock error reaching a sweep "
             "| 503s the server answered (retried by the client) | wall | server peak RSS | server CPU per task |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        done = sum(f["state"] == "COMPLETED" for f in r["flows"])
        runs = sum(f["task_runs"].get("COMPLETED", 0) for f in r["flows"])
        lines.append(f"| {r['database']} | 2 x {r['tasks_per_sweep']} | {done} of 2 | {runs} of {2 * r['tasks_per_sweep']} "
                     f"| {sum(f['retryable_lines'] for f in r['flows'])} | {r['server_503']} "
                     f"{json.dumps(r['server_503_by_endpoint']) if r['server_503'] else ''} "
                     f"| {r['wall_s']} s | {r['server_peak_rss_mb']} MB | {r['server_cpu_ms_per_task']} ms |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
