"""The login-node peer: a flow on plain prefect-dask's own LocalCluster, with no Prefect API configured
(Prefect then starts a temporary server, and so does every Dask worker process).

    python plain_login.py OUT.json
"""

import json
import sys
import time

from prefect import flow, task
from prefect_dask import DaskTaskRunner


@task
def experiment(seed: int) -> float:
    start = time.time()
    time.sleep(0.1)
    return start


@flow(task_runner=DaskTaskRunner())
def sweep() -> list[float]:
    return [f.result() for f in experiment.map(range(2))]


if __name__ == "__main__":
    starts = sweep()
    with open(sys.argv[1], "w") as out:
        json.dump({"first_task": min(starts)}, out)
