"""What a search shows: search.json in the job's run directory (status and the report read it) and a Prefect
table artifact on the flow run, the leaderboard (the best finished trials, best first).

Bookkeeping: a file or an API that cannot be written is a warning, never the search's failure.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hpc_garage.files import write_json

if TYPE_CHECKING:
    from hpc_garage.rundir import RunDir
    from hpc_garage.tuning.search import Search

__all__ = ["LEADERBOARD_KEY", "ROWS", "leaderboard", "publish", "write_summary"]

logger = logging.getLogger(__name__)

LEADERBOARD_KEY = "hpc-garage-search-leaderboard"  # Prefect's artifact keys: lowercase letters, digits, dashes
ROWS = 20  # the leaderboard's best trials


def leaderboard(study: Any, metric: str, rows: int = ROWS) -> list[dict[str, Any]]:
    """The best finished trials, best first: rank, trial number, value, GPU-seconds, parameters."""
    from hpc_garage.tuning.ledger import GPU_SECONDS

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    complete.sort(key=lambda t: t.value, reverse=study.direction.name == "MAXIMIZE")
    return [{"rank": rank, "trial": t.number, metric: t.value,
             "gpu_seconds": round(float(t.user_attrs.get(GPU_SECONDS, 0.0)), 1), **t.params}
            for rank, t in enumerate(complete[:rows], start=1)]


def write_summary(result: Search, rundir: RunDir | None) -> None:
    """search.json for status and the report (core/progress_text.search_text says it in a line)."""
    if rundir is not None:
        try:
            write_json(rundir.search_summary, result.summary(), indent=2)
        except OSError as exc:
            logger.warning("could not write %s: %s", rundir.search_summary, exc)


def publish(result: Search, rundir: RunDir | None) -> None:
    """search.json, and the leaderboard artifact in Prefect."""
    write_summary(result, rundir)
    try:
        from hpc_garage.prefect.search_runs import table_artifact

        table_artifact(table=leaderboard(result.study, result.metric), key=LEADERBOARD_KEY,
                              description=result.line())
    except Exception as exc:  # noqa: BLE001 - the leaderboard is bookkeeping; the search's result stands
        logger.warning("could not create the search's leaderboard artifact in Prefect: %s", exc)
