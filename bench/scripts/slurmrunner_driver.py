"""dask-jobqueue's SLURMRunner under plain srun: SLURM_PROCID 0 runs the scheduler, 1 this client code,
the rest are workers. Prefect is imported only where the client code runs. The task writes DIR/out.json
as it starts (atomically), so the bench has its sample then and can end the job at once.

    srun -n WORKERS+2 python slurmrunner_driver.py DIR
"""

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from dask_jobqueue.slurm import SLURMRunner  # noqa: E402
from distributed import Client  # noqa: E402

if __name__ == "__main__":
    directory = sys.argv[1]
    scheduler_file = os.path.join(directory, "scheduler-{job_id}.json")
    worker_options = {"nthreads": 2, "memory_limit": "3.5GB", "resources": {"GPU": 1}, "interface": "lo"}
    with SLURMRunner(scheduler_file=scheduler_file, worker_options=worker_options,
                     scheduler_options={"dashboard_address": ":0", "interface": "lo"}) as runner:
        with Client(runner) as client:
            client.wait_for_workers(runner.n_workers, timeout=180)
            registered = time.time()
            from prefect import flow, task
            from prefect_dask import DaskTaskRunner

            @task
            def first(result: dict, out: str) -> float:
                started = time.time()
                with open(out + ".tmp", "w") as f:
                    json.dump({**result, "first_task": started}, f)
                os.replace(out + ".tmp", out)
                return started

            sample = {"registered": registered, "workers": runner.n_workers}  # plain data: the flow is pickled

            @flow(task_runner=DaskTaskRunner(address=client.scheduler.address))
            def go() -> float:
                return first.submit(sample, os.path.join(directory, "out.json")).result()

            go()
