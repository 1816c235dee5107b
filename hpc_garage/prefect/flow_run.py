"""COMMAND of a deployment's job (the `hpc-garage` work pool): Prefect's own engine for one flow run, unless that
flow run has already ended.

`python -m hpc_garage.prefect.flow_run <flow run id>` is `python -m prefect.engine <flow run id>` with one
look first: a job of a flow run that is already Completed, Failed, Cancelled or being cancelled runs nothing
and exits 0. Such a job is a follow-up that `run` submitted at the walltime while the flow finished anyway, a
requeue after the end, or a job cancelled in the UI before it started: Prefect's engine would run a Completed
flow run again (its result is not persisted), and the sweep with it. A Crashed flow run is run again (the
follow-up job of a flow stopped at its job's end). An API that does not answer is the engine's to meet.

A UserError that loading or running the flow meets (a refusal of `task_runner()`) is not left to the engine,
which logs it with its traceback and exits 1: the job's log says it in one line (refusals.py), the flow run
is set Failed with that line unless it has ended already, and the job exits 2.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

from hpc_garage import log
from hpc_garage.core.errors import UserError
from hpc_garage.prefect import refusals
from hpc_garage.prefect_api import PrefectApi

logger = logging.getLogger("hpc_garage.prefect.flow_run")  # its name under `python -m` too (`__main__` there)

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "CANCELLING")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m hpc_garage.prefect.flow_run FLOW_RUN_ID", file=sys.stderr)
        return 2
    log.setup()
    flow_run_id = argv[0]
    api = PrefectApi.from_env(os.environ, timeout=30)
    if api is not None:
        try:
            state = api.get(f"/flow_runs/{flow_run_id}").get("state_type")
        except (OSError, ValueError) as exc:
            logger.warning("flow run %s: its state is unknown (%s); Prefect's engine runs it", flow_run_id, exc)
        else:
            if state in ENDED:
                logger.info("flow run %s is %s already: nothing to run in this job", flow_run_id, state)
                return 0
    refusals.install()
    sys.argv = ["prefect.engine", flow_run_id]
    try:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
    except SystemExit:
        if (error := refusals.pending()) is None:
            raise
        return _refused(api, flow_run_id, error)
    return 0


def _refused(api: PrefectApi | None, flow_run_id: str, error: UserError) -> int:
    """The refusal in one line, in the job's log and as the flow run's Failed state (the UI shows why)."""
    print(refusals.line(error), file=sys.stderr, flush=True)
    if api is not None:
        try:
            if api.get(f"/flow_runs/{flow_run_id}").get("state_type") not in FINAL:
                api.post(f"/flow_runs/{flow_run_id}/set_state",
                         {"state": {"type": "FAILED", "message": f"hpc-garage: {error}"}, "force": True})
        except (OSError, ValueError) as exc:
            logger.warning("flow run %s: could not set it Failed (%s)", flow_run_id, exc)
    return error.exit_code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
