"""(issue 25) What `hpc_garage.trial.report()` costs: a few trials at once, each calling it N times (10,000)
in a tight loop, on one running cluster (a worker per trial, 1 thread) through hpc-garage's `task_runner()`;
against the same loop that never reports; and how fast the scheduler answers meanwhile.

    python -m bench.report_cost --reports 10000 --trials 2 --runs 5 --out reports.json

Contenders, each a flow of `trials` trials run in alternating order within every run:
- trials that never report: the loop alone (a float per step);
- trial.report(step, loss=...) every step, no pruner: the values go worker -> scheduler -> the flow's drain
  thread (Dask's structured events), nothing decides;
- the same with `task_runner(pruner="median", metric="loss")`: Optuna's MedianPruner decides on every
  report (all trials have one curve, so none is pruned and every trial runs all its steps).
Cost per call = (a reporting trial's loop time - a non-reporting trial's, same run) / N, timed inside the
trial. Responsiveness: a process of its own (scripts/scheduler_latency.py) times `client.scheduler_info()`
round trips every 20 ms throughout; each sample is put to the contender whose flow was running then (from its
first trial's start to the flow's end, which waits for the last report to be handled and written), or to
"idle" (3 s of the cluster with no trial, before the first run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import PYTHON, SCRIPTS, Figure, prefect_and_cluster, say, wait_idle

NEVER = "trials that never report"
PLAIN = "trial.report() every step, no pruner"
MEDIAN = "trial.report() every step, pruner='median' deciding each"
IDLE = "idle cluster (no trial running)"
CALL_GOAL_US = 100.0  # 1 % of a 10 ms training step: a report per step is then nothing measurable
LATENCY_GOAL_S = 0.1  # p95 of the scheduler's answers while the trials report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reports", type=int, default=10_000, help="trial.report() calls per trial")
    parser.add_argument("--trials", type=int, default=2, help="trials at once (one worker each)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    Path(args.out).write_text(json.dumps(measure(args.reports, args.trials, args.runs), indent=2))
    return 0


def measure(n: int, trials: int, runs: int) -> dict[str, Any]:
    from hpc_garage.variables import RESULTS_ENV, RUN_DIR_ENV, SWEEP_ENV

    with tempfile.TemporaryDirectory(prefix="bench-report-cost-") as scratch_dir:
        run_dir, results = Path(scratch_dir) / "run", Path(scratch_dir) / "results"
        run_dir.mkdir(mode=0o700)
        results.mkdir(mode=0o700)
        # as `hpc-garage run` exports them: the reports are stored in the run directory, the trials cached
        # in the sweep's results, the pruner's study journalled there
        os.environ[RUN_DIR_ENV], os.environ[RESULTS_ENV] = str(run_dir), str(results)
        os.environ[SWEEP_ENV] = "bench-report-cost@1"
        with prefect_and_cluster(workers=trials) as (info, server_pid):
            latency_file = Path(scratch_dir) / "latency.json"
            sampler = subprocess.Popen([PYTHON, str(SCRIPTS / "scheduler_latency.py"), info["address"],
                                        str(latency_file)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert sampler.stdout is not None
                sampler.stdout.readline()  # "ready": connected
                windows, samples = _measure(info["address"], n, trials, runs, server_pid, run_dir)
            finally:
                assert sampler.stdin is not None
                sampler.stdin.close()
                sampler.wait(60)
            latencies = json.loads(latency_file.read_text())["samples"]
    return summarize(n, trials, runs, samples, windows, latencies)


def _measure(address: str, n: int, trials: int, runs: int, server_pid: int,
             run_dir: Path) -> tuple[list[tuple[str, int, float, float]], dict[str, list[list[dict[str, Any]]]]]:
    from prefect import flow, task, unmapped

    import hpc_garage
    from hpc_garage.rundir import RunDir

    summary_file = RunDir(run_dir).metrics_summary

    @task
    def loop(i: int, n: int, report: bool) -> dict[str, Any]:
        from prefect.context import TaskRunContext

        from hpc_garage import trial

        begun = time.time()
        start = time.perf_counter()
        loss = 0.0
        if report:
            for step in range(n):
                loss = 1.0 / (step + 1)
                trial.report(step, loss=loss)
        else:
            for step in range(n):
                loss = 1.0 / (step + 1)
        seconds = time.perf_counter() - start
        context = TaskRunContext.get()
        return {"i": i, "seconds": seconds, "start": begun, "end": time.time(), "pruned": trial.should_stop(),
                "run": context.task_run.id.hex if context else None}

    def sweep_flow(runner: Any) -> Any:
        @flow(task_runner=runner, name="bench-report-cost")
        def sweep(first: int, count: int, n: int, report: bool) -> list[dict[str, Any]]:
            return [f.result() for f in loop.map(range(first, first + count), unmapped(n), unmapped(report))]
        # the runner's exit waits for the last reports to be handled and written: the flow's end is their end

        return sweep

    flows = {NEVER: (sweep_flow(hpc_garage.task_runner(address=address)), False),
             PLAIN: (sweep_flow(hpc_garage.task_runner(address=address)), True),
             MEDIAN: (sweep_flow(hpc_garage.task_runner(address=address, pruner="median", metric="loss")), True)}
    first = [0]

    def run(name: str, count: int) -> list[dict[str, Any]]:
        sweep, report = flows[name]
        out = sweep(first[0], trials, count, report)
        first[0] += trials
        if report:  # every report reached the flow's side and its run directory (trials.json, at the flow's end)
            stored = {r["run"]: r["reports"] for r in json.loads(summary_file.read_text())["trials"].values()}
            missing = {t["run"]: stored.get(t["run"]) for t in out if stored.get(t["run"]) != count}
            assert not missing, f"{name}: reports stored per trial run {missing}, not {count} each"
        return out

    for name in flows:  # warm-up: imports in the workers, the first flow run, Optuna's import
        say(f"reports: warm-up {name}")
        run(name, min(n, 100))
    if server_pid:
        wait_idle(server_pid)
    windows: list[tuple[str, int, float, float]] = [(IDLE, -1, time.time(), 0.0)]
    time.sleep(3)  # idle samples
    windows[0] = (IDLE, -1, windows[0][2], time.time())
    samples: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in flows}
    for i in range(runs):
        order = list(flows) if i % 2 == 0 else list(flows)[::-1]
        for name in order:
            if server_pid:
                wait_idle(server_pid)
            out = run(name, n)
            samples[name].append(out)
            windows.append((name, i, min(t["start"] for t in out), time.time()))  # the trials' start to the flow's end
            say(f"reports run {i + 1}/{runs}: {name}: {statistics.median(t['seconds'] for t in out):.3f} s "
                f"for {n} steps per trial")
    return windows, samples


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(n: int, trials: int, runs: int, samples: dict[str, list[list[dict[str, Any]]]],
              windows: list[tuple[str, int, float, float]], latencies: list[list[float]]) -> dict[str, Any]:
    group = (f"report cost: {trials} trials at once x {n:,} trial.report() calls each ({trials} workers x 1 thread): "
             "per call, vs the same loop never reporting")
    loop_s = {name: [statistics.median(t["seconds"] for t in run) for run in per_run]
              for name, per_run in samples.items()}
    figures = []
    for name in (PLAIN, MEDIAN):
        per_call = [1e6 * (ours - never) / n for ours, never in zip(loop_s[name], loop_s[NEVER])]
        figure = Figure(group, name, "µs", per_call, ours=True)
        figure.goal = f"< {CALL_GOAL_US:.0f} µs (1 % of a 10 ms step)"
        figure.met = figure.median is not None and figure.median < CALL_GOAL_US
        pruned = sum(t["pruned"] for run in samples[name] for t in run)
        figure.note = (f"loop of {n:,} steps {statistics.median(loop_s[name]):.3f} s per trial (never reporting: "
                       f"{statistics.median(loop_s[NEVER]) * 1e3:.1f} ms); "
                       f"{n / statistics.median(loop_s[name]):,.0f} reports/s per trial; trials told to stop: {pruned}")
        figures.append(figure)
    during = "scheduler responsiveness: client.scheduler_info() round trip every 20 ms, p95 per run"
    by_window: dict[str, dict[int, list[float]]] = {}
    for at, seconds in latencies:
        for name, run, start, end in windows:
            if start <= at <= end:
                by_window.setdefault(name, {}).setdefault(run, []).append(seconds)
    latency_detail = {}
    for name in (IDLE, NEVER, PLAIN, MEDIAN):
        runs_seen = by_window.get(name, {})
        p95 = [percentile(v, 0.95) for _, v in sorted(runs_seen.items()) if v]
        every = [s for v in runs_seen.values() for s in v]
        figure = Figure(during, f"{name}" if name == IDLE else f"while {name}", "s", p95, ours=name in (PLAIN, MEDIAN))
        if every:
            latency_detail[name] = {"samples": len(every), "median_ms": round(1e3 * statistics.median(every), 2),
                                    "p95_ms": round(1e3 * percentile(every, 0.95), 2),
                                    "max_ms": round(1e3 * max(every), 2)}
            figure.note = (f"{len(every)} samples: median {latency_detail[name]['median_ms']:.1f} ms, "
                           f"p95 {latency_detail[name]['p95_ms']:.1f} ms, max {latency_detail[name]['max_ms']:.1f} ms")
        figures.append(figure)
    peers = [f for f in figures if f.group == during and not f.ours and f.median]
    for ours in (f for f in figures if f.group == during and f.ours):
        ours.ratios = {p.label: ours.median / p.median for p in peers if ours.median is not None}
        ours.goal = f"p95 < {LATENCY_GOAL_S * 1e3:.0f} ms (the scheduler stays responsive)"
        ours.met = (ours.median is not None and ours.median < LATENCY_GOAL_S) if ours.values else None
    return {"figures": [f.to_dict() for f in figures], "reports": n, "trials": trials,
            "loop_seconds": loop_s, "latency": latency_detail}


if __name__ == "__main__":
    raise SystemExit(main())
