"""`hpc-garage replay JOB`: send Prefect's API what a job kept while the API did not answer (issue 11).

Why. When the API dies mid-sweep the work goes on, and at the end of the flow prefect/outage.py keeps in the
run directory's `unrecorded/` what Prefect still queued for the API: every process's events (Prefect 3
records task runs from their `prefect.task-run.*` events: these are the records, not a list of them), its
log lines, and the flow run's final state that the flow kept locally. Once the API answers again this sends
them, through Prefect's own clients:
- the events to the server's `/events/in` websocket (Prefect's events client, as the workers would have);
  the server's task-run recorder builds the task runs from them, keyed by the events' ids, so an event it
  holds already changes nothing;
- the log lines to `/logs/`;
- the flow run's kept final state, forced (`force=True`: the run ended long ago, and the orchestration
  rules would refuse RUNNING -> COMPLETED from a client that is not the flow), where the API holds that flow
  run in a state that is not final (a final state there, e.g. Crashed set by `run`, is left alone).
Each file's lines sent, and each flow run set, are marked in `unrecorded/replayed.json`, so a second replay
sends nothing again (and a file that grew since sends only its new lines). It ends with what the API now
holds: the task runs the flow listed as finished, counted from the API.

Which API: where the job's was hpc-garage's managed server (unrecorded.json's prefect_server), the one that
runs now (after idling out or dying it starts again on another port, with another auth string), started
if none runs; PREFECT_API_URL set in the environment wins over that and over the URL the job recorded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.files import read_json, write_json
from hpc_garage.rundir import RunDir

__all__ = ["RECORD_WAIT", "replay"]

RECORD_WAIT = 60.0  # s to wait for the server's task-run recorder to write what the events say
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
BROKEN = "it was written by the job's flow"  # a kept file that cannot be read: refused, naming it


def replay(job_id: str, run_dir: Path | None) -> list[str]:
    """Send what job `job_id` kept in `run_dir` to the API it was meant for (`_api`); the lines to print. Refuses
    in one line (UserError) an unknown job, a job with nothing (left) to replay, an API that still does not
    answer."""
    if run_dir is None or not run_dir.is_dir():
        raise UserError(f"job {job_id}: no run directory here; pass --site if the job's site keeps its runs "
                        "elsewhere")
    rundir = RunDir(run_dir)
    kept = rundir.unrecorded_dir
    summary = read_json(rundir.unrecorded_file, broken=BROKEN) or {}
    if not kept.is_dir():
        raise UserError(f"job {job_id}: nothing to replay ({kept} does not exist: Prefect's API answered to the "
                        "end of its flow, or the flow kept nothing)")
    marks = read_json(rundir.replayed_file, broken=BROKEN) or {}
    events, logs, states, sent = _pending(rundir, marks)
    if not (events or logs or states):
        raise UserError(f"job {job_id}: nothing to replay: what {kept} holds was replayed already "
                        f"({_when(marks)})")
    api = _api(job_id, summary)
    if api is None:
        raise UserError(f"job {job_id}: {rundir.unrecorded_file} names no Prefect API, and none is configured; "
                        "set PREFECT_API_URL to the API the job used and retry")
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    url = api["PREFECT_API_URL"]
    auth = {PREFECT_API_AUTH_STRING: api["PREFECT_API_AUTH_STRING"]} if "PREFECT_API_AUTH_STRING" in api else {}
    with temporary_settings(updates={PREFECT_API_URL: url, **auth}):
        from hpc_garage.prefect.outage import api_answers

        if not api_answers():
            raise UserError(f"job {job_id}: Prefect's API at {url} does not answer yet; start it again (the same "
                            f"database) and retry `hpc-garage replay {job_id}`")
        import anyio

        return anyio.run(_send, job_id, rundir, marks, events, logs, states, sent,
                         [str(i) for i in summary.get("task_run_ids") or []], url)


def _pending(rundir: RunDir, marks: dict[str, Any]) -> tuple[list[Any], list[dict[str, Any]], dict[str, Any],
                                                          dict[str, int]]:
    """What was not replayed yet: (events, log lines, flow runs' states, each file's line count once sent)."""
    done: dict[str, int] = marks.get("files", {})
    events: list[Any] = []
    logs: list[dict[str, Any]] = []
    sent: dict[str, int] = {}
    for kind, path in rundir.kept_files():
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        new = lines[done.get(path.name, 0):]
        if not new:
            continue
        sent[path.name] = len(lines)
        if kind == "events":
            events += new
        elif kind == "logs":
            logs += [json.loads(line) for line in new]
    flow_states = read_json(rundir.kept_flow_states_file, broken=BROKEN) or {}
    states = {run: state for run, state in flow_states.items() if run not in marks.get("flow_runs", {})}
    if events:
        from prefect.events.schemas.events import Event

        unique = {e.id: e for e in (Event.model_validate_json(line) for line in events)}
        events = sorted(unique.values(), key=lambda e: e.occurred)
    return events, logs, states, sent


async def _send(job_id: str, rundir: RunDir, marks: dict[str, Any], events: list[Any], logs: list[dict[str, Any]],
                states: dict[str, Any], sent: dict[str, int], listed: list[str], url: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.events.clients import get_events_client

    lines = []
    if events:
        async with get_events_client() as events_client:
            for event in events:
                await events_client.emit(event)
    async with get_client() as client:
        for start in range(0, len(logs), 200):
            await client.create_logs(logs[start:start + 200])
        _mark(rundir, marks, files=sent)  # the events and logs went out; the flow runs are marked one by one
        lines.append(f"job {job_id}: sent {len(events)} events and {len(logs)} log lines to Prefect's API at {url}")
        for flow_run_id, kept_state in states.items():
            lines.append(await _set_flow_state(client, flow_run_id, kept_state))
            _mark(rundir, marks, flow_runs={flow_run_id: kept_state["type"]})
        finished = [e.resource.id.removeprefix("prefect.task-run.") for e in events
                    if e.event.startswith("prefect.task-run.") and e.resource.get("prefect.state-type") in FINAL]
        if listed or finished:
            final = await _recorded(client, list(dict.fromkeys([*listed, *finished])))
            held = sum(1 for i in listed if i in final)
            lines.append(f"Prefect's API now holds {held} of the {len(listed)} task runs the flow listed as finished "
                         f"in a final state, and {sum(1 for i in finished if i in final)} of the {len(finished)} "
                         "the replayed events finished" + ("" if len(final) >= len(set(listed) | set(finished)) else
                                                          " (its recorder may still be writing; look again shortly)"))
    return lines


async def _set_flow_state(client: Any, flow_run_id: str, kept_state: dict[str, Any]) -> str:
    """Set the flow run's kept state where the API holds it in a state that is not final."""
    from prefect.client.schemas.objects import State, StateType
    from prefect.exceptions import ObjectNotFound

    try:
        flow_run = await client.read_flow_run(flow_run_id)
    except ObjectNotFound:
        return f"flow run {flow_run_id}: not in this API (another database?); its state is not set"
    was = flow_run.state.type.value if flow_run.state else "no state"
    if flow_run.state is not None and flow_run.state.is_final():
        return f"flow run {flow_run_id} is {was} in the API already; its kept {kept_state['type']} is not set"
    state = State(type=StateType(kept_state["type"]), name=kept_state.get("name"), message=kept_state.get("message"))
    await client.set_flow_run_state(flow_run_id, state, force=True)
    return f"flow run {flow_run_id} set {kept_state['type']} (was {was})"


async def _recorded(client: Any, wanted: list[str]) -> set[str]:
    """Which of `wanted` task runs the API holds in a final state, once its recorder has caught up with the
    events (bounded by RECORD_WAIT; it writes in batches every few seconds, and a count that stops moving
    for 15 s is taken as its last word)."""
    import anyio
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId

    deadline, last_change, final = time.monotonic() + RECORD_WAIT, time.monotonic(), set()
    while True:
        runs = await client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=wanted)),
                                           limit=len(wanted))
        now = {str(r.id) for r in runs if r.state_type is not None and r.state_type.value in FINAL}
        if now != final:
            final, last_change = now, time.monotonic()
        if len(final) == len(wanted) or time.monotonic() > deadline or time.monotonic() - last_change > 15:
            return final
        await anyio.sleep(1.0)


def _mark(rundir: RunDir, marks: dict[str, Any], *, files: dict[str, int] | None = None,
          flow_runs: dict[str, str] | None = None) -> None:
    marks.setdefault("files", {}).update(files or {})
    marks.setdefault("flow_runs", {}).update(flow_runs or {})
    marks["replayed"] = time.time()
    write_json(rundir.replayed_file, marks, indent=1)


def _api(job_id: str, summary: dict[str, Any]) -> dict[str, str] | None:
    """Where to send it, as PREFECT_API_* settings: PREFECT_API_URL in this environment, where it is set (the
    user says where); else hpc-garage's managed server, where the job used one, as it runs now (it may have
    idled out and started again on another port and auth string; none running is started); else the API the
    job used (unrecorded.json); else the one Prefect is configured with here (its profile)."""
    import os

    if os.environ.get("PREFECT_API_URL", "").strip():
        return {"PREFECT_API_URL": os.environ["PREFECT_API_URL"].strip()}
    if isinstance(managed := summary.get("prefect_server"), dict):
        from hpc_garage.prefect.server import managed_api

        return managed_api(managed, f"job {job_id}")
    if summary.get("api_url"):
        return {"PREFECT_API_URL": str(summary["api_url"])}
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return {"PREFECT_API_URL": str(url)} if url else None


def _when(marks: dict[str, Any]) -> str:
    at = marks.get("replayed")
    return f"last at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))}" if at else "earlier"
