"""(3) Per-task overhead: tasks/s of a flow of N trivial tasks on one running cluster (2 workers x 1 thread).

    python -m bench.overhead --tasks 100 --runs 5 --out overhead.json

Contenders, on the same cluster, one after another within each run: hpc-garage's `task_runner()`, plain
prefect-dask `DaskTaskRunner(address=...)`, raw `Client.map` (no Prefect), and Prefect's in-process
`ThreadPoolTaskRunner(max_workers=2)`. All Prefect runs use the same Prefect API (hpc-garage's server).

Tasks/s is N / (first submit -> last result) inside the flow: the per-task cost, without the flow run's
own start and end. The end-to-end flow time is kept too (for hpc-garage it includes waiting until the API
has recorded every task run, which plain prefect-dask does not do). Between runs the bench waits until the
Prefect server is idle, so no contender pays for another's backlog.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import Figure, Phases, compare, cpu_seconds, prefect_and_cluster, say, tasks_main, wait_idle

GROUP = "per-task overhead: {n} trivial tasks, 2 workers x 1 thread"
OURS = "hpc-garage task_runner()"
SWEPT = "hpc-garage task_runner(), results persisted + sweep cache"
PLAIN = "prefect-dask DaskTaskRunner(address=...)"
RAW = "raw Client.map (no Prefect)"
THREADS = "Prefect ThreadPoolTaskRunner(max_workers=2)"
PHASES = Phases()  # where the wall time goes


def main(argv: list[str] | None = None) -> int:
    return tasks_main(measure, argv, tasks=100)


def measure(n: int, runs: int) -> dict[str, Any]:
    with prefect_and_cluster(phase=lambda: PHASES("Prefect server and cluster up")) as (info, server_pid):
        return _measure(info, n, runs, server_pid) | {"phases": PHASES.to_dict()}


def _measure(info: dict[str, Any], n: int, runs: int, server_pid: int) -> dict[str, Any]:
    from distributed import Client
    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    import hpc_garage

    address = info["address"]

    @task
    def trivial(i: int) -> int:
        return i

    def prefect_run(make_runner: Any, count: int) -> dict[str, Any]:
        @flow(task_runner=make_runner(), name="bench-overhead")
        def many(count: int) -> tuple[float, list[int]]:
            start = time.perf_counter()
            values = [f.result() for f in trivial.map(range(count))]
            return time.perf_counter() - start, values

        start = time.perf_counter()
        state = many(count, return_state=True)
        wall = time.perf_counter() - start
        inner, values = state.result()
        assert values == list(range(count))
        return {"inner": inner, "wall": wall, "flow_run_id": str(state.state_details.flow_run_id)}

    def raw_run(count: int) -> dict[str, Any]:
        with Client(address) as client:
            start = time.perf_counter()
            values = client.gather(client.map(lambda i: i, range(count), pure=False))
            inner = time.perf_counter() - start
        assert values == list(range(count))
        return {"inner": inner, "wall": inner}

    results = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-sweep-results-{os.getpid()}"
    stored: list[float] = []  # bytes per trial, per run

    def swept_run(count: int) -> dict[str, Any]:
        """As `hpc-garage run` sets a sweep up: every trial's result persisted, keyed to a fresh sweep epoch
        (each run stores all its trials; none is read back)."""
        import shutil
        import uuid

        from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV

        directory = results / uuid.uuid4().hex
        directory.mkdir(parents=True)

        os.environ.update({SWEEP_ENV: f"bench-{directory.name}@1", RESULTS_ENV: str(directory)})
        try:  # the runner reads them when made (and when Prefect duplicates it for the flow run)
            result = prefect_run(lambda: hpc_garage.task_runner(address=address), count)
            files = [p for p in directory.iterdir() if p.is_file()]
            assert len(files) >= count, f"{len(files)} results stored for {count} trials"
            stored.append(sum(p.stat().st_size for p in files) / count)
            return result
        finally:
            os.environ.pop(SWEEP_ENV, None)
            os.environ.pop(RESULTS_ENV, None)
            shutil.rmtree(directory, ignore_errors=True)

    contenders = {
        OURS: lambda count: prefect_run(lambda: hpc_garage.task_runner(address=address), count),
        SWEPT: swept_run,
        PLAIN: lambda count: prefect_run(lambda: DaskTaskRunner(address=address), count),
        RAW: raw_run,
        THREADS: lambda count: prefect_run(lambda: ThreadPoolTaskRunner(max_workers=2), count),
    }
    pids = {"flow process": os.getpid(), "scheduler": info["scheduler_pid"], "Prefect server": server_pid,
            **{f"worker {i}": p for i, p in enumerate(info["worker_pids"])}}
    for name, run in contenders.items():  # warm-up: imports, first flow run, connections
        say(f"overhead: warm-up {name}")
        with PHASES("warm-up"):
            run(min(n, 5))
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    for i in range(runs):
        for name, run in contenders.items():
            if server_pid:
                with PHASES("waiting for the Prefect server to idle"):
                    wait_idle(server_pid)
            before = {k: _cpu(p) for k, p in pids.items()}
            with PHASES(f"run: {name}"):
                result = run(n)
            after = {k: _cpu(p) for k, p in pids.items()}
            result["cpu_ms_per_task"] = {k: round(1000 * (after[k] - before[k]) / n, 1) for k in pids}
            if name == OURS:  # read at once: the runner promises the API has them when the flow returns
                result["recorded"] = _recorded(result["flow_run_id"], n)
            samples[name].append(result)
            say(f"overhead run {i + 1}/{runs}: {name}: {n / result['inner']:.1f} tasks/s")
    group = GROUP.format(n=n)
    figures = [Figure(group, name, "tasks/s", [n / s["inner"] for s in samples[name]], ours=name == OURS,
                      higher_is_better=True) for name in contenders if name != SWEPT]
    compare(figures, ">= 5x plain prefect-dask; within 3x of ThreadPoolTaskRunner",
            lambda ours, peers: (ours.ratios[PLAIN] >= 5) and ours.ratios[THREADS] >= 1 / 3)
    swept = [Figure(group + ", results persisted", name, "tasks/s", [n / s["inner"] for s in samples[name]],
                    ours=name == SWEPT, higher_is_better=True) for name in (SWEPT, PLAIN)]
    compare(swept, ">= 5x plain prefect-dask (issue 10)", lambda ours, peers: ours.ratios[PLAIN] >= 5)
    wall_group = f"whole flow, {n} trivial tasks (flow start and end included; hpc-garage: until the API has them)"
    walls = [Figure(wall_group, name, "tasks/s", [n / s["wall"] for s in samples[name]], ours=name == OURS,
                    higher_is_better=True) for name in (OURS, PLAIN, THREADS)]
    compare(walls, "(context)", lambda ours, peers: None)
    recorded = [s["recorded"] for s in samples[OURS]]
    cpu = {name: {k: statistics.median(s["cpu_ms_per_task"][k] for s in samples[name]) for k in pids}
           for name in (OURS, PLAIN, THREADS)}
    return {"figures": [f.to_dict() for f in figures + swept + walls], "cpu_ms_per_task": cpu,
            "recorded_in_api": recorded, "tasks": n,
            "bytes_stored_per_trial": round(statistics.median(stored)) if stored else None}


def _cpu(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


def _recorded(flow_run_id: str, n: int) -> dict[str, int]:
    """How many of the last hpc-garage flow's task runs the API holds as COMPLETED, read right after it returned."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    completed = total = 0
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         limit=200, offset=offset)
            total += len(runs)
            completed += sum(r.state is not None and r.state.type.value == "COMPLETED" for r in runs)
            if len(runs) < 200:
                break
            offset += 200
    return {"submitted": n, "task_runs": total, "completed": completed}


if __name__ == "__main__":
    raise SystemExit(main())
