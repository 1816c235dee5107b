"""The packing benchmark's sweep: GPU trials (tagged GPU=1), CPU-only trials, one aggregation; run R times
on one cluster, each trial recording where it ran and which GPU it would use.

    hpc-garage run -- python packing_flow.py OUT.json ...                 (the cluster from the handoff)
    python packing_flow.py OUT.json --scheduler-file F ...                (a cluster written by hand)
    python packing_flow.py OUT.json --jobqueue NODES ...                  (SLURMCluster, GPU=4 per worker)

Every layout runs the same flow on hpc-garage's task runner (prefect-dask alone ignores the GPU tag), so
the layouts are compared, not the runners. A trial "uses" the first GPU in its CUDA_VISIBLE_DEVICES, as
CUDA frameworks do by default.
"""

import argparse
import json
import os
import socket
import sys
import time

from prefect import flow, task, unmapped

import hpc_garage


def where() -> dict:
    from distributed import get_worker

    worker = get_worker()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return {"worker": str(worker.name), "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
            "visible": visible, "gpu": visible.split(",")[0] if visible else None, "pid": os.getpid(),
            "key": str(worker.get_current_task())}


@task(tags=hpc_garage.resources(gpu=1))
def gpu_trial(i: int, seconds: float, repeat: int) -> dict:
    start = time.time()
    time.sleep(seconds)
    return {"kind": "gpu", "i": i, "start": start, "end": time.time(), **where()}


@task
def cpu_trial(i: int, seconds: float, repeat: int) -> dict:
    start = time.time()
    time.sleep(seconds)
    return {"kind": "cpu", "i": i, "start": start, "end": time.time(), **where()}


@task
def aggregate(records: list, seconds: float) -> dict:
    start = time.time()
    time.sleep(seconds)
    return {"kind": "aggregate", "n": len(records), "start": start, "end": time.time()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--scheduler-file")
    parser.add_argument("--jobqueue", type=int)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gpu-trials", type=int, default=48)
    parser.add_argument("--cpu-trials", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--aggregate-seconds", type=float, default=0.1)
    args = parser.parse_args()
    cluster = None
    if args.jobqueue:
        from dask_jobqueue import SLURMCluster

        from hpc_garage.prefect.flow_api import use_api
        from hpc_garage.prefect.server import ensure_api

        use_api(ensure_api())  # before the worker jobs are submitted: they inherit the API
        cluster = SLURMCluster(queue="gpu", cores=8, processes=1, memory="14GB", walltime="00:10:00",
                               interface="lo", job_extra_directives=["--gres=gpu:4"], python=sys.executable,
                               worker_extra_args=["--resources", "GPU=4"], scheduler_options={"dashboard_address": ":0"})
        cluster.scale(jobs=args.jobqueue)
        from distributed import Client

        with Client(cluster) as client:
            client.wait_for_workers(args.jobqueue, timeout=180)
        runner = hpc_garage.task_runner(address=cluster.scheduler_address)
    elif args.scheduler_file:
        from distributed import Client

        while not os.path.exists(args.scheduler_file):
            time.sleep(0.05)
        with Client(scheduler_file=args.scheduler_file) as client:
            client.wait_for_workers(int(os.environ.get("BENCH_WORKERS", "1")), timeout=180)
            address = client.scheduler.address
        runner = hpc_garage.task_runner(address=address)
    else:
        runner = hpc_garage.task_runner()

    @flow(task_runner=runner)
    # `repeat` makes each sweep's trials new inputs: under `hpc-garage run` a sweep's trials are cached by their
    # inputs (durable sweeps), and a repeated sweep would read the first one's records instead of running
    def sweep(seconds: float = args.seconds, repeat: int = 0) -> dict:
        start = time.time()
        gpu = gpu_trial.map(range(args.gpu_trials), unmapped(seconds), unmapped(repeat))
        cpu = cpu_trial.map(range(args.cpu_trials), unmapped(seconds), unmapped(repeat))
        total = aggregate.submit([*gpu, *cpu], args.aggregate_seconds).result()
        end = time.time()
        trials = [f.result() for f in [*gpu, *cpu]]
        return {"start": start, "end": end, "makespan": end - start, "trials": _with_assignment(trials),
                "aggregate": total}

    warmup = sweep(seconds=0.1)  # imports Prefect into every worker process: not counted
    runs = [sweep(repeat=r + 1) for r in range(args.runs)]
    with open(args.out, "w") as out:
        json.dump({"runs": runs, "warmup_makespan": warmup["makespan"], "threads": _threads(runner)}, out)
    if cluster is not None:
        cluster.close()
    elif args.scheduler_file:
        from distributed import Client

        with Client(scheduler_file=args.scheduler_file) as client:
            client.shutdown()


def _with_assignment(trials: list) -> list:
    """Each trial with when the scheduler assigned it to a worker (`assigned`, from its transition log) and
    whether it waited on the scheduler first (`held`: it went through no-worker): how placement decided."""
    from prefect.context import FlowRunContext

    client = FlowRunContext.get().task_runner.client
    keys = [t["key"] for t in trials]
    try:
        log = client.run_on_scheduler(_assignments, keys)
        for started in client.run(_executing, keys).values():
            for key, when in started.items():
                log.setdefault(key, {})["executing"] = when
    except Exception as exc:  # noqa: BLE001 - a diagnostic; the sweep's timing stands without it
        print(f"packing_flow: no transition log: {exc}", file=sys.stderr)
        return trials
    return [{**t, **log.get(t["key"], {})} for t in trials]


def _assignments(keys: list, dask_scheduler=None) -> dict:
    wanted, out = set(keys), {}
    for t in dask_scheduler.transition_log:
        if t.key in wanted and t.finish == "processing" and t.start != "processing":
            out[t.key] = {"assigned": t.timestamp, "held": t.start == "no-worker"}
    return out


def _executing(keys: list, dask_worker=None) -> dict:
    """When each task started executing on this worker (its GPU taken), from the worker's own log."""
    wanted = set(keys)
    return {e[0]: e[-1] for e in dask_worker.state.log if len(e) == 7 and e[0] in wanted and e[3] == "executing"}


def _threads(runner) -> dict:
    from distributed import Client

    from hpc_garage.cluster.handoff import workers_now

    with Client(runner.address, **{k: v for k, v in runner.client_kwargs.items() if k == "security"}) as client:
        workers = workers_now(client).values()
        return {"threads": sum(w["nthreads"] for w in workers),
                "gpus": sum(w.get("resources", {}).get("GPU", 0) for w in workers), "workers": len(workers)}


if __name__ == "__main__":
    main()
