"""N trivial tagged task runs in one flow, through Prefect's own task engine in threads, against the API in the
environment: the same events, logs and API calls per task run as on a Dask worker, without a cluster's CPU.

    python server_cost_flow.py N OUT.json
"""

import json
import sys
import time

from prefect import flow, task
from prefect.task_runners import ThreadPoolTaskRunner

import hpc_garage
from hpc_garage.prefect import fast


@task(tags=hpc_garage.resources(cpu=1))
def trial(i: int) -> int:
    return i * i


@flow(task_runner=ThreadPoolTaskRunner(max_workers=4), log_prints=False)
def sweep(n: int) -> int:
    return sum(f.result() for f in trial.map(range(n)))


if __name__ == "__main__":
    n, out = int(sys.argv[1]), sys.argv[2]
    fast.trust_no_tag_limits_longer()  # as hpc-garage's workers do: "no tag limits" kept for a minute
    started = time.time()
    state = sweep(n, return_state=True)
    record = {"flow_run_id": str(state.state_details.flow_run_id), "state": state.type.value,
              "seconds": round(time.time() - started, 1)}
    with open(out, "w") as f:
        json.dump(record, f)
    sys.exit(0 if state.is_completed() else 1)
