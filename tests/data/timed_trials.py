"""Trials that time themselves, on the cluster `hpc-garage run` hands over, with plain Dask (no Prefect).

Each trial asks for one GPU, sleeps DURATION seconds and returns its worker and its own start and end; the
records go to OUT. tests/test_report.py compares them with the run's report.json.

    hpc-garage run -- python timed_trials.py OUT TRIALS DURATION
"""

from __future__ import annotations

import json
import sys
import time


def trial(i: int, duration: float) -> dict:
    from distributed import get_worker

    start = time.time()
    time.sleep(duration)
    return {"i": i, "worker": get_worker().name, "start": start, "end": time.time()}


def main(out: str, trials: int, duration: float) -> None:
    from distributed import Client

    from hpc_garage.cluster.handoff import handoff_from_env

    handoff = handoff_from_env()
    with Client(handoff.address, security=handoff.security()) as client:
        futures = [client.submit(trial, i, duration, resources={"GPU": 1}, pure=False) for i in range(trials)]
        records = client.gather(futures)
    with open(out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
