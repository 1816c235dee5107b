"""A running Dask cluster for the per-task benchmark: LocalCluster, N worker processes x T threads, plain tcp.

    python cluster.py --workers 2 --threads 1 --out info.json     (runs until its stdin closes)

It runs in its own process so that the scheduler's CPU is not the flow's; the workers inherit this
process's environment (the Prefect API the bench exported).
"""

import argparse
import json
import os
import sys

from distributed import Client, LocalCluster

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with LocalCluster(n_workers=args.workers, threads_per_worker=args.threads, processes=True,
                      host="127.0.0.1", dashboard_address=None) as cluster, Client(cluster) as client:
        pids = client.run(os.getpid)
        info = {"address": cluster.scheduler_address, "scheduler_pid": os.getpid(), "worker_pids": list(pids.values())}
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(info, f)
        os.replace(tmp, args.out)
        sys.stdin.read()  # until the bench closes our stdin
