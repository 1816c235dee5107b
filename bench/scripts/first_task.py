"""hpc-garage's side of the start-up benchmark: run under `hpc-garage run`, one Prefect task, its start time.

    hpc-garage run --site SITE -- python first_task.py OUT.json

`run` may start this script while its workers are still starting; it publishes the scheduler file
($HPC_GARAGE_SCHEDULER_FILE, written atomically) once every worker has registered, so that file's mtime is
the moment the cluster was complete. The task itself writes OUT.json as it starts (atomically), so the bench
has its sample then and can end the job at once instead of waiting for the flow run to finish.
"""

import json
import os
import sys
import time

from prefect import flow, task

import hpc_garage


@task
def first(scheduler_file: str, out: str) -> float:
    started = time.time()
    registered = os.stat(scheduler_file).st_mtime  # published once every worker had registered
    with open(out + ".tmp", "w") as f:
        json.dump({"registered": registered, "first_task": started}, f)
    os.replace(out + ".tmp", out)
    return started


@flow(task_runner=hpc_garage.task_runner())
def go() -> float:
    return first.submit(os.environ["HPC_GARAGE_SCHEDULER_FILE"], sys.argv[1]).result()


if __name__ == "__main__":
    go()
