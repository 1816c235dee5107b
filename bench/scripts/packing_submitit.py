"""The packing sweep through prefect-submitit, the way its users run one inside an allocation: its
SlurmTaskRunner in `srun` mode (every task an `srun --exact -n1 --gres gpu:1` step of this 2-node job, a
fresh Python that unpickles and runs the Prefect task), inside `sbatch -N2` (bench/packing.py writes the job).

    python packing_submitit.py OUT.json --runs R --gpu-trials 48 --cpu-trials 16 --seconds 1 ...

Runs under Python >= 3.12 (prefect-submitit requires it) in its own virtual environment: it imports only
Prefect and prefect-submitit, never hpc-garage. The runner has one resource shape for every task (per-task
`slurm_kwargs` are ignored in srun mode, as its README says), so the CPU-only trials take a GPU too.
"""

import argparse
import json
import os
import socket
import time

from prefect import flow, task, unmapped
from prefect_submitit import SlurmTaskRunner


def where() -> dict:
    """Where this trial ran; its GPU as the node numbers it (SLURM_STEP_GPUS: a step's CUDA_VISIBLE_DEVICES
    may be renumbered from 0 where devices are constrained)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    physical = os.environ.get("SLURM_STEP_GPUS") or visible
    return {"worker": f"step {os.environ.get('SLURM_JOB_ID')}.{os.environ.get('SLURM_STEP_ID')}",
            "node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(), "visible": visible,
            "gpu": physical.split(",")[0] if physical else None, "pid": os.getpid()}


@task
def gpu_trial(i: int, seconds: float) -> dict:
    start = time.time()
    time.sleep(seconds)
    return {"kind": "gpu", "i": i, "start": start, "end": time.time(), **where()}


@task
def cpu_trial(i: int, seconds: float) -> dict:
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
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--gpu-trials", type=int, default=48)
    parser.add_argument("--cpu-trials", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--aggregate-seconds", type=float, default=0.1)
    parser.add_argument("--log-folder", default="submitit-logs")
    args = parser.parse_args()
    runner = SlurmTaskRunner(execution_mode="srun", gpus_per_node=1, cpus_per_task=1, mem_gb=1, timeout_min=10,
                             log_folder=args.log_folder)

    @flow(task_runner=runner)
    def sweep(seconds: float = args.seconds, gpu_trials: int = args.gpu_trials, cpu_trials: int = args.cpu_trials) -> dict:
        start = time.time()
        gpu = gpu_trial.map(range(gpu_trials), unmapped(seconds))
        cpu = cpu_trial.map(range(cpu_trials), unmapped(seconds)) if cpu_trials else []  # it refuses an empty map
        trials = [f.result() for f in [*gpu, *cpu]]
        total = aggregate.submit(trials, args.aggregate_seconds).result()
        end = time.time()
        return {"start": start, "end": end, "makespan": end - start, "trials": trials, "aggregate": total}

    warmup = sweep(seconds=0.1, gpu_trials=8, cpu_trials=0)  # the page cache warm; not counted
    runs = [sweep() for _ in range(args.runs)]
    gpus = sum(int(x) for x in os.environ.get("BENCH_GPUS", "8").split())
    with open(args.out + ".tmp", "w") as out:
        json.dump({"runs": runs, "warmup_makespan": warmup["makespan"],
                   "threads": {"threads": int(os.environ.get("SLURM_NTASKS", "16")), "gpus": gpus,
                               "workers": int(os.environ.get("SLURM_NTASKS", "16"))}}, out)
    os.replace(args.out + ".tmp", args.out)


if __name__ == "__main__":
    main()
