"""What `hpc_garage.search` (tuning/) needs of Prefect, kept on the Prefect side: the flow run's task runner,
whether an object is a task, the next trial's future to end, and the leaderboard's table artifact."""

from __future__ import annotations

from typing import Any

__all__ = ["first_done", "flow_runner", "is_task", "run_record", "table_artifact"]


def flow_runner() -> Any:
    """The current flow run's hpc-garage task runner, or None (outside a flow run, or another runner)."""
    from prefect.context import FlowRunContext

    from hpc_garage.prefect.task_runner import HpcTaskRunner

    context = FlowRunContext.get()
    runner = context.task_runner if context is not None else None
    return runner if isinstance(runner, HpcTaskRunner) else None


def run_record(runner: Any, run_id: Any) -> dict[str, Any] | None:
    """The task run's reports as the runner keeps them (prefect/metrics.py): its state ("pruned"), its first
    report's time ("started"); None without reports or outside a run directory and a pruner."""
    from hpc_garage.prefect.metrics import run_record as record_of

    metrics = runner.metrics
    return record_of(metrics, run_id.hex if hasattr(run_id, "hex") else str(run_id)) if metrics else None


def is_task(obj: Any) -> bool:
    from prefect import Task

    return isinstance(obj, Task)


def first_done(futures: list[Any]) -> Any:
    """The first of `futures` to end (at once if one has), waited for: its final state is known."""
    from prefect.futures import as_completed

    done = next(as_completed(futures))
    done.wait()
    return done


def table_artifact(table: list[dict[str, Any]], key: str, description: str) -> None:
    """A table artifact on the current flow run (Prefect's UI shows it under the run's Artifacts)."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(table=table, key=key, description=description)
