"""Prefect's API as bookkeeping, not a single point of failure (issue 11).

Why. Prefect's client retries a call that cannot connect, or gets 429/502/503, PREFECT_CLIENT_MAX_RETRIES (5)
times with exponential backoff (2+4+8+16+32 s: about a minute), then raises. With the API SIGKILLed mid-sweep
every trial still finished and the flow printed its result 23 s after the kill (trials record themselves
through events, which only log their failures); then the flow's end-of-run calls (waiting for the task runs
to be recorded, the Completed state, then the Failed state for that failure, the queued events and logs
retried at exit) each spent that minute, and the job exited 1 after 5.5 min (measured on the login node,
tests/test_prefect_faults.py's sweep). The work was done and its results were on disk; only Prefect's
records of it were missing.

What changes, only while the API does not answer (a GET /health with a short timeout and no retries fails to
connect or times out; a busy server's 503 is an answer):
- flow side: the flow run's state proposals are kept locally instead of raising, so the flow ends in its own
  state and returns its own result (`keep_flow_states`, installed by the task runner);
- at the end of the flow the task runner does not wait for the task runs to be recorded; it takes the events
  and log lines Prefect still queues, in the flow process and on every worker (each would be retried against
  the dead API at exit), with the events the events client sent but the server never confirmed, and keeps
  them in the run directory's `unrecorded/` (one events-HOST-PID.jsonl and logs-HOST-PID.jsonl per process,
  private files; the flow run's kept final state in flow-runs.json). Prefect 3 records task runs from their
  `prefect.task-run.*` events, so these are the records themselves: `hpc-garage replay JOB` sends them
  once the API is back (prefect/replay.py). It takes Prefect's API log handlers off (the flow's last log lines
  went out in a batch that Prefect's client retried for a minute, and the process waited for it at exit:
  measured 78 s), keeps the events queued after that as the process exits, and says how many records were
  not written and where they were kept (the run directory's `unrecorded.json` sums it up);
- worker side: a trial's tag-concurrency check (Prefect asks the API before every task whose tags it has not
  seen limit-free within a minute) uses the last answer this process got for those tags when the API does not
  answer, instead of failing the trial; where it has no answer yet for them and the API is up but busy, the
  trial waits for one, asking again for up to 10 minutes (`tag_limits_survive_outages`).
Outside `hpc-garage run` (no run directory) the queued records are dropped, as before, and the log says so.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from hpc_garage.files import append_private, read_json, write_json
from hpc_garage.prefect_api import PrefectApi, auth_headers
from hpc_garage.rundir import RunDir
from hpc_garage.variables import BENCH_BYPASS_ENV, JOB_ID_ENV, PREFECT_SERVER_ENV, RUN_DIR_ENV

__all__ = ["ApiOutage", "api_answers", "api_down", "install", "is_outage_error",
           "outage"]

PROBE_TIMEOUT = 3.0  # s a /health probe may take before the API counts as not answering


def bypassed() -> bool:
    """The bench's switch (BENCH_BYPASS_ENV=1): every hook here calls Prefect's own code straight through, as
    if not installed. Read per call, so the bench flips it between interleaved flows on the same workers."""
    return os.environ.get(BENCH_BYPASS_ENV) == "1"

logger = logging.getLogger(__name__)  # the flow's stderr (the job log): what the API did not get, and where it is


def is_outage_error(exc: BaseException) -> bool:
    """An error that says the API is unreachable or overloaded, not that the request was wrong."""
    if isinstance(exc, httpx.TransportError):
        return True
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code in (408, 429) or exc.response.status_code >= 500
    return isinstance(exc, (ConnectionError, TimeoutError))


def api_answers(timeout: float = PROBE_TIMEOUT) -> bool:
    """Whether Prefect's API answers at all now, with no retries: a connection error or timeout does not."""
    import certifi
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    if not api.url:
        return True  # no API configured: Prefect's own temporary server; nothing to guard
    given = {name: secret.get_secret_value() for name, secret in (("PREFECT_API_AUTH_STRING", api.auth_string),
                                                                  ("PREFECT_API_KEY", api.key)) if secret is not None}
    verify = False if api.tls_insecure_skip_verify else api.ssl_cert_file or certifi.where()  # as Prefect's client
    try:
        status = PrefectApi(str(api.url), headers=auth_headers(given), timeout=timeout,
                            verify=verify).answer("GET", "/health").status
    except (OSError, ValueError):
        return False
    return status != 502  # a busy server's 503 is an answer (Prefect's client retries it); a proxy's 502 says the
    # API behind it is gone


class ApiOutage:
    """What this process knows of the API's outage, and what it could not record there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.down_since: float | None = None
        self.kept_states: list[str] = []  # flow run states kept here, not recorded

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def mark_down(self) -> None:
        with self.lock:
            if self.down_since is None:
                self.down_since = time.time()

    def mark_up(self) -> None:
        with self.lock:
            self.down_since = None

    def still_down(self, final: bool = False) -> bool:
        """True if the API was seen down (or, before a final state, whatever was seen) and does not answer
        now (one short probe). A final state is the flow's last word: Prefect's client would retry it for a
        minute against a dead API, then the Failed state for that failure for another."""
        if not self.down and not final:
            return False
        if api_answers():
            self.mark_up()
            return False
        self.mark_down()
        return True

    def keep(self, state: Any, flow_run_id: Any) -> Any:
        """The state the flow engine proposed, accepted here because the API does not answer."""
        self.kept_states.append(str(state.type.value))
        logger.info(f"flow run {flow_run_id} is {state.type.value} here; Prefect's API does not answer, so that "
                    "state is not recorded there")
        _note_unrecorded({"flow_run_id": str(flow_run_id), "flow_run_state": state.type.value})
        _keep_flow_state(str(flow_run_id), state)
        details = getattr(state, "state_details", None)
        if details is not None and getattr(details, "flow_run_id", None) is None:
            details.flow_run_id = flow_run_id  # as the server fills it in: the flow's caller reads its run there
        return state


outage = ApiOutage()


def keep_state_when_unreachable(propose: Any, is_async: bool) -> Any:
    """Wrap the flow engine's `propose_state[_sync]`: where the API does not answer, keep the state.
    Only a flow run's states (`flow_run_id=`) are kept; a task run's go to Prefect as they would."""

    def kept(state: Any, kwargs: dict[str, Any]) -> Any:
        flow_run_id = kwargs["flow_run_id"]
        return outage.keep(state, flow_run_id) if flow_run_id is not None else None

    def kept_after(exc: Exception, state: Any, kwargs: dict[str, Any]) -> Any:
        """The state kept, where `exc` says the API is gone; else `exc` as it was."""
        if "flow_run_id" not in kwargs or not is_outage_error(exc):
            raise exc
        outage.mark_down()
        return kept(state, kwargs)

    if is_async:
        async def propose_state(client: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
            import anyio

            if bypassed():
                return await propose(client, state, *args, **kwargs)
            if "flow_run_id" in kwargs and await anyio.to_thread.run_sync(outage.still_down, state.is_final()):
                return kept(state, kwargs)
            try:
                return await propose(client, state, *args, **kwargs)
            except Exception as exc:
                return kept_after(exc, state, kwargs)

        return propose_state

    def propose_state_sync(client: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        if bypassed():
            return propose(client, state, *args, **kwargs)
        if "flow_run_id" in kwargs and outage.still_down(state.is_final()):
            return kept(state, kwargs)
        try:
            return propose(client, state, *args, **kwargs)
        except Exception as exc:
            return kept_after(exc, state, kwargs)

    return propose_state_sync


def api_down() -> bool:
    """Whether the API is known down (by the last look) or does not answer now."""
    return not bypassed() and (outage.down or not api_answers())


def install() -> None:
    """Keep flow states through an outage in this process (idempotent)."""
    from hpc_garage.compat import keep_flow_states

    keep_flow_states(keep_state_when_unreachable)


_exit_hooked: list[bool] = []
_kept_in: list[RunDir] = []  # where this process keeps what the API did not get (set by keep_unsent)
_kept_event_ids: set[str] = set()  # events this process kept already: the unconfirmed ones are seen twice


def keep_unsent(run_dir: str | None = None) -> tuple[int, int, bool]:
    """The API is gone: take the events and log lines this process still queues for it (each would be retried
    against it at exit, holding the process) and keep them in `run_dir`'s unrecorded/ for replay (workers are
    given the flow's run directory: their environment need not name it); (events, log lines, kept: False
    where there is no run directory, and they were dropped)."""
    from hpc_garage.compat import before_exit_drains

    where = _kept_dir(run_dir or os.environ.get(RUN_DIR_ENV))
    if where is not None and not _kept_in:
        _kept_in.append(where)
    if not _exit_hooked:
        _exit_hooked.append(before_exit_drains(_keep_at_exit))  # what is queued after this: the last events
    outage.mark_down()
    _stop_logging_to_api()
    events, logs = _keep_queued()
    return events, logs, bool(_kept_in)


def _kept_dir(run_dir: str | None) -> RunDir | None:
    """The run directory whose unrecorded/ (made here) keeps what the API did not get; None outside `run`."""
    if not run_dir or not os.path.isdir(run_dir):
        return None
    rundir = RunDir(Path(run_dir))
    rundir.unrecorded_dir.mkdir(mode=0o700, exist_ok=True)
    return rundir


def _keep_queued() -> tuple[int, int]:
    """Take what this process's Prefect queues hold for the API; append it to this process's files in the kept
    directory (none: dropped). How many events and log lines."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    from hpc_garage.compat import queued_log, take_queued, unconfirmed_events

    events = [_with_flow_run(event, context) for event, context in take_queued(EventsWorker)]
    events += unconfirmed_events(EventsWorker)
    events = [e for e in {str(e.id): e for e in events}.values() if str(e.id) not in _kept_event_ids]
    logs = [line for item, _ in take_queued(APILogWorker) if (line := queued_log(item)) is not None]
    if _kept_in:
        process = f"{socket.gethostname()}-{os.getpid()}"
        append_private(_kept_in[0].kept_file("events", process), [e.model_dump_json() for e in events])
        append_private(_kept_in[0].kept_file("logs", process), [json.dumps(line, default=str) for line in logs])
        _kept_event_ids.update(str(e.id) for e in events)
    return len(events), len(logs)


def _with_flow_run(event: Any, context: Any) -> Any:
    """The event as Prefect's events worker would have sent it: it names the event's flow run (from the run
    context it was emitted in) only as it sends it, and the server records a task run's flow from that."""
    if context is None or any(r.role == "flow-run" for r in event.related):
        return event
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.events.schemas.events import RelatedResource

    def flow_run_of() -> tuple[Any, Any]:
        flow_context, task_context = FlowRunContext.get(), TaskRunContext.get()
        if flow_context is not None and flow_context.flow_run is not None:
            return flow_context.flow_run.id, flow_context.flow_run.name
        if task_context is not None and task_context.task_run.flow_run_id is not None:
            return task_context.task_run.flow_run_id, None
        return None, None

    flow_run_id, name = context.run(flow_run_of)
    if flow_run_id is not None:
        labels = {"prefect.resource.id": f"prefect.flow-run.{flow_run_id}", "prefect.resource.role": "flow-run"}
        event.related.append(RelatedResource({**labels, **({"prefect.resource.name": name} if name else {})}))
    return event


def _keep_flow_state(flow_run_id: str, state: Any) -> None:
    """The flow run's kept state, for replay: the last one kept stands (the final one)."""
    rundir = _kept_dir(os.environ.get(RUN_DIR_ENV))
    if rundir is None:
        return
    path = rundir.kept_flow_states_file
    states = read_json(path) or {}
    states[flow_run_id] = {"type": state.type.value, "name": state.name, "message": state.message,
                           "timestamp": state.timestamp.isoformat() if state.timestamp else None}
    write_json(path, states, indent=1)


def _stop_logging_to_api() -> None:
    """Take Prefect's API log handlers off its loggers: the flow's last lines ("Finished in state ...") would go
    out in a batch that Prefect's client retries against the dead API for a minute (2+4+8+16+32 s), and the
    process waits for it at exit (measured: 78 s, py-spy: APILogWorker.drain). Console output is unchanged."""
    from prefect.logging.handlers import APILogHandler

    for each in [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]:
        for handler in list(getattr(each, "handlers", [])):
            if isinstance(handler, APILogHandler):
                each.removeHandler(handler)


def _keep_at_exit() -> None:
    """At exit, while the API is still known down: each event queued for it would try 10 reconnections
    (measured: the flow process spent 78 s on them after its last state); keep them instead."""
    if outage.down and not api_answers(1.0):
        _keep_queued()


def report_at_flow_end(finished_task_runs: list[Any], results: str | None, dask_client: Any = None) -> None:
    """The API does not answer at the end of the flow: keep what Prefect still queues for it, here and on
    every worker, and say what was not recorded and how to replay it (called by the task runner instead of
    waiting for the records)."""
    from prefect.context import FlowRunContext

    run_dir = os.environ.get(RUN_DIR_ENV)
    counts = [keep_unsent(run_dir)]
    if dask_client is not None:
        try:
            answers = dask_client.run(keep_unsent, run_dir, on_error="return")
            counts += [c for c in answers.values() if isinstance(c, tuple)]
        except Exception:  # noqa: BLE001 - the workers' queues only cost time at their exit
            pass
    events, logs = sum(c[0] for c in counts), sum(c[1] for c in counts)
    context = FlowRunContext.get()
    flow_run_id = str(context.flow_run.id) if context and context.flow_run else None
    where = _note_unrecorded({"flow_run_id": flow_run_id, "task_run_ids": [str(i) for i in finished_task_runs],
                              "events_kept": events, "log_lines_kept": logs, "job_id": os.environ.get(JOB_ID_ENV)})
    kept = all(c[2] for c in counts) and where is not None
    results_at = f"; results are on disk in {results}" if results else ""
    how = (f"were kept for replay in {RunDir(where.parent).unrecorded_dir} (`hpc-garage replay "
           f"{os.environ.get(JOB_ID_ENV) or where.parent.name}` sends them once the API is back)") if kept \
        else "were dropped (no run directory to keep them in: not under `hpc-garage run`)"
    logger.info(f"Prefect's API does not answer: {len(finished_task_runs)} finished task runs may be missing from "
                f"it, and {events} events and {logs} log lines queued for it {how}{results_at}")


def _note_unrecorded(entry: dict[str, Any]) -> Path | None:
    """Add to the run directory's `unrecorded.json` (under `hpc-garage run`), where a user finds what the API
    lacks; None elsewhere."""
    rundir = RunDir.of_this_run()
    if rundir is None or not rundir.path.is_dir():
        return None
    path = rundir.unrecorded_file  # the counts, the ids, the API it was meant for (and prefect_server: which
    data = read_json(path) or {}  # hpc-garage-managed server that API was, where it was one)
    for key, value in entry.items():
        if value is None:
            continue
        if isinstance(value, list):
            data[key] = list(dict.fromkeys([*data.get(key, []), *value]))
        elif isinstance(value, int) and not isinstance(value, bool):
            data[key] = data.get(key, 0) + value
        else:
            data[key] = value
    data["api_url"] = os.environ.get("PREFECT_API_URL")
    data.pop("prefect_server", None)
    if managed := os.environ.get(PREFECT_SERVER_ENV):  # hpc-garage's server: replay finds it as it runs then
        try:
            data["prefect_server"] = json.loads(managed)
        except ValueError:
            pass
    data["updated"] = time.time()
    write_json(path, data, indent=1)
    return path
