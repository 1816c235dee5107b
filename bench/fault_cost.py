"""(issue 11) What the API-outage hooks cost per task: tasks/s of a flow of N trivial *tagged* tasks through
hpc-garage's `task_runner()` on one running cluster (2 workers x 1 thread), hooks on vs bypassed.

    python -m bench.fault_cost --tasks 200 --runs 5 --out fault_cost.json

Issue 11's per-task hook is the tag-concurrency wrapper (compat.tag_limits_survive_outages): Prefect asks for
the tags' concurrency slots before every tagged task, and the wrapper keeps its last answer while the API
does not answer. The flow-state wrapper and the end-of-flow /health probe run per flow, not per task.
Bypassed: HPC_GARAGE_BENCH_BYPASS_OUTAGE_HOOKS=1 (prefect/outage.py's `bypassed`, read per call, set here and
on the workers), so every hook calls Prefect's own code straight through. Both contenders run on the same
cluster, interleaved within each run, with the same Prefect API (hpc-garage's server); the bench waits for the
server to idle before each flow. Tasks/s is N / (first submit -> last result) inside the flow; the whole
flow (start and end included) is kept too.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.common import Figure, compare, on_against_bypassed, prefect_and_cluster, tasks_main

GROUP = "issue 11 fault handling, per task: {n} trivial tagged tasks, 2 workers x 1 thread"
ON = "hpc-garage task_runner(), outage hooks on (default)"
OFF = "hpc-garage task_runner(), outage hooks bypassed"


def main(argv: list[str] | None = None) -> int:
    return tasks_main(measure, argv)


def measure(n: int, runs: int) -> dict[str, Any]:
    with prefect_and_cluster() as (info, server_pid):
        return _measure(info["address"], n, runs, server_pid)


def _measure(address: str, n: int, runs: int, server_pid: int) -> dict[str, Any]:
    from distributed import Client
    from prefect import flow, task

    import hpc_garage
    from hpc_garage.prefect.outage import BENCH_BYPASS_ENV

    @task(tags=["bench-fault-cost"])  # any tag: Prefect's tag-concurrency check runs before the task
    def trivial(i: int) -> int:
        return i

    @flow(task_runner=hpc_garage.task_runner(address=address), name="bench-fault-cost")
    def many(count: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        values = [f.result() for f in trivial.map(range(count))]
        return time.perf_counter() - start, values

    def bypass(on: bool) -> None:  # nested: pickled by value, so the workers need not import bench
        if on:
            os.environ[BENCH_BYPASS_ENV] = "1"
        else:
            os.environ.pop(BENCH_BYPASS_ENV, None)

    def run(bypassed: bool, count: int) -> dict[str, Any]:
        with Client(address) as client:
            assert set(client.run(bypass, bypassed).values()) == {None}
        bypass(bypassed)
        try:
            start = time.perf_counter()
            inner, values = many(count)
            wall = time.perf_counter() - start
        finally:
            bypass(False)
        assert values == list(range(count))
        return {"inner": inner, "wall": wall}

    contenders = {ON: False, OFF: True}
    samples = on_against_bypassed("fault cost", run, contenders, n, runs, server_pid)
    group = GROUP.format(n=n)
    figures = [Figure(group, name, "tasks/s", [n / s["inner"] for s in samples[name]], ours=name == ON,
                      higher_is_better=True) for name in contenders]
    compare(figures, ">= 0.95x bypassed (the hooks cost under 5% per task)",
            lambda ours, peers: ours.ratios[OFF] >= 0.95)
    wall_group = f"whole flow, {n} trivial tagged tasks (flow start and end included)"
    walls = [Figure(wall_group, name, "tasks/s", [n / s["wall"] for s in samples[name]], ours=name == ON,
                    higher_is_better=True) for name in contenders]
    compare(walls, "(context)", lambda ours, peers: None)
    return {"figures": [f.to_dict() for f in figures + walls], "tasks": n}


if __name__ == "__main__":
    raise SystemExit(main())
