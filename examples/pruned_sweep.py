"""A sweep whose trials report their loss every step, and a pruner that stops the poor ones early.

Runs unchanged on a login node and in a batch job:

    python examples/pruned_sweep.py --trials 32 --pruner asha --out pruned.json
    hpc-garage submit --nodes 2 --gpus-per-node 4 --wait examples/pruned_sweep.py --gpu yes --pruner asha

Each trial "trains" for --steps steps of --step-seconds: its loss follows a deterministic learning curve
(`learning_curve`, seeded: a few trials converge well, most poorly). It calls `trial.report(step, loss=...)`
after every step, and returns early once `trial.should_stop()` says the pruner stopped it ("pruned"); a stop
for any other reason (the job is ending, `hpc-garage cancel`) raises `trial.Interrupted`, so that the trial
runs again later instead of being recorded as finished. The flow writes each trial's parameters, last loss,
whether it was pruned and its duration to --out, with the GPU-seconds of the sweep and its best trial.

The curves are plain functions (`sweep_params`, `learning_curve`) so that other runs of the same sweep
(bench/tune_peer.py: Ray Tune's ASHA) import them: `from examples.pruned_sweep import learning_curve`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import time
from pathlib import Path
from typing import Any

STARTED = time.time()

from prefect import flow, task, unmapped  # noqa: E402

import hpc_garage  # noqa: E402
from hpc_garage import trial  # noqa: E402
from hpc_garage.prefect.task_runner import worker_resources  # noqa: E402

PRUNERS = ("none", "median", "percentile", "asha", "hyperband")


def sweep_params(trials: int, seed: int = 0) -> list[dict[str, float]]:
    """The sweep's trials: a learning rate (log-uniform, 1e-5 to 1) and a dropout (0 to 0.6) each, seeded."""
    rng = random.Random(seed)
    return [{"lr": round(10 ** rng.uniform(-5.0, 0.0), 8), "dropout": round(rng.uniform(0.0, 0.6), 4)}
            for _ in range(trials)]


def learning_curve(lr: float, dropout: float, steps: int) -> list[float]:
    """The loss after each of `steps` steps: floor + (start - floor) * exp(-step / tau) + seeded noise.

    The further (lr, dropout) is from (10**-2.5, 0.2), the higher the floor and the slower the descent, so a
    trial that ends well is among the best from its first steps: a sane pruner keeps it.
    """
    miss = abs(math.log10(lr) + 2.5) / 2.5 + abs(dropout - 0.2)  # 0 at the optimum, up to about 1.4
    floor, tau, start = 0.05 + 1.2 * miss**2, 2.0 + 12.0 * miss, 2.5
    noise = random.Random(f"{lr!r}/{dropout!r}")  # a str seed: the same in every process and Python run
    return [round(floor + (start - floor) * math.exp(-(s + 1) / tau) + noise.gauss(0.0, 0.01), 6)
            for s in range(steps)]


def best_of(losses: dict[int, float]) -> int:
    """The trial with the lowest loss (the lowest index among equals)."""
    return min(losses, key=lambda i: (losses[i], i))


def make_pruner(name: str) -> str | None:
    """None, or the pruner's name for `task_runner(pruner=...)`: "asha" is Optuna's successive halving with Ray
    Tune's ASHA defaults (rungs at steps 1, 4, 16); the others as hpc_garage.pruning.PRUNERS gives them."""
    return None if name == "none" else name


@task(tags=hpc_garage.resources(gpu=1))
def train(i: int, lr: float, dropout: float, steps: int, step_seconds: float, marks: str | None) -> dict[str, Any]:
    from prefect.runtime import task_run

    if marks:  # for tests: one file per attempt, so that a run of the trial is counted even if killed
        Path(marks, f"start-{i}-{os.getpid()}-{time.time_ns()}").write_text(str(task_run.id))
    start = time.time()
    loss, pruned, step = math.inf, False, 0
    for step, loss in enumerate(learning_curve(lr, dropout, steps), start=1):
        time.sleep(step_seconds)  # one step of "training"
        trial.report(step, loss=loss)
        if trial.should_stop():
            if trial.stop_reason() != "pruned":  # the job is ending: run again later, not "finished"
                raise trial.Interrupted(f"stopped at step {step}: {trial.stop_reason()}")
            pruned = True
            break
    end = time.time()
    record = {"trial": i, "run": str(task_run.id), "params": {"lr": lr, "dropout": dropout}, "loss": loss,
              "steps": step, "pruned": pruned, "start": start, "end": end, "duration": end - start,
              "host": socket.gethostname(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if marks:
        Path(marks, f"end-{i}-{os.getpid()}-{time.time_ns()}").write_text(json.dumps(record))
    return record


@flow
def pruned_sweep(trials: int = 32, steps: int = 30, step_seconds: float = 0.2, seed: int = 0, gpu: str = "auto",
                 pruner: str = "none", marks: str | None = None, out: str = "pruned-sweep.json") -> dict[str, Any]:
    has_gpus = any(w.get("GPU", 0) > 0 for w in worker_resources())
    use_gpus = gpu == "yes" or (gpu == "auto" and has_gpus)
    runs = train if use_gpus else train.with_options(tags=["no-gpu"])  # replaces the GPU tag
    params = sweep_params(trials, seed)
    futures = runs.map(i=list(range(trials)), lr=[p["lr"] for p in params], dropout=[p["dropout"] for p in params],
                       steps=unmapped(steps), step_seconds=unmapped(step_seconds), marks=unmapped(marks))
    records = [f.result() for f in futures]
    finished = {r["trial"]: r["loss"] for r in records if not r["pruned"]}
    full = {i: learning_curve(p["lr"], p["dropout"], steps)[-1] for i, p in enumerate(params)}
    best, expected = best_of(finished), best_of(full)
    summary = {"pruner": pruner, "trials": trials, "steps": steps, "step_seconds": step_seconds, "gpu": use_gpus,
               "pruned": sum(r["pruned"] for r in records),
               "gpu_seconds": sum(r["duration"] for r in records),  # one GPU per trial (--gpu no: trial-seconds)
               "makespan": max(r["end"] for r in records) - min(r["start"] for r in records),
               "best": {"trial": best, "loss": finished[best], "params": params[best]},
               "expected_best": {"trial": expected, "loss": full[expected], "params": params[expected]},
               "wall": time.time() - STARTED, "records": records}
    Path(out).write_text(json.dumps(summary, indent=2))
    same = "the best of the full curves" if best == expected else f"NOT the best of the full curves ({expected})"
    print(f"pruned_sweep: {trials} trials, {summary['pruned']} pruned ({pruner}), {summary['gpu_seconds']:.1f} "
          f"{'GPU' if use_gpus else 'trial'}-seconds, makespan {summary['makespan']:.1f} s; best trial {best} "
          f"(loss {finished[best]:.4f}), {same} -> {out}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="steps of each trial that runs to the end")
    parser.add_argument("--step-seconds", type=float, default=0.2, help="seconds each step sleeps")
    parser.add_argument("--seed", type=int, default=0, help="seeds the trials' parameters")
    parser.add_argument("--pruner", choices=PRUNERS, default="asha")
    parser.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto",
                        help="tag trials GPU=1: auto = where some worker has a GPU")
    parser.add_argument("--marks", help="a directory: one file per trial attempt (for tests)")
    parser.add_argument("--out", default="pruned-sweep.json")
    args = parser.parse_args(argv)
    if args.marks:
        Path(args.marks).mkdir(parents=True, exist_ok=True)
    runner = hpc_garage.task_runner(pruner=make_pruner(args.pruner), metric="loss", mode="min")
    pruned_sweep.with_options(task_runner=runner)(
        trials=args.trials, steps=args.steps, step_seconds=args.step_seconds, seed=args.seed, gpu=args.gpu,
        pruner=args.pruner, marks=args.marks, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
