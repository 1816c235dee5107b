"""prefect-dask's private names: what a DaskTaskRunner holds."""

from __future__ import annotations

from typing import Any

from hpc_garage.compat.versions import uses


@uses("prefect-dask", "DaskTaskRunner._started / _cluster")
def runner_started(runner: Any) -> bool:
    """Whether a DaskTaskRunner has entered (its client exists)."""
    return bool(runner._started)


@uses("prefect-dask", "DaskTaskRunner._cluster")
def runner_has_cluster(runner: Any) -> bool:
    """Whether a DaskTaskRunner was given a cluster object (rather than an address or a class to start)."""
    return runner._cluster is not None


@uses("prefect-dask", "DaskTaskRunner._optimize_futures")
def dask_futures(runner: Any, values: Any) -> Any:
    """`values` with every PrefectDaskFuture replaced by its dask future, as prefect-dask submits them."""
    return runner._optimize_futures(values)
