"""A garage-style sweep: one experiment per (seed, learning rate), each on a GPU worker, then a CPU-only aggregate.

Runs unchanged on a login node and in a batch job:

    python examples/sweep.py --seeds 4 --lrs 0.1,0.01 --duration 0.5 --out results.json
    hpc-garage run -- python examples/sweep.py
    hpc-garage run --site lab-gpu -- python examples/sweep.py --gpu yes

Experiments are tagged `dask-resource:GPU=1`, so at most one runs per GPU worker at a time. Where no worker
has a GPU (the `local` site on a laptop) `--gpu auto` runs them untagged, and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

STARTED = time.time()  # before the imports below: "time to first task" includes them

from prefect import flow, task, unmapped  # noqa: E402

import hpc_garage  # noqa: E402
from hpc_garage.prefect.task_runner import worker_resources  # noqa: E402


def score(seed: int, lr: float) -> float:
    """Deterministic stand-in for a training result, so the sweep's total is known in advance."""
    return (seed + 1) * lr


def expected_total(seeds: int, lrs: list[float]) -> float:
    return round(sum(score(s, lr) for s in range(seeds) for lr in lrs), 9)


@task(tags=hpc_garage.resources(gpu=1))
def experiment(seed: int, lr: float, duration: float) -> dict[str, Any]:
    from distributed import get_worker

    start = time.time()
    time.sleep(duration)
    return {"seed": seed, "lr": lr, "score": score(seed, lr), "worker": get_worker().name,
            "host": socket.gethostname(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pid": os.getpid(), "start": start, "end": time.time()}


@task
def aggregate(records: list[dict[str, Any]]) -> float:
    return round(sum(r["score"] for r in records), 9)


@flow(task_runner=hpc_garage.task_runner())
def sweep(seeds: int = 4, lrs: tuple[float, ...] = (0.1, 0.01), duration: float = 0.5, gpu: str = "auto",
          out: str = "sweep-results.json") -> dict[str, Any]:
    has_gpus = any(w.get("GPU", 0) > 0 for w in worker_resources())
    use_gpus = gpu == "yes" or (gpu == "auto" and has_gpus)
    if gpu == "auto" and not has_gpus:
        print("sweep: no worker has a GPU here; experiments run untagged (--gpu yes to insist)")
    runs = experiment if use_gpus else experiment.with_options(tags=["no-gpu"])  # replaces the GPU tag
    grid = [(seed, lr) for seed in range(seeds) for lr in lrs]
    futures = runs.map(seed=[s for s, _ in grid], lr=[lr for _, lr in grid], duration=unmapped(duration))
    total = aggregate.submit(futures).result()
    records = [f.result() for f in futures]
    summary = {"result": total, "expected": expected_total(seeds, list(lrs)), "gpu": use_gpus,
               "experiments": len(records), "workers": sorted({r["worker"] for r in records}),
               "first_task_after": min(r["start"] for r in records) - STARTED,
               "wall": time.time() - STARTED, "records": records}
    Path(out).write_text(json.dumps(summary, indent=2))
    print(f"sweep: {len(records)} experiments on {len(summary['workers'])} workers, result {total} "
          f"(expected {summary['expected']}), first task {summary['first_task_after']:.1f} s after start, "
          f"{summary['wall']:.1f} s in all -> {out}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--lrs", default="0.1,0.01", help="comma-separated learning rates")
    parser.add_argument("--duration", type=float, default=0.5, help="seconds each experiment sleeps")
    parser.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto",
                        help="tag experiments GPU=1: auto = where some worker has a GPU")
    parser.add_argument("--out", default="sweep-results.json")
    args = parser.parse_args(argv)
    lrs = tuple(float(x) for x in args.lrs.split(",") if x.strip())
    summary = sweep(seeds=args.seeds, lrs=lrs, duration=args.duration, gpu=args.gpu, out=args.out)
    return 0 if summary["result"] == summary["expected"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
