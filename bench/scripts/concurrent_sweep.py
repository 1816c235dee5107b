"""One sweep of N short trials, started beside another against the same managed Prefect server.

    python concurrent_sweep.py N OUT.json

Each trial carries hpc-garage's dask-resource tag, as a sweep's trials do: Prefect then asks the API for tag
concurrency slots (/api/v2/concurrency_limits/increment-with-lease) before each one. OUT.json gets the flow
run's id and final state (written even when the flow fails), so the caller can read the API.
"""

import json
import sys
import time

from prefect import flow, task

import hpc_garage


@task(tags=hpc_garage.resources(cpu=1))
def trial(i: int) -> int:
    time.sleep(0.01)  # short: the API's cost per task dominates
    return i * i


@flow(task_runner=hpc_garage.task_runner(), log_prints=False)
def sweep(n: int) -> int:
    from prefect.runtime import flow_run

    ids.append(flow_run.id)  # as the flow knows itself (CI once read None from the state's details)
    return sum(f.result() for f in trial.map(range(n)))


ids: list[str] = []


if __name__ == "__main__":
    n, out = int(sys.argv[1]), sys.argv[2]
    started = time.time()
    state = sweep(n, return_state=True)
    known = state.state_details.flow_run_id
    record = {"flow_run_id": str(known or (ids[0] if ids else None)), "state_flow_run_id": str(known),
              "state": state.type.value,
              "message": state.message, "seconds": round(time.time() - started, 1)}
    if state.is_completed():
        record["total"] = state.result()
    with open(out, "w") as f:
        json.dump(record, f)
    sys.exit(0 if state.is_completed() else 1)
