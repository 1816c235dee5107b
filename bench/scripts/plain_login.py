"""The login-node peer: a flow on plain prefect-dask's own LocalCluster, with no Prefect API configured
(Prefect then starts a temporary server, and so does every Dask worker process).

    python plain_login.py OUT_PREFIX

Each task writes OUT_PREFIX.<seed>.json (its start time, atomically) as it starts, so the bench has its
sample then and need not wait for the flow run and the temporary servers to end.
"""

import json
import os
import sys
import time

from prefect import flow, task, unmapped
from prefect_dask import DaskTaskRunner


@task
def experiment(seed: int, out: str) -> float:
    start = time.time()
    with open(f"{out}.{seed}.json.tmp", "w") as f:
        json.dump({"start": start}, f)
    os.replace(f"{out}.{seed}.json.tmp", f"{out}.{seed}.json")
    time.sleep(0.1)
    return start


@flow(task_runner=DaskTaskRunner())
def sweep(out: str) -> list[float]:
    return [f.result() for f in experiment.map(range(2), unmapped(out))]


if __name__ == "__main__":
    sweep(sys.argv[1])
