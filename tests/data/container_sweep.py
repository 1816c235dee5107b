"""The container tests' sweep: the flow and every trial import `garage_image_probe`, which only the test image
has (scripts/container-image), and each trial says from inside where it ran (image marker, interpreter, GPU)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import garage_image_probe  # the host's Python has no such package: this flow runs inside the image
from prefect import flow, task, unmapped

import hpc_garage


@task(tags=hpc_garage.resources(gpu=1))
def trial(seed: int, marks: str) -> dict:
    from distributed import get_worker

    with open(marks, "a") as f:  # one line each time a trial runs: a resumed sweep must add none
        f.write(f"{seed}\n")
    start = time.time()
    time.sleep(0.3)
    return {"seed": seed, "value": (seed + 1) ** 2, "image": garage_image_probe.IMAGE,
            "in_image": os.path.exists("/etc/hpc-garage-image"), "python": sys.executable,
            "worker": get_worker().name, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "start": start, "end": time.time()}


@flow(task_runner=hpc_garage.task_runner())
def sweep(seeds: int, out: str, marks: str) -> None:
    records = [f.result() for f in trial.map(list(range(seeds)), marks=unmapped(marks))]
    Path(out).write_text(json.dumps({"flow_image": garage_image_probe.IMAGE, "flow_python": sys.executable,
                                     "result": sum(r["value"] for r in records),
                                     "expected": sum((s + 1) ** 2 for s in range(seeds)), "records": records}))


if __name__ == "__main__":
    sweep(int(sys.argv[1]), sys.argv[2], sys.argv[3])
