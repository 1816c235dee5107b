"""(Issue 32, item 4) N Dask workers on one scheduler, measured: registration, the scheduler's CPU per worker,
heartbeat lag and workers removed for missed heartbeats, then a run of many trivial tasks over them.

    python -m bench.workers --sizes 128,256,512,1024 --per-process 128 --tasks 50000 --out workers.json

Started the way `hpc-garage run` starts a job's cluster: the scheduler in a process of its own (TLS, with a run
directory's per-run credentials, rundir.RunDir.write_credentials, and the run's placement installed), the workers
in other processes, with a launcher's options (launchers.common.worker_options: one thread, a memory limit and
the resources GPU=1, CPU=1, MEMORY, PROCESS=1) and security (launchers.common.security_from). To fit 1,024 on
this machine, each worker process holds `--per-process` `distributed.Worker` objects on one event loop (no
Nanny), with the workers' own memory monitor and profiler off (they share one process's memory and cores here,
which a real node's workers do not): the scheduler sees 1,024 TLS workers, each with its own connections and
heartbeats, which is what is measured.

Per size, in the scheduler process (a scheduler plugin and a wrapped heartbeat handler):
- registration: first to last worker registered (and the workers' processes started -> last registered);
- scheduler CPU per worker: the scheduler's main-thread CPU (its event loop, `time.thread_time` there) from the
  first to the last registration, divided by the workers after the first (as bench/scripts/registration_probe.py
  reads it for `run`);
- heartbeat lag: each worker's heartbeat arrival minus (its previous arrival + the interval the scheduler asked
  for in its reply), while registering and while the tasks run;
- workers removed, and how many for missed heartbeats (the scheduler's worker-ttl check).
At the sizes in `--task-sizes`: `--tasks` trivial tasks over the N workers (a client in this process, as a flow
is), held for at least `--hold` seconds (the issue's 10 minutes; less on a loaded machine, and the output says
what was used), counting the workers removed meanwhile. Finally the 32,768-worker registration model of
bench/scaling.py (`fit`) refitted from these points.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import PYTHON, ROOT, Figure, say, scratch
from bench.scaling import TARGET_NODES, TARGET_PER_NODE, fit

WORKER_MEMORY = 2 ** 30  # the memory limit (and MEMORY resource) each worker advertises; not enforced here
HEARTBEAT_HANDLER = "heartbeat_worker"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="role")
    scheduler = sub.add_parser("scheduler", help="internal: the scheduler process")
    scheduler.add_argument("directory", type=Path)
    scheduler.add_argument("--expected", type=int, required=True)
    scheduler.add_argument("--dask-defaults", action="store_true")
    workers = sub.add_parser("workers", help="internal: one process of workers")
    workers.add_argument("directory", type=Path)
    workers.add_argument("--first", type=int, required=True)
    workers.add_argument("--count", type=int, required=True)
    workers.add_argument("--cluster", type=int, required=True, help="workers in the whole cluster")
    workers.add_argument("--dask-defaults", action="store_true")
    parser.add_argument("--sizes", default="128,256,512,1024")
    parser.add_argument("--per-process", type=int, default=128, help="distributed.Worker objects per process")
    parser.add_argument("--tasks", type=int, default=50_000)
    parser.add_argument("--task-sizes", default="", help="sizes that also run the tasks (default: the largest)")
    parser.add_argument("--hold", type=float, default=600.0, help="seconds the task run lasts at least")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for all workers to register")
    parser.add_argument("--dask-defaults", action="store_true",
                        help="Dask's own settings, not hpc-garage's for large clusters (launchers.common.cluster_settings)")
    parser.add_argument("--runs", type=int, default=1, help="accepted for `python -m bench`; one run per size")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.role == "scheduler":
        _configure(args.expected, args.dask_defaults)
        return asyncio.run(_scheduler(args.directory, args.expected))
    if args.role == "workers":
        _configure(args.cluster, args.dask_defaults)
        return asyncio.run(_workers(args.directory, args.first, args.count))
    if not args.out:
        parser.error("--out is required")
    sizes = [int(x) for x in args.sizes.split(",")]
    with_tasks = {int(x) for x in args.task_sizes.split(",") if x} or {max(sizes)}
    samples = []
    for n in sizes:
        try:
            sample = measure(n, args.per_process, args.tasks if n in with_tasks else 0, args.hold, args.timeout,
                             args.dask_defaults)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal: the larger sizes may not fit
            say(f"workers: {n} failed: {type(exc).__name__}: {exc}"[:400])
            samples.append({"workers": n, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        samples.append(sample)
        say(f"workers: {n}: registered in {sample['registration_s']:.1f} s, scheduler CPU/worker "
            f"{sample['cpu_per_worker_s'] * 1000:.2f} ms, heartbeat lag p99 {sample['registering']['lag_p99_s']:.2f} s, "
            f"removed {sample['removed']}, load {sample['load']:.1f}")
    result = summarize(samples, args.tasks, args.hold, args.per_process)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


def _configure(workers: int, defaults: bool) -> None:
    """hpc-garage's Dask settings for a cluster this size, as `run` sets them (unless --dask-defaults)."""
    if not defaults:
        import dask

        from hpc_garage.launchers.common import cluster_settings

        dask.config.set(cluster_settings(workers))


def measure(n: int, per_process: int, tasks: int, hold: float, timeout: float,
            defaults: bool = False) -> dict[str, Any]:
    """One size: a scheduler process, ceil(n / per_process) worker processes, the figures; all ended after."""
    from hpc_garage.rundir import RunDir

    directory = scratch("workers-")
    rundir = RunDir(directory / "run")
    rundir.path.mkdir(parents=True)
    tls = rundir.write_credentials()  # the job's per-run TLS credentials, as `run` writes them
    (directory / "tls.json").write_text(json.dumps(tls))
    argv = [PYTHON, "-m", "bench.workers"]
    flags = ["--dask-defaults"] if defaults else []
    env = {**os.environ, "DASK_LOGGING__DISTRIBUTED": "error"}  # 1,024 workers' start and close chatter
    processes = [subprocess.Popen([*argv, "scheduler", str(directory), "--expected", str(n), *flags], cwd=ROOT, env=env)]
    try:
        address = _wait_for(directory / "address", 120, processes).read_text().strip()
        started = time.time()
        for first in range(0, n, per_process):
            processes.append(subprocess.Popen([*argv, "workers", str(directory), "--first", str(first),
                                               "--count", str(min(per_process, n - first)),
                                               "--cluster", str(n), *flags], cwd=ROOT, env=env))
        _wait_for(directory / "registered", timeout, processes)
        settings = json.loads((directory / "settings.json").read_text())
        load = os.getloadavg()[0]
        rss = {"scheduler_mb": _rss_mb(processes[0].pid),
               "worker_process_mb": max(_rss_mb(p.pid) for p in processes[1:])}
        run = _tasks(address, tls, tasks, hold, n) if tasks else None
        (directory / "stop").touch()
        stats = json.loads(_wait_for(directory / "stats.json", 120, processes[:1]).read_text())
    finally:
        (directory / "stop").touch()
        (directory / "stop-workers").touch()
        for p in reversed(processes):
            _end(p)
        shutil.rmtree(directory, ignore_errors=True)
    return analyse(stats, n, started) | {"load": load, "tasks": run, "rss": rss, "settings": settings}


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _wait_for(path: Path, timeout: float, processes: list[subprocess.Popen[bytes]]) -> Path:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if dead := [p.args for p in processes if p.poll() not in (None, 0)]:
            raise RuntimeError(f"a bench process exited: {' '.join(map(str, dead[0]))[-200:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} not written within {timeout:.0f} s")
        time.sleep(0.1)
    return path


def _end(process: subprocess.Popen[bytes]) -> None:
    try:
        process.wait(20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tasks(address: str, tls: dict[str, str], tasks: int, hold: float, n: int) -> dict[str, Any]:
    """`tasks` trivial tasks through a client, as a flow submits them; then idle until `hold` s have passed."""
    from distributed import Client

    from hpc_garage.cluster.handoff import workers_now
    from hpc_garage.launchers.common import security_from

    with Client(address, security=security_from(tls), timeout=120) as client:
        begun = time.time()
        futures = client.map(_trivial, range(tasks), pure=False)
        total = sum(client.gather(futures))
        done = time.time()
        del futures
        while time.time() - begun < hold:
            time.sleep(1)
        workers = len(workers_now(client))
    return {"tasks": tasks, "seconds": done - begun, "rate": tasks / max(done - begun, 1e-9), "held_s": time.time() - begun,
            "right": total == tasks * (tasks - 1) // 2 + tasks, "workers_after": workers, "started": begun, "ended": done}


def _trivial(x: int) -> int:
    return x + 1


async def _scheduler(directory: Path, expected: int) -> int:
    """The scheduler, as `run` starts it (TLS, the run's placement), recording what `analyse` needs."""
    from distributed import Scheduler
    from distributed.diagnostics.plugin import SchedulerPlugin

    from hpc_garage.cluster.placement import install
    from hpc_garage.launchers.common import security_from

    tls = json.loads((directory / "tls.json").read_text())
    record: dict[str, Any] = {"added": [], "removed": [], "lag": [], "cpu": []}
    last: dict[str, tuple[float, float]] = {}

    class Recorder(SchedulerPlugin):
        def add_worker(self, scheduler: Any, worker: str) -> None:
            record["added"].append(time.time())
            record["cpu"].append([time.thread_time(), time.process_time()])
            if len(scheduler.workers) == expected:
                (directory / "registered").touch()

        def remove_worker(self, scheduler: Any, worker: str, *, stimulus_id: str = "", **kwargs: Any) -> None:
            record["removed"].append([time.time(), stimulus_id])

    scheduler = Scheduler(port=0, dashboard_address=":0", security=security_from(tls), protocol="tls",
                          host="127.0.0.1")
    install(scheduler)
    scheduler.add_plugin(Recorder())
    handler = scheduler.handlers[HEARTBEAT_HANDLER]

    def heartbeat(**kwargs: Any) -> Any:
        now, address = time.time(), kwargs.get("address", "")
        if address in last:
            record["lag"].append([now, now - last[address][0] - last[address][1]])
        reply = handler(**kwargs)
        last[address] = (now, float(reply.get("heartbeat-interval", 0)) if isinstance(reply, dict) else 0.0)
        return reply

    scheduler.handlers[HEARTBEAT_HANDLER] = heartbeat
    import dask

    keys = ("distributed.comm.timeouts.connect", "distributed.comm.timeouts.tcp", "distributed.scheduler.worker-ttl")
    (directory / "settings.json").write_text(json.dumps({k: str(dask.config.get(k)) for k in keys}))
    await scheduler
    (directory / "address.tmp").write_text(scheduler.address)
    os.replace(directory / "address.tmp", directory / "address")
    while not (directory / "stop").exists():
        await asyncio.sleep(0.2)
    record["ttl_s"] = scheduler.worker_ttl
    record["end_cpu"] = [time.thread_time(), time.process_time()]
    (directory / "stats.tmp").write_text(json.dumps(record))
    os.replace(directory / "stats.tmp", directory / "stats.json")
    await scheduler.close()
    return 0


async def _workers(directory: Path, first: int, count: int) -> int:
    """`count` workers on this process's event loop, each started with a launcher's options."""
    import dask
    from distributed import Worker

    from hpc_garage.core.layout import WorkerSpec
    from hpc_garage.launchers.common import security_from, worker_options

    # Shared by `count` workers here, unlike a node's: no memory monitor (the process's RSS is all of theirs)
    # and no profiler (a 10 ms sampler per worker would take these cores from the scheduler).
    dask.config.set({"distributed.worker.memory.target": False, "distributed.worker.memory.spill": False,
                     "distributed.worker.memory.pause": False, "distributed.worker.memory.terminate": False,
                     "distributed.worker.profile.enabled": False})
    tls = json.loads((directory / "tls.json").read_text())
    address = (directory / "address").read_text().strip()
    security = security_from(tls)
    workers = []
    for i in range(first, first + count):
        spec = WorkerSpec(name=f"bench-{i}", node=i // 8, host=None, local_rank=i % 8, nthreads=1,
                          memory_limit=WORKER_MEMORY,
                          resources={"GPU": 1, "CPU": 1, "MEMORY": WORKER_MEMORY, "PROCESS": 1})
        options = worker_options(spec, security=security, protocol="tls", host="127.0.0.1")
        options.pop("env", None)  # a Nanny's option: these Workers share this process's environment
        workers.append(Worker(address, **options))
    await asyncio.gather(*(w.start() for w in workers))
    while not (directory / "stats.json").exists() and not (directory / "stop-workers").exists():
        await asyncio.sleep(0.5)  # until the scheduler has written what it saw (removals after it are ours)
    await asyncio.gather(*(w.close(timeout=5) for w in workers), return_exceptions=True)
    return 0


def _spelled(settings: dict[str, str]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[1]} {v}" for k, v in settings.items())


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _lags(lags: list[list[float]], start: float, end: float) -> dict[str, float]:
    inside = [lag for at, lag in lags if start <= at <= end]
    return {"heartbeats": len(inside), "lag_median_s": statistics.median(inside) if inside else 0.0,
            "lag_p99_s": _quantile(inside, 0.99), "lag_max_s": max(inside, default=0.0)}


def analyse(stats: dict[str, Any], n: int, started: float) -> dict[str, Any]:
    """One size's figures from the scheduler's record (registration times and CPU, heartbeat lags, removals)."""
    added = stats["added"][:n]
    cpu = stats["cpu"][:n]
    first, last = added[0], added[-1]
    removed = stats["removed"]
    return {"workers": n, "registration_s": last - first, "from_start_s": last - started,
            "cpu_per_worker_s": (cpu[-1][0] - cpu[0][0]) / max(1, n - 1),
            "window_cpu_s": cpu[-1][0] - cpu[0][0], "process_cpu_s": cpu[-1][1] - cpu[0][1],
            "registering": _lags(stats["lag"], first, last),
            "after": _lags(stats["lag"], last, float("inf")),
            "removed": len(removed), "removed_for_heartbeats": sum("worker-ttl" in r[1] for r in removed),
            "worker_ttl_s": stats.get("ttl_s")}


def summarize(samples: list[dict[str, Any]], tasks: int, hold: float, per_process: int) -> dict[str, Any]:
    """Figures for the report, and the 32,768-worker registration model refitted from the measured sizes."""
    figures: list[Figure] = []
    label = "hpc-garage: TLS scheduler process, launcher-shaped workers"
    good = [s for s in samples if "error" not in s]
    for s in samples:
        group = f"{s['workers']:,} workers on one scheduler: first to last registered"
        if "error" in s:
            figures.append(Figure(group, label, "s", [], ours=True, note=s["error"]))
            continue
        reg, after = s["registering"], s["after"]
        note = (f"{s['workers']:,} workers: scheduler main-thread CPU per worker {s['cpu_per_worker_s'] * 1000:.2f} ms; processes started -> "
                f"all registered {s['from_start_s']:.1f} s; heartbeat lag while registering median "
                f"{reg['lag_median_s']:.2f} s, p99 {reg['lag_p99_s']:.2f} s, max {reg['lag_max_s']:.2f} s; after: "
                f"p99 {after['lag_p99_s']:.2f} s, max {after['lag_max_s']:.2f} s; removed {s['removed']} "
                f"({s['removed_for_heartbeats']} for missed heartbeats, worker-ttl {s['worker_ttl_s']} s); "
                f"Dask settings {_spelled(s['settings'])}; {per_process} workers per process (RSS {s['rss']['worker_process_mb']:.0f} MB each, the "
                f"scheduler {s['rss']['scheduler_mb']:.0f} MB); load {s['load']:.1f}")
        figures.append(Figure(group, label, "s", [s["registration_s"]], ours=True, note=note))
        if run := s.get("tasks"):
            figures.append(Figure(f"{s['workers']:,} workers: {run['tasks']:,} trivial tasks (Client.map), held "
                                  f"{run['held_s']:.0f} s (asked {hold:.0f} s)", label, "tasks/s", [run["rate"]],
                                  ours=True, note=(f"{s['workers']:,} workers: {run['seconds']:.1f} s for the tasks; result right: {run['right']}; "
                                                   f"workers after {run['workers_after']} of {s['workers']}; removed "
                                                   f"during the whole size {s['removed']}")))
    model = refit(good)
    if model:
        figures.append(Figure(f"registration extrapolated to {model['target']:,} workers (model: workers x the "
                              "scheduler's CPU per worker, refitted from the measured sizes)", label, "s",
                              [model["predicted_s"]], ours=True,
                              note=(f"least squares over {model['points']} sizes up to {model['largest']:,} workers: "
                                    f"scheduler CPU {model['cpu_per_worker_s'] * 1000:.2f} ms per worker; the wall-clock "
                                    f"line, {model['per_worker_s'] * 1000:.2f} ms per worker and intercept "
                                    f"{model['intercept_s']:.2f} s, follows this machine's load")))
    return {"figures": [f.to_dict() for f in figures], "samples": samples, "model": model,
            "settings": {"tasks": tasks, "hold_s": hold, "per_process": per_process}}


def refit(good: list[dict[str, Any]]) -> dict[str, Any] | None:
    """bench/scaling.py's model refitted from these sizes: registration takes at least the scheduler's event-loop
    CPU, workers x its per-worker slope (least squares over the sizes' windows), what stays serial at any scale;
    the wall-clock line is kept beside it (on a shared machine it follows the load more than the size). Every
    measured size is a point; the prediction is never negative (a falling CPU line, which only noise makes, is
    replaced by the line through the origin). None below 2 sizes."""
    if len({s["workers"] for s in good}) < 2:
        return None
    target = TARGET_NODES * TARGET_PER_NODE
    a, b = fit([(s["workers"], s["registration_s"]) for s in good])
    first, cpu = fit([(s["workers"] - 1, s["window_cpu_s"]) for s in good])
    if cpu <= 0:  # noise on a loaded machine: the line through the origin (total CPU / workers), never below 0
        points = [(s["workers"] - 1, s["window_cpu_s"]) for s in good]
        first, cpu = 0.0, max(0.0, sum(x * y for x, y in points) / max(1, sum(x * x for x, _ in points)))
    return {"target": target, "intercept_s": a, "per_worker_s": b, "predicted_s": max(0.0, first) + cpu * target,
            "cpu_per_worker_s": cpu, "cpu_intercept_s": first, "points": len(good),
            "largest": max(s["workers"] for s in good)}


if __name__ == "__main__":
    sys.exit(main())
