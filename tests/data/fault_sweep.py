"""A sweep whose trials leave side-effect files, so a test counts how often each ran (tests/test_faults.py).

Each trial writes `start-<i>-<pid>-<ns>` when it begins and `done-<i>-<pid>-<ns>` when its work is over, in
--marks; the flow writes its result and every trial's record to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from prefect import flow, task, unmapped

import hpc_garage


@task(tags=hpc_garage.resources(gpu=1))
def trial(i: int, duration: float, marks: str) -> dict:
    from distributed import get_worker

    tag = f"{i}-{os.getpid()}-{time.time_ns()}"
    Path(marks, f"start-{tag}").touch()
    start = time.time()
    time.sleep(duration)
    Path(marks, f"done-{tag}").touch()
    return {"i": i, "value": i * i, "worker": get_worker().name, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "start": start, "end": time.time()}


@task
def total(records: list[dict]) -> int:
    return sum(r["value"] for r in records)


@flow(task_runner=hpc_garage.task_runner())
def sweep(trials: int, duration: float, marks: str, out: str) -> int:
    futures = trial.map(range(trials), duration=unmapped(duration), marks=unmapped(marks))
    result = total.submit(futures).result()
    Path(out).write_text(json.dumps({"result": result, "records": [f.result() for f in futures]}))
    print(f"fault_sweep: result {result}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--duration", type=float, default=2.0)
    parser.add_argument("--marks", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    Path(a.marks).mkdir(parents=True, exist_ok=True)
    result = sweep(a.trials, a.duration, a.marks, a.out)
    raise SystemExit(0 if result == sum(i * i for i in range(a.trials)) else 1)
