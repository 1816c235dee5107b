"""An Optuna sampler (TPE) chooses each next trial; hpc-garage runs them on the GPU workers and prunes them.

    python examples/optuna_ask_tell.py --trials 24 --out search.json
    hpc-garage submit --nodes 2 --gpus-per-node 4 --wait examples/optuna_ask_tell.py --trials 24
    hpc-garage resume JOB          # a cancelled or timed-out search continues where it stopped

The flow keeps one trial in flight per GPU: it asks the study for parameters, submits a Prefect task, and as
each task ends tells the study its loss (or that it was pruned) and asks for the next. The trials report
their loss every step (examples/pruned_sweep.py's curves); the task runner's pruner stops poor ones, and
their GPU takes the next trial at once.

The study lives in a journal file (no database server) under the sweep's results directory
($HPC_GARAGE_RESULTS, set by `hpc-garage run`; outside hpc-garage `./search.journal`: delete it to start
afresh). A resumed job loads it: told trials are not asked again, and the ones the last job left running
are run again with their parameters (finished Prefect tasks come from the sweep's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState
from prefect import flow, task
from prefect.futures import PrefectFuture, as_completed

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
def train(number: int, lr: float, dropout: float, steps: int, step_seconds: float) -> dict[str, Any]:
    start = time.time()
    loss, pruned = float("inf"), False
    for step, loss in enumerate(learning_curve(lr, dropout, steps), start=1):
        time.sleep(step_seconds)  # one step of "training"
        trial.report(step, loss=loss)
        if trial.should_stop():
            if trial.stop_reason() != "pruned":  # the job is ending: this trial runs again in the next one
                raise trial.Interrupted(f"stopped at step {step}")
            pruned = True
            break
    return {"number": number, "loss": loss, "pruned": pruned, "start": start, "end": time.time()}


def open_study(seed: int) -> optuna.Study:
    """The search's study: created on the first run, loaded by a resumed one."""
    path = Path(os.environ.get("HPC_GARAGE_RESULTS", "."), "search.journal")
    return optuna.create_study(study_name="search", direction="minimize", load_if_exists=True,
                               storage=JournalStorage(JournalFileBackend(str(path))),
                               sampler=optuna.samplers.TPESampler(seed=seed))


@flow
def search(trials: int = 24, steps: int = 20, step_seconds: float = 0.2, seed: int = 0,
           out: str = "search.json") -> dict[str, Any]:
    study = open_study(seed)
    workers = worker_resources()
    gpus = int(sum(w.get("GPU", 0) for w in workers))
    runs = train if gpus else train.with_options(tags=["no-gpu"])  # no GPU here (a laptop): one per worker
    slots = gpus or len(workers)
    in_flight: dict[PrefectFuture, optuna.trial.FrozenTrial | optuna.Trial] = {}

    def start(t: optuna.trial.FrozenTrial | optuna.Trial, lr: float, dropout: float) -> None:
        in_flight[runs.submit(t.number, lr, dropout, steps, step_seconds)] = t

    for left in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):  # the last job's, if resumed
        start(left, left.params["lr"], left.params["dropout"])
    records = []
    while in_flight or len(study.trials) < trials:
        while len(in_flight) < slots and len(study.trials) < trials:  # every GPU busy
            t = study.ask()
            start(t, t.suggest_float("lr", 1e-5, 1.0, log=True), t.suggest_float("dropout", 0.0, 0.6))
        done = next(as_completed(list(in_flight)))
        t, record = in_flight.pop(done), done.result()
        if record["pruned"]:
            study.tell(t.number, state=TrialState.PRUNED)
        else:
            study.tell(t.number, record["loss"])
        records.append(record)
    states = dict(Counter(t.state.name for t in study.trials))
    summary = {"trials": len(study.trials), "states": states, "gpus": gpus, "best": {
        "number": study.best_trial.number, "loss": study.best_value, "params": study.best_params},
        "records": records}  # this run's trials: their start and end show how many ran at once
    Path(out).write_text(json.dumps(summary, indent=2))
    print(f"optuna_ask_tell: {len(study.trials)} trials ({states}) on {slots} {'GPUs' if gpus else 'workers'}; "
          f"best #{study.best_trial.number} loss {study.best_value:.4f} {study.best_params} -> {out}")
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
