"""(issue 32) The flow `python -m bench --only scale` runs under `hpc-garage run --site local`: N trivial tagged
trials written as a user writes them, `[f.result() for f in trial.map(range(N))]`; it writes how long that took,
each trial's end (seconds since the flow's start) and whether every result was right to the JSON file named on
its command line, and when the flow returned (its runner waits until Prefect's server recorded every trial).

    hpc-garage run --site local -- python -m bench.scale_flow N OUT.json [hpc-garage|dask|prefect-dask|threads] [LIMIT]

`dask` is raw `Client.map` on the same workers (no Prefect); LIMIT is hpc-garage's `max_in_flight`.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from prefect import flow, tags, task


def trivial(i: int) -> tuple[int, float]:
    return 2 * i, time.time()


trial = task(trivial, name="trial")


def runner(kind: str, limit: int | None = None) -> Any:
    from hpc_garage.cluster.handoff import handoff_from_env
    from hpc_garage.prefect.flow_api import settle_api

    if kind == "prefect-dask":
        from prefect_dask import DaskTaskRunner

        handoff = handoff_from_env()  # plain prefect-dask on the same cluster, as a user would point it there
        assert handoff is not None, "run me under `hpc-garage run`"
        settle_api()  # the same Prefect server as hpc-garage's rows
        return DaskTaskRunner(address=handoff.address, client_kwargs={"security": handoff.security()})
    if kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        settle_api()
        return ThreadPoolTaskRunner(max_workers=2)
    import hpc_garage

    return hpc_garage.task_runner(**({"max_in_flight": limit} if limit else {}))


def runner_in_use() -> Any:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context.task_runner if context else None


def raw_dask(n: int) -> dict[str, Any]:
    """The same trials as plain functions through `Client.map` on the run's workers."""
    from distributed import Client

    from hpc_garage.cluster.handoff import handoff_from_env

    handoff = handoff_from_env()
    assert handoff is not None, "run me under `hpc-garage run`"
    with Client(handoff.address, security=handoff.security()) as client:
        start = time.time()
        values = client.gather(client.map(trivial, range(n), pure=False, resources={"CPU": 1}))
        seconds = time.time() - start
    return {"n": n, "kind": "dask", "right": [v for v, _ in values] == [2 * i for i in range(n)],
            "seconds": round(seconds, 3), "ends": [round(t - start, 3) for _, t in values]}


def main(argv: list[str]) -> int:
    n, out = int(argv[0]), argv[1]
    kind = argv[2] if len(argv) > 2 else "hpc-garage"
    limit = int(argv[3]) if len(argv) > 3 else None
    if kind == "dask":
        found = raw_dask(n)
    else:
        @flow(task_runner=runner(kind, limit), name=f"bench-scale-{kind}")
        def sweep(n: int) -> dict[str, Any]:
            start = began[0] = time.time()
            with tags("dask-resource:CPU=1"):
                futures = trial.map(range(n))
            values = [f.result() for f in futures]
            seconds = time.time() - start
            found = {"n": n, "kind": kind, "right": [v for v, _ in values] == [2 * i for i in range(n)],
                     "seconds": round(seconds, 3), "ends": [round(t - start, 3) for _, t in values]}
            gate, releaser = getattr(runner_in_use(), "_in_flight", None), getattr(runner_in_use(), "_releaser", None)
            if gate is not None and releaser is not None:
                found |= {"peak_in_flight": gate.peak, "limit": gate.limit(), "released": releaser.released}
            if (unrecorded := getattr(gate, "unrecorded", None)) is not None:  # recorded.py: waits for the server
                found["waited_for_server_s"] = round(unrecorded.waited, 1)
            return found

        began = [0.0]
        found = sweep(n)
        # the flow's return: its runner's end waited until Prefect's server recorded every finished trial
        found["recorded_s"] = round(time.time() - began[0], 3)
    with open(out, "w") as sink:
        json.dump(found, sink)
    return 0 if found["right"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
