"""The garage guide's experiment, tagged as the guide tags it: 1 GPU, ~10 GB of memory, 18 CPU threads.

Dask places it only on a worker that holds all four resources at once. The guide's machine (72 threads,
4 GPUs, one worker per GPU: CPU=18 each) is described below as a site, so on a login node the local cluster
advertises what that machine's workers would (the GPUs without devices). In a batch job the site is the
job's: `hpc-garage run --site yours -- python examples/garage_tags.py`, or set HPC_GARAGE_SITE here. A site
whose workers cannot hold the task is refused at once with the resources they do offer.
"""

from __future__ import annotations

import os

from prefect import flow, task

import hpc_garage
from hpc_garage.core.site import parse_site_dict

GUIDE_MACHINE = parse_site_dict({
    "name": "garage-guide", "scheduler": "local",
    "node": {"cores": 72, "memory": "256GiB", "gpus": 4},
    "workers": {"per": "gpu", "threads": 2, "reserve_memory": "16GiB"},
}, origin=__file__)


@task(tags=["dask-resource:PROCESS=1", "dask-resource:MEMORY=10e9", "dask-resource:GPU=1", "dask-resource:CPU=18"])
def my_experiment(seed: int) -> dict[str, object]:
    from distributed import get_worker

    worker = get_worker()
    return {"seed": seed, "worker": worker.name, "resources": dict(worker.state.total_resources),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


@flow(task_runner=hpc_garage.task_runner(site=os.environ.get("HPC_GARAGE_SITE") or GUIDE_MACHINE))
def garage(seeds: int = 4) -> list[dict[str, object]]:
    return my_experiment.map(seed=range(seeds)).result()


if __name__ == "__main__":
    for record in garage():
        print(record)
