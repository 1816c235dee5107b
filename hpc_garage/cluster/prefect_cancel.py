"""A Cancel in Prefect (the UI, the API, `prefect flow-run cancel`) of a flow run that `run`'s COMMAND runs:
seen here, it winds the job down as `hpc-garage cancel` does (cluster/wind_down.py), and the flow run ends
Cancelled. Prefect's own engine does not watch a flow run that no runner or worker started (`hpc-garage
submit`'s `python sweep.py`), so `run` asks: one GET per flow run every POLL_SECONDS, through prefect_api.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from hpc_garage.prefect_api import PrefectApi

logger = logging.getLogger(__name__)

POLL_SECONDS = 5.0
KEPT = ("COMPLETED", "CANCELLED")  # what settle leaves; a Crashed or Failed flow run was ended by the cancel
REASON = "cancelled in Prefect"


class PrefectCancel:
    """Which of COMMAND's flow runs were cancelled in Prefect; their end as Cancelled."""

    def __init__(self, api: Mapping[str, str], flow_runs: Callable[[], list[str]]) -> None:
        self._client = PrefectApi.from_env(api, timeout=3)
        self._flow_runs = flow_runs  # cluster/progress.py knows them
        self._asked = 0.0
        self.cancelling: list[str] = []

    def due(self) -> bool:
        return self._client is not None and time.monotonic() - self._asked >= POLL_SECONDS

    def poll(self) -> bool:
        """Whether a flow run of COMMAND is Cancelling (asked in a thread; an API that does not answer: no)."""
        self._asked = time.monotonic()
        if self._client is None:
            return False
        for flow_run in self._flow_runs():
            try:
                if self._client.get(f"/flow_runs/{flow_run}").get("state_type") == "CANCELLING":
                    self.cancelling.append(flow_run)
            except (OSError, ValueError, AttributeError):
                continue
        return bool(self.cancelling)

    def settle(self) -> None:
        """The wind-down is done and COMMAND has ended: the Cancelling flow runs end Cancelled, also one that its
        engine ended Crashed (stopped, or its interrupted trials ended the flow: the cancel did), but not one
        that completed."""
        for flow_run in self.cancelling if self._client is not None else []:
            try:
                state = self._client.get(f"/flow_runs/{flow_run}").get("state_type")
                if state not in KEPT:
                    self._client.post(f"/flow_runs/{flow_run}/set_state", {
                        "state": {"type": "CANCELLED", "message": "Cancelled: the job wound down (hpc-garage)"},
                        "force": True})
                    logger.info(f"flow run {flow_run} set Cancelled (cancelled in Prefect; the job wound down)")
            except (OSError, ValueError, AttributeError) as exc:
                logger.info(f"flow run {flow_run}: could not set it Cancelled ({exc})")
