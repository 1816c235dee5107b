"""An Optuna sampler (TPE) chooses each next trial; hpc-garage runs them on the GPU workers and prunes them.

    python examples/optuna_ask_tell.py --trials 24 --out search.json
    hpc-garage submit --nodes 2 --gpus-per-node 4 --wait examples/optuna_ask_tell.py --trials 24
    hpc-garage resume JOB          # a cancelled or timed-out search continues where it stopped

`hpc_garage.search` keeps one trial in flight per GPU: it asks the study for parameters, submits the task,
and as each trial ends tells the study its loss (or that it was pruned) and asks for the next. The trials
report their loss every step (examples/pruned_sweep.py's curves); the task runner's pruner stops poor ones,
and their GPU takes the next trial at once.

The study lives in a journal file under the sweep's results directory ($HPC_GARAGE_RESULTS, set by
`hpc-garage run`; outside hpc-garage `./search.journal`: delete it to start afresh). A resumed job continues
it: told trials are not asked again, and the ones the last job left running are run again with their
parameters (finished Prefect tasks come from the sweep's cache), each from the step it saved when its job told
it to stop (`trial.checkpoint_dir()`), not from the start.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import optuna
from distributed import get_worker
from prefect import flow, task

import hpc_garage
from hpc_garage import trial
from hpc_garage.prefect.task_runner import worker_resources

try:  # the curves of examples/pruned_sweep.py: from this checkout, which every worker imports too
    from examples.pruned_sweep import learning_curve
except ImportError:  # a copy beside this script: the workers get the function with the task
    import cloudpickle
    import pruned_sweep

    cloudpickle.register_pickle_by_value(pruned_sweep)
    from pruned_sweep import learning_curve


@task(tags=hpc_garage.resources(gpu=1))
def train(lr: float, dropout: float, steps: int, step_seconds: float) -> dict[str, Any]:
    start = time.time()
    saved = trial.checkpoint_dir() / "step"  # the same directory in every job that runs this trial
    done = int(saved.read_text()) if saved.exists() else 0  # a trial an earlier job stopped goes on from there
    loss, pruned = float("inf"), False
    for step, loss in enumerate(learning_curve(lr, dropout, steps), start=1):
        if step <= done:
            continue
        time.sleep(step_seconds)  # one step of "training"
        trial.report(step, loss=loss)
        if trial.should_stop():
            if trial.stop_reason() != "pruned":  # the job is ending: save, and the next job goes on from here
                saved.write_text(str(step))
                raise trial.Interrupted(f"stopped at step {step}, saved")
            pruned = True
            break
    # where and when it ran: each worker holds one GPU, so a worker's trials must never overlap
    return {"loss": loss, "pruned": pruned, "start": start, "end": time.time(), "worker": str(get_worker().name)}


@flow
def search(trials: int = 24, steps: int = 20, step_seconds: float = 0.2, seed: int = 0,
           out: str = "search.json") -> dict[str, Any]:
    gpus = int(sum(w.get("GPU", 0) for w in worker_resources()))
    runs = train if gpus else train.with_options(tags=[])  # no GPU here (a laptop): one trial per worker
    study = hpc_garage.search(runs, space={"lr": ("log", 1e-5, 1.0), "dropout": ("float", 0.0, 0.6)},
                              trials=trials, metric="loss", seed=seed,
                              fixed={"steps": steps, "step_seconds": step_seconds})
    # this job's trials (a resumed job's: the ones it ran): their number, state, when each ran on its worker and
    # when the search had it in flight (from a GPU free for it to its end)
    records = [{**r.output, "number": r.number, "state": r.state, "in_flight": [r.start, r.end]}
               for r in study.results if r.output]
    summary = {"trials": len(study.study.trials), "gpus": gpus, "workers": study.workers, **study.summary(),
               "states": {s.upper(): n for s, n in study.counts().items() if s != "told" and n},
               "records": records}
    Path(out).write_text(json.dumps(summary, indent=2))
    print(f"optuna_ask_tell: {study.line()} -> {out}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=24)
    parser.add_argument("--steps", type=int, default=20, help="steps of a trial that runs to the end")
    parser.add_argument("--step-seconds", type=float, default=0.2, help="seconds each step sleeps")
    parser.add_argument("--seed", type=int, default=0, help="seeds the sampler")
    parser.add_argument("--pruner", choices=("median", "hyperband", "asha"), default="median")
    parser.add_argument("--out", default="search.json")
    args = parser.parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runner = hpc_garage.task_runner(pruner=args.pruner, metric="loss", mode="min")
    search.with_options(task_runner=runner)(trials=args.trials, steps=args.steps, step_seconds=args.step_seconds,
                                            seed=args.seed, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
