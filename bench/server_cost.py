"""(Issue 32, item 2) The managed Prefect server's CPU per task run, and its database's growth per task run.

    python -m bench.server_cost --tasks 2000 --variants managed,prefect --out server.json

For each variant (a set of server settings), a fresh managed server under a private HOME (sqlite), then one
flow of `--tasks` trivial tagged task runs (bench/scripts/server_cost_flow.py: Prefect's own task engine in
threads, so every task run sends the server what it sends from a Dask worker: its state events, its log
lines, its tag concurrency checks, without a cluster's CPU beside the server). Measured on the server's whole
session (keeper, `prefect server start`, PostgreSQL when used): its CPU seconds from the flow's start until the
API holds every task run COMPLETED, less what the idle server burns in as long (read over `IDLE_WINDOW` s
before the flow: Prefect's services poll); and the database's growth (its files and WAL) per task run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PYTHON, ROOT, SCRIPTS, Figure, say
from bench.concurrent_sweeps import SessionSampler, _post

FLOW = SCRIPTS / "server_cost_flow.py"
IDLE_WINDOW = 15.0  # s of the idle server's CPU read before each flow
SETTLE = 5.0  # s after start-up before the idle window: services start in the background
# Prefect's own defaults for what hpc_garage.prefect.server.managed.BATCHING changes (set explicitly: the
# managed server keeps a user's setting)
PREFECT_DEFAULTS = {
    **{f"PREFECT_SERVER_SERVICES_{s}_{k}": v for s in ("TASK_RUN_RECORDER", "EVENT_PERSISTER")
       for k, v in (("READ_BATCH_SIZE", "1"), ("FLUSH_INTERVAL", "5"))},
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "20",
    "PREFECT_SERVER_SERVICES_TRIGGERS_READ_BATCH_SIZE": "1",
}
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "managed": ("hpc-garage's managed server (its settings today)", {}),
    "prefect": ("Prefect's own service settings", PREFECT_DEFAULTS),
    "no-triggers": ("no automations service", {"PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false"}),
    "no-event-store": ("events not stored (PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED=false)", {"PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false"}),
    "no-stream": ("no event stream out", {"PREFECT_SERVER_EVENTS_STREAM_OUT_ENABLED": "false"}),
    "no-api-logs": ("no logs to the API", {"PREFECT_LOGGING_TO_API_ENABLED": "false"}),
    "big-batches": ("batches of 500, flushed every 2 s", {
        f"PREFECT_SERVER_SERVICES_{s}_{k}": v for s in ("TASK_RUN_RECORDER", "EVENT_PERSISTER")
        for k, v in (("READ_BATCH_SIZE", "500"), ("BATCH_SIZE", "500"), ("FLUSH_INTERVAL", "2"))}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.server_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--variants", default="managed,prefect", help=f"comma-separated of {','.join(VARIANTS)}")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    samples: dict[str, list[dict[str, Any]]] = {}
    for i in range(args.runs):
        for name in args.variants.split(","):
            sample = measure(name, args.tasks)
            samples.setdefault(name, []).append(sample)
            say(f"server cost {i + 1}/{args.runs}: {name}: {json.dumps(sample)}")
    Path(args.out).write_text(json.dumps(summarize(samples, args.tasks), indent=2))
    return 0 if all(s["complete"] for runs in samples.values() for s in runs) else 1


def measure(variant: str, tasks: int, timeout: float = 3600) -> dict[str, Any]:
    """One fresh managed server with `variant`'s settings, one flow of `tasks` task runs: CPU and database."""
    home = Path(tempfile.mkdtemp(prefix=f"hpc-garage-server-cost-{variant}-"))
    env = {**os.environ, "HOME": str(home), "HPC_GARAGE_PREFECT_DATABASE": "sqlite", **VARIANTS[variant][1]}
    for name in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "PREFECT_PROFILE", "PREFECT_HOME"):
        env.pop(name, None)
    code = "import json; from hpc_garage.prefect.server import ensure_api; print(json.dumps(ensure_api(timeout=600)))"
    api = json.loads(subprocess.run([PYTHON, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout)
    status = json.loads(subprocess.run([PYTHON, "-m", "hpc_garage", "server", "status"], env=env, cwd=ROOT,
                                       capture_output=True, text=True, check=True).stdout)
    database = Path(status["state_file"]).parent / "home"
    try:
        time.sleep(SETTLE)
        sampler = SessionSampler(int(status["pid"]))
        sampler.start()
        time.sleep(IDLE_WINDOW)
        idle_rate = sampler.cpu_seconds() / IDLE_WINDOW
        size_before, cpu_before, began = _bytes(database), sampler.cpu_seconds(), time.monotonic()
        out = home / "flow.json"
        flow = subprocess.run([PYTHON, str(FLOW), str(tasks), str(out)], cwd=home, env={**env, **api},
                              capture_output=True, text=True, timeout=timeout)
        record = json.loads(out.read_text()) if out.exists() else {"state": f"exit {flow.returncode}"}
        flow_s = time.monotonic() - began
        recorded = _wait_recorded(api, record.get("flow_run_id"), tasks, timeout)
        seconds = time.monotonic() - began
        sampler.stop()
        busy = sampler.cpu_seconds() - cpu_before
        size_after = _bytes(database)
    finally:
        subprocess.run([PYTHON, "-m", "hpc_garage", "server", "stop", "--force"], env=env, cwd=ROOT,
                       capture_output=True)
    return {"variant": variant, "tasks": tasks, "complete": record.get("state") == "COMPLETED" and recorded == tasks,
            "recorded": recorded, "flow_s": round(flow_s, 1), "seconds": round(seconds, 1),
            "server_cpu_s": round(busy, 2), "idle_cpu_per_s": round(idle_rate, 4),
            "cpu_ms_per_task": round(1000 * cpu_per_task(busy, idle_rate, seconds, tasks), 2),
            "raw_cpu_ms_per_task": round(1000 * busy / tasks, 2),
            "database_mb_per_100k": round((size_after - size_before) / tasks * 100_000 / 2**20, 1),
            "load": round(os.getloadavg()[0], 1), "home": str(home),
            "flow_error": "" if flow.returncode == 0 else flow.stderr[-400:]}


def cpu_per_task(busy_s: float, idle_per_s: float, seconds: float, tasks: int) -> float:
    """The server's CPU for the task runs themselves: what it spent meanwhile, less what it spends idle in as
    long (never below 0)."""
    return max(0.0, busy_s - idle_per_s * seconds) / max(1, tasks)


def _wait_recorded(api: dict[str, str], flow_run_id: str | None, tasks: int, timeout: float) -> int:
    """Poll until the API holds the flow's task runs COMPLETED (the server records them from events)."""
    if not flow_run_id:
        return 0
    body = {"flow_runs": {"id": {"any_": [flow_run_id]}}, "task_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
    deadline, count = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        count = int(_post(api, "/task_runs/count", body))
        if count >= tasks:
            break
        time.sleep(0.5)
    return count


def _bytes(directory: Path) -> int:
    """The SQLite database's pages in use, the write-ahead log's included (its files' sizes undercount: the
    log is reused after each checkpoint, and the main file grows only as pages are checkpointed)."""
    import sqlite3

    total = 0
    for path in directory.glob("*.db"):
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            pages, free, size = (db.execute(f"PRAGMA {p}").fetchone()[0]
                                 for p in ("page_count", "freelist_count", "page_size"))
            total += (pages - free) * size
    return total


def summarize(samples: dict[str, list[dict[str, Any]]], tasks: int) -> dict[str, Any]:
    figures = []
    for name, runs in samples.items():
        label = VARIANTS[name][0]
        last = runs[-1]
        note = (f"{tasks:,} task runs, flow {last['flow_s']} s, all recorded after {last['seconds']} s; "
                f"server CPU {last['server_cpu_s']} s in all, idle {last['idle_cpu_per_s'] * 1000:.1f} ms/s subtracted "
                f"({last['raw_cpu_ms_per_task']} ms per task run before); database +{last['database_mb_per_100k']} MB "
                f"per 100,000 task runs; load {last['load']}")
        figures.append(Figure(f"managed Prefect server (sqlite): CPU per task run, {tasks:,} trivial tagged task runs",
                              label, "ms", [r["cpu_ms_per_task"] for r in runs], ours=name == "managed",
                              goal="<= 4 ms" if name == "managed" else "",
                              met=None if name != "managed" else all(r["cpu_ms_per_task"] <= 4 for r in runs),
                              note=note).to_dict())
        figures.append(Figure(f"managed Prefect server (sqlite): database growth per 100,000 task runs", label, "MB",
                              [r["database_mb_per_100k"] for r in runs], ours=name == "managed").to_dict())
    return {"figures": figures, "samples": samples}


if __name__ == "__main__":
    raise SystemExit(main())
