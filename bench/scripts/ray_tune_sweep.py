"""The pruning benchmark's peer: the same synthetic sweep under Ray Tune's ASHAScheduler on this machine, run
the way Ray Tune's docs say (a function trainable calling `tune.report`, `tune.with_resources`, `tune.Tuner`
with a `TuneConfig(scheduler=ASHAScheduler(...), metric=, mode=)`), in the Ray virtual environment the bench
built; it imports only Ray and the standard library.

    python ray_tune_sweep.py SPEC.json OUT.json

SPEC.json (written by bench/tune_peer.py from examples/pruned_sweep.py): "curves" (each trial's loss after
every step, from `learning_curve`), "step_seconds", "gpus" (fake GPUs declared to Ray: `ray.init(num_gpus=)`,
as Ray's docs say for a machine without them), "num_cpus", "cpu_per_trial", "grace_period",
"reduction_factor", "storage". Each trial holds 1 GPU, so `gpus` trials run at once.
OUT.json: each trial's last step, loss, whether ASHA stopped it, its start and the time of its last report
(the trial waits in `tune.report` until Tune has decided, so a stopped trial ends there).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no network from here
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    curves: list[list[float]] = spec["curves"]
    steps, step_seconds = len(curves[0]), float(spec["step_seconds"])

    def trainable(config: dict[str, Any]) -> None:
        start = time.time()
        for step, loss in enumerate(curves[config["trial"]], start=1):
            time.sleep(step_seconds)  # one step of "training", as in examples/pruned_sweep.py
            tune.report({"loss": loss, "step": step, "trial": config["trial"], "start": start, "now": time.time()})

    begun = time.time()
    ray.init(num_cpus=spec["num_cpus"], num_gpus=spec["gpus"], include_dashboard=False,
             object_store_memory=200 * 2**20)
    initialised = time.time()
    scheduler = ASHAScheduler(time_attr="training_iteration", max_t=steps, grace_period=spec["grace_period"],
                              reduction_factor=spec["reduction_factor"])
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": spec["cpu_per_trial"], "gpu": 1}),
        param_space={"trial": tune.grid_search(list(range(len(curves))))},  # the sweep's 32 fixed trials
        tune_config=tune.TuneConfig(scheduler=scheduler, metric="loss", mode="min", num_samples=1),
        run_config=tune.RunConfig(storage_path=spec["storage"], name="pruned-sweep", verbose=0),
    )
    results = tuner.fit()
    fitted = time.time()
    records = []
    for result in results:
        m = result.metrics
        if result.error or "trial" not in m:
            records.append({"trial": result.config.get("trial"), "error": str(result.error)[:300]})
            continue
        records.append({"trial": m["trial"], "loss": m["loss"], "steps": m["step"], "pruned": m["step"] < steps,
                        "start": m["start"], "end": m["now"], "duration": m["now"] - m["start"]})
    ray_best = results.get_best_result(metric="loss", mode="min", scope="last")
    ray.shutdown()
    Path(sys.argv[2]).write_text(json.dumps({
        "ray": ray.__version__, "records": records, "init_seconds": initialised - begun,
        "fit_seconds": fitted - initialised, "ray_best_trial": ray_best.config.get("trial")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
