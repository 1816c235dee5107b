"""Dask's worker preload for every worker hpc-garage starts (`launchers.common.worker_options`): what the worker
process sets up for itself before its first task. Kept tiny: each worker imports it as it starts."""

from __future__ import annotations

from typing import Any


def dask_setup(worker: Any) -> None:
    """Called by distributed with the worker as it starts: its expected closes (the cluster ending under it) log
    one line, not a traceback (compat.quiet_expected_closes)."""
    from hpc_garage.compat import quiet_expected_closes

    quiet_expected_closes()
