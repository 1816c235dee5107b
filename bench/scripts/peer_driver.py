"""The client a user writes next to a hand-made Dask cluster (dask-mpi CLI, SLURMCluster): wait for the
workers, then one Prefect task through plain prefect-dask. Prefect is imported at the top, so its import
overlaps the cluster's start-up (as in a user's script). The task writes OUT.json as it starts (atomically),
so the bench has its sample then and need not wait for the flow run and the cluster to end.

    python peer_driver.py --scheduler-file F --workers N --out OUT.json
    python peer_driver.py --jobqueue NODES --workers N --out OUT.json --job-start-dir D   (SLURMCluster)
"""

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from distributed import Client  # noqa: E402
from prefect import flow, task  # noqa: E402
from prefect_dask import DaskTaskRunner  # noqa: E402


@task
def first(result: dict, out: str) -> float:
    started = time.time()
    with open(out + ".tmp", "w") as f:
        json.dump({**result, "first_task": started}, f)
    os.replace(out + ".tmp", out)
    return started


def first_task(address: str, result: dict, out: str) -> float:
    @flow(task_runner=DaskTaskRunner(address=address))
    def go() -> float:
        return first.submit(result, out).result()

    return go()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scheduler-file")
    parser.add_argument("--jobqueue", type=int, help="nodes: one SLURMCluster job per node")
    parser.add_argument("--job-start-dir")
    parser.add_argument("--job-name", default="dask-worker", help="of the SLURMCluster jobs (the bench ends them)")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"driver_started": STARTED}
    if args.jobqueue:
        from dask_jobqueue import SLURMCluster

        per_node = args.workers // args.jobqueue
        cluster = SLURMCluster(
            queue="gpu", cores=8, processes=per_node, memory="14GB", walltime="00:10:00", interface="lo",
            job_extra_directives=["--gres=gpu:4"], python=sys.executable, log_directory=args.job_start_dir,
            job_name=args.job_name,
            job_script_prologue=[f"date +%s.%N >> {args.job_start_dir}/job_start"],
            worker_extra_args=["--resources", "GPU=1"], scheduler_options={"dashboard_address": ":0"})
        client = Client(cluster)
        result["submitted"] = time.time()
        cluster.scale(jobs=args.jobqueue)
    else:
        while not os.path.exists(args.scheduler_file):
            time.sleep(0.02)
        client = Client(scheduler_file=args.scheduler_file)
        cluster = None
    client.wait_for_workers(args.workers, timeout=180)
    result["registered"] = time.time()
    first_task(client.scheduler.address, result, args.out)
    if cluster is not None:
        client.close()
        cluster.close()
    else:
        client.shutdown()  # dask-mpi's scheduler and workers exit with it


if __name__ == "__main__":
    main()
