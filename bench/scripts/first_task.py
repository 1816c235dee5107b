"""hpc-garage's side of the start-up benchmark: run under `hpc-garage run`, one Prefect task, its start time.

    hpc-garage run --site SITE -- python first_task.py OUT.json
"""

import time

STARTED = time.time()  # the command starts right after `run` saw every worker registered

import json  # noqa: E402
import sys  # noqa: E402

from prefect import flow, task  # noqa: E402

import hpc_garage  # noqa: E402


@task
def first() -> float:
    return time.time()


@flow(task_runner=hpc_garage.task_runner())
def go() -> float:
    return first.submit().result()


if __name__ == "__main__":
    started_task = go()
    with open(sys.argv[1], "w") as out:
        json.dump({"registered": STARTED, "first_task": started_task}, out)
