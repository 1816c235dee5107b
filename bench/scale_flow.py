"""(issue 32) The flow `python -m bench --only scale` runs under `hpc-garage run --site local`: N trivial tagged
trials written as a user writes them, `[f.result() for f in trial.map(range(N))]`; it writes when each result was
read (one stamp per 1,000) and whether every result was right to the JSON file named on its command line.

    hpc-garage run --site local -- python -m bench.scale_flow 10000 out.json [hpc-garage|prefect-dask|threads]
"""

from __future__ import annotations

import json
import sys
import time

from prefect import flow, tags, task

STEP = 1000


@task
def trial(i: int) -> int:
    return 2 * i


def runner(kind: str, limit: int | None = None) -> object:
    if kind == "prefect-dask":
        from prefect_dask import DaskTaskRunner

        from hpc_garage.cluster.handoff import handoff_from_env

        handoff = handoff_from_env()  # plain prefect-dask on the same cluster, as a user would point it there
        assert handoff is not None, "run me under `hpc-garage run`"
        return DaskTaskRunner(address=handoff.address, client_kwargs={"security": handoff.security()})
    if kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=2)
    import hpc_garage

    return hpc_garage.task_runner(**({"max_in_flight": limit} if limit else {}))


def runner_in_use() -> object:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context.task_runner if context else None


def main(argv: list[str]) -> int:
    n, out = int(argv[0]), argv[1]
    kind = argv[2] if len(argv) > 2 else "hpc-garage"
    limit = int(argv[3]) if len(argv) > 3 else None

    @flow(task_runner=runner(kind, limit), name=f"bench-scale-{kind}")
    def sweep(n: int) -> dict[str, object]:
        start = time.perf_counter()
        stamps, right = [], True
        with tags("dask-resource:CPU=1"):
            futures = trial.map(range(n))
        for i, future in enumerate(futures):
            right = right and future.result() == 2 * i
            if (i + 1) % STEP == 0 or i + 1 == n:
                stamps.append(round(time.perf_counter() - start, 3))
        found = {"n": n, "kind": kind, "right": right, "seconds": stamps[-1], "stamps": stamps}
        gate, releaser = getattr(runner_in_use(), "_in_flight", None), getattr(runner_in_use(), "_releaser", None)
        if gate is not None and releaser is not None:
            found |= {"peak_in_flight": gate.peak, "limit": gate.limit(), "released": releaser.released}
        return found

    found = sweep(n)
    with open(out, "w") as sink:
        json.dump(found, sink)
    return 0 if found["right"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
