"""The search benchmark's peer: the same adaptive search under Ray Tune, run the way Ray Tune's docs say (a
function trainable calling `tune.report`, `tune.with_resources`, `tune.Tuner` with a `TuneConfig(search_alg=
OptunaSearch(..., metric=, mode=), scheduler=ASHAScheduler(..., metric=, mode=))`), in the Ray virtual environment the bench
built (Ray and Optuna); it imports only those and the standard library.

    python ray_tune_search.py SPEC.json OUT.json

SPEC.json (written by bench/search_peer.py): "curve_source" (the source of examples/pruned_sweep.py's
`learning_curve`, executed here so that both sides compute the very same curves), "space" (name -> [low,
high, log]), "trials", "steps", "step_seconds", "seed" (Optuna's TPESampler(constant_liar=True, seed=), as
hpc_garage.search's "tpe"), "gpus" (fake GPUs declared to Ray: `ray.init(num_gpus=)`), "num_cpus",
"cpu_per_trial", "grace_period", "reduction_factor", "storage". Each trial holds 1 GPU, so `gpus` at once.
OUT.json: each trial's parameters, last step, loss, whether it ran every step, its start and the time of its
last report (a trial ASHA stops ends in `tune.report`).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network from here
    import optuna
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    namespace: dict[str, Any] = {"math": math, "random": random}
    exec(spec["curve_source"], namespace)  # noqa: S102 - the bench's own function, from examples/pruned_sweep.py
    learning_curve = namespace["learning_curve"]
    steps, step_seconds = int(spec["steps"]), float(spec["step_seconds"])

    def trainable(config: dict[str, Any]) -> None:
        start = time.time()
        for step, loss in enumerate(learning_curve(config["lr"], config["dropout"], steps), start=1):
            time.sleep(step_seconds)  # one step of "training", as in examples/optuna_ask_tell.py
            tune.report({"loss": loss, "step": step, "start": start, "now": time.time()})

    space = {name: optuna.distributions.FloatDistribution(low, high, log=log)
             for name, (low, high, log) in spec["space"].items()}
    begun = time.time()
    ray.init(num_cpus=spec["num_cpus"], num_gpus=spec["gpus"], include_dashboard=False,
             object_store_memory=200 * 2**20)
    initialised = time.time()
    # metric and mode on the searcher and the scheduler themselves: given to TuneConfig alone (with
    # max_concurrent_trials), Ray 2.60's OptunaSearch raised "the `metric` (None) or `mode` (None) parameters have
    # not been set" at its first suggestion
    searcher = OptunaSearch(space=space, metric="loss", mode="min",
                            sampler=optuna.samplers.TPESampler(constant_liar=True, seed=spec["seed"]))
    scheduler = ASHAScheduler(time_attr="training_iteration", metric="loss", mode="min", max_t=steps,
                              grace_period=spec["grace_period"], reduction_factor=spec["reduction_factor"])
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": spec["cpu_per_trial"], "gpu": 1}),
        tune_config=tune.TuneConfig(search_alg=searcher, scheduler=scheduler, num_samples=spec["trials"],
                                    max_concurrent_trials=spec["gpus"]),
        run_config=tune.RunConfig(storage_path=spec["storage"], name="search", verbose=0),
    )
    results = tuner.fit()
    fitted = time.time()
    records = []
    for result in results:
        m = result.metrics
        if result.error or "step" not in m:
            records.append({"params": dict(result.config), "error": str(result.error)[:300]})
            continue
        records.append({"params": {k: result.config[k] for k in space}, "loss": m["loss"], "steps": m["step"],
                        "complete": m["step"] >= steps, "start": m["start"], "end": m["now"]})
    ray.shutdown()
    Path(sys.argv[2]).write_text(json.dumps({"ray": ray.__version__, "optuna": optuna.__version__,
                                             "records": records, "init_seconds": initialised - begun,
                                             "fit_seconds": fitted - initialised}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
