"""Run by `hpc-garage run` in the jobqueue tests: submits tasks with and without resource tags through plain
Dask, and records which worker ran each and what it saw, as JSON.

    jobqueue_probe.py OUT [--gpu N] [--bigmem N] [--plain N] [--duration S] [--watch]

--watch also samples, every 0.5 s while the tasks run, how many workers the cluster has (adaptive tests).
"""

import argparse
import json
import os
import threading
import time

import dask
from distributed import Client, get_worker

from hpc_garage.cluster.handoff import handoff_from_env, workers_now


def probe(kind: str, duration: float) -> dict:
    start = time.time()
    time.sleep(duration)
    return {"kind": kind, "worker": get_worker().name, "node": os.environ.get("SLURMD_NODENAME"),
            "job": os.environ.get("SLURM_JOB_ID"), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "omp": os.environ.get("OMP_NUM_THREADS"), "start": start, "end": time.time()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--bigmem", type=int, default=0)
    parser.add_argument("--plain", type=int, default=0)
    parser.add_argument("--duration", type=float, default=0.5)
    parser.add_argument("--watch", action="store_true")
    args = parser.parse_args()
    h = handoff_from_env()
    samples: list[tuple[float, int]] = []
    with Client(h.address, security=h.security(), timeout=30) as client:
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                samples.append((time.time(), len(workers_now(client))))
                done.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        if args.watch:
            watcher.start()
        futures = []
        with dask.annotate(resources={"GPU": 1}):
            futures += [client.submit(probe, "gpu", args.duration, pure=False) for _ in range(args.gpu)]
        with dask.annotate(resources={"MEMORY": 5e9}):
            futures += [client.submit(probe, "bigmem", args.duration, pure=False) for _ in range(args.bigmem)]
        futures += [client.submit(probe, "plain", args.duration, pure=False) for _ in range(args.plain)]
        records = client.gather(futures)
        del futures
        t_done = time.time()
        if args.watch:  # then watch the cluster shrink once idle
            deadline = time.time() + float(os.environ.get("PROBE_SHRINK_WAIT", "40"))
            while time.time() < deadline and len(workers_now(client)) > 0:
                time.sleep(0.5)
            done.set()
            watcher.join()
            samples.append((time.time(), len(workers_now(client))))
    with open(args.out, "w") as f:
        json.dump({"records": records, "samples": samples, "done": t_done}, f, indent=1)


if __name__ == "__main__":
    main()
