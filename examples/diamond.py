"""Prefect's "diamond" flow from its Dask deployment page, on hpc-garage's task runner.

inc and dec over range(n), pairwise add, then one sum: many parallel tasks funnelled into one. The total
is known: sum over i of (i + 1) + (i - 1) = n(n - 1), 9900 for the page's n = 100.

    python examples/diamond.py [N]
    hpc-garage run -- python examples/diamond.py
"""

from __future__ import annotations

import random
import sys
from time import sleep

from prefect import flow, task

import hpc_garage


@task
def inc(x: int) -> int:
    sleep(random.random() / 10)
    return x + 1


@task
def dec(x: int) -> int:
    sleep(random.random() / 10)
    return x - 1


@task
def add(x: int, y: int) -> int:
    sleep(random.random() / 10)
    return x + y


@task(name="sum")
def list_sum(arr: list[int]) -> int:
    return sum(arr)


@flow(task_runner=hpc_garage.task_runner())
def diamond(n: int = 100) -> int:
    incs = inc.map(x=range(n))
    decs = dec.map(x=range(n))
    adds = add.map(x=incs, y=decs)
    return list_sum.submit(adds).result()


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    total = diamond(n)
    print(f"diamond: total {total}, expected {n * (n - 1)}")
    raise SystemExit(0 if total == n * (n - 1) else 1)
