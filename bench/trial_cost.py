"""(issue 24) What the per-trial API costs trials that never call it: tasks/s of a flow of N trivial swept
tasks (cached on the sweep's results directory, as under `hpc-garage run`) through hpc-garage's
`task_runner()` on one running cluster (2 workers x 1 thread), the trial bookkeeping on vs bypassed.

    python -m bench.trial_cost --tasks 200 --runs 5 --out trial_cost.json

The one per-task cost issue 24 adds: the sweep cache notes each trial's result key by its task run id as it
computes it (cluster/stopping.note_trial, a bounded dictionary insert), for `checkpoint_dir()` and the
wind-down's record. `should_stop()`, `checkpoint_dir()` and the wind-down cost nothing to a trial that never
calls them. Bypassed: the note replaced by a no-op in the workers (client.run) for that flow only. Both
contenders run on the same cluster, interleaved within each run, with fresh inputs each run (no result is
read back from an earlier one).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Figure, compare, on_against_bypassed, prefect_and_cluster, tasks_main

GROUP = "issue 24 per-trial API, trials that never call it: {n} trivial swept tasks, 2 workers x 1 thread"
ON = "hpc-garage task_runner(), trial bookkeeping on (default)"
OFF = "hpc-garage task_runner(), trial bookkeeping bypassed"


def main(argv: list[str] | None = None) -> int:
    return tasks_main(measure, argv)


def measure(n: int, runs: int) -> dict[str, Any]:
    from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV

    with tempfile.TemporaryDirectory(prefix="bench-trial-cost-") as results:
        os.environ[SWEEP_ENV], os.environ[RESULTS_ENV] = "bench-trial-cost@1", results  # as `run` exports them
        with prefect_and_cluster() as (info, server_pid):
            found = _measure(info["address"], n, runs, server_pid)
        stored = sum(1 for p in Path(results).iterdir() if p.is_file() and not p.name.startswith("."))
        assert stored >= n * runs * 2, f"{stored} results stored: the tasks did not run under the sweep cache"
        return found | {"results_stored": stored}


def _measure(address: str, n: int, runs: int, server_pid: int) -> dict[str, Any]:
    from distributed import Client
    from prefect import flow, task

    import hpc_garage

    @task
    def trivial(i: int) -> int:
        return i

    @flow(task_runner=hpc_garage.task_runner(address=address), name="bench-trial-cost")
    def many(first: int, count: int) -> tuple[float, list[int]]:
        start = time.perf_counter()
        values = [f.result() for f in trivial.map(range(first, first + count))]
        return time.perf_counter() - start, values

    def bypass(on: bool) -> None:  # nested: pickled by value, so the workers need not import bench
        from hpc_garage.cluster import stopping
        from hpc_garage.prefect import sweep_cache

        sweep_cache.note_trial = (lambda run_id, key, task: None) if on else stopping.note_trial

    first = [0]

    def run(bypassed: bool, count: int) -> dict[str, Any]:
        with Client(address) as client:
            assert set(client.run(bypass, bypassed).values()) == {None}
        try:
            start = time.perf_counter()
            inner, values = many(first[0], count)
            wall = time.perf_counter() - start
        finally:
            with Client(address) as client:
                client.run(bypass, False)
        assert values == list(range(first[0], first[0] + count))
        first[0] += count  # fresh inputs: every task runs and stores its result
        return {"inner": inner, "wall": wall}

    contenders = {ON: False, OFF: True}
    samples = on_against_bypassed("trial cost", run, contenders, n, runs, server_pid)
    group = GROUP.format(n=n)
    figures = [Figure(group, name, "tasks/s", [n / s["inner"] for s in samples[name]], ours=name == ON,
                      higher_is_better=True) for name in contenders]
    compare(figures, ">= 0.95x bypassed (nothing measurable per task)",
            lambda ours, peers: ours.ratios[OFF] >= 0.95)
    per_task = [s["inner"] / n for name in contenders for s in samples[name]]
    calls = [_per_call_us() for _ in range(max(runs, 3))]
    limit_us = 1e6 * min(per_task) / 1000  # 0.1 % of the fastest task measured here
    share = Figure(f"the same, per task: the bookkeeping's own cost (a task took {1e3 * min(per_task):.1f} ms at "
                   "best)", "note_trial() + should_stop(), per call", "µs", calls, ours=True, higher_is_better=False)
    share.goal = f"< 0.1 % of a task (< {limit_us:.0f} µs)"  # no peer: judged here
    share.met = bool(share.median is not None and share.median < limit_us)
    return {"figures": [f.to_dict() for f in [*figures, share]], "tasks": n,
            "per_call_us": round(sorted(calls)[len(calls) // 2], 3)}


def _per_call_us(calls: int = 100_000) -> float:
    """What one trial that never calls the API pays: the sweep cache's note of its key (one per task), plus
    one `should_stop()` for good measure (a trial that asks, while no stop is known), in microseconds."""
    from hpc_garage import trial
    from hpc_garage.cluster import stopping

    start = time.perf_counter()
    for i in range(calls):
        stopping.note_trial(f"{i:032x}", "k" * 32, "trivial")
        trial.should_stop()
    return (time.perf_counter() - start) / calls * 1e6


if __name__ == "__main__":
    raise SystemExit(main())
