"""The flow's side of `hpc_garage.trial.report()`: store what the trials report, hand them to the pruner's
decisions (prefect/decisions.py), send its answers and stops to the trials' workers.

The trials' reports arrive as Dask events on the task runner's own client (each worker logs them, several to an
event, on its batched stream to the scheduler, which forwards them to subscribed clients): no Prefect API call, no extra
connection. The client's event loop only enqueues each one; one daemon thread drains the queue, so a slow
disk or a pruner never holds up the client. It:
- appends each report to `metrics/<trial>.jsonl` in the job's run directory and keeps `metrics/trials.json`
  (each trial's last and best values, its state; the best trial; counts) up to date, at most once a second
  and at the end (the readers: status, the report, the Prefect artifacts);
- with a pruner (`task_runner(pruner=..., metric=...)`), hands every report of the metric to the pruner's
  decisions (which report is decided when, successive halving's rungs, the answers) and sends the answers to
  the reports a trial waits on (trial.report: a trial whose steps are slow waits for the decision, as under Ray
  Tune; a worker plugin tells every worker that answers come), through Dask's `run` op on that one worker
  (`stopping.decided`), which stops a pruned trial first; the trial sees `should_stop()` and returns;
- notes each trial's end when its task's future does (HpcTaskRunner hands it over): "done", "failed", or
  "interrupted" (its job ended first: Prefect's Crashed); a pruned trial stays "pruned".
Without a run directory (plain python) nothing is written; without a pruner nothing is decided.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from hpc_garage.cluster import stopping
from hpc_garage.cluster.stopping import REPORT_TOPIC
from hpc_garage.files import append_private, write_json
from hpc_garage.prefect.decisions import HOLD_MAX, Answers, PrunerDecisions
from hpc_garage.pruning import TrialPruner, journal_path
from hpc_garage.rundir import RunDir

__all__ = ["FLUSH_EVERY", "HOLD_MAX", "TrialMetrics"]

logger = logging.getLogger(__name__)

FLUSH_EVERY = 1.0  # s: the files are brought up to date at most this often (and at the end)
BATCH = 10_000  # reports drained at once at most (the pruner decides at every one)
SENDERS = 2  # threads sending the pruner's answers and stops to the workers
CLOSE_TIMEOUT = 30.0  # s the flow waits at its end for the last reports to be written
FINAL_STATES = {"COMPLETED": "done", "CRASHED": "interrupted"}  # Prefect state of the task -> the trial's; else failed


class TrialMetrics:
    """One flow run's reports: subscribed on the runner's client at its first submission, closed at its exit."""

    def __init__(self, pruner: Any = None, metric: str | None = None, mode: str = "min",
                 run_dir: RunDir | None = None, journal: Path | None = None) -> None:
        self.metric, self.mode = metric, mode if metric else "min"
        self.run_dir = run_dir
        self._pruner_setting, self._journal = pruner, journal
        self.pruner: TrialPruner | None = None
        self.decisions: PrunerDecisions | None = None  # with a pruner: which report is decided when, answers
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._client: Any = None
        self._thread: threading.Thread | None = None
        self.trials: dict[str, dict[str, Any]] = {}  # trial id -> its record in trials.json
        self._runs: dict[str, str] = {}  # task run id -> trial id
        self._best_step: dict[str, int] = {}  # trial id -> the step of its best value of the metric
        self._first_metric: str | None = None  # without a metric: the first one reported ranks the trials
        self._lines: dict[str, list[str]] = {}  # trial id -> its JSON lines not yet written
        self._ended_early: OrderedDict[str, float] = OrderedDict()  # task run id -> when it ended, unreported yet
        self._sender: ThreadPoolExecutor | None = None  # sends stops and answers to the workers
        self._dirty = False
        self._write_failed = False

    @classmethod
    def for_runner(cls, pruner: Any, metric: str | None, mode: str) -> TrialMetrics | None:
        """What the flow's runner keeps: None where nothing would be written nor decided (no run directory and
        no pruner), so that a plain flow pays nothing."""
        run_dir = RunDir.of_this_run()
        if pruner is None and run_dir is None:
            return None
        return cls(pruner, metric, mode, run_dir, journal_path() if pruner is not None else None)

    # ---- the runner's side

    def start(self, client: Any) -> None:
        """Open the study (the epoch's journal where there is one), subscribe, start the drain thread."""
        if self._pruner_setting is not None:
            assert self.metric is not None  # (check_settings: a pruner needs one)
            self.decisions = PrunerDecisions.open(self._pruner_setting, self.metric, self.mode, self._journal,
                                                  self.trials, self._runs, self._send)
            self.pruner = self.decisions.pruner
        if self.run_dir is not None:
            self.run_dir.metrics_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._client = client
        self._sender = ThreadPoolExecutor(max_workers=SENDERS, thread_name_prefix="hpc-garage-answers")
        self._thread = threading.Thread(target=self._drain, name="hpc-garage-metrics", daemon=True)
        self._thread.start()
        put = self._queue.put
        client.subscribe_topic(REPORT_TOPIC, lambda event: put(("reports", event[1].get("reports", ()))))
        if self.pruner is not None:  # the trials' reports wait for its answers, on every worker, later ones too
            client.register_plugin(PrunerAnswers(), name=PrunerAnswers.name)

    def submitted(self, run_id: str) -> None:
        """A task was submitted (the flow's thread): in flight until it ends, a rival at the first rung."""
        if self._thread is not None and self.pruner is not None:
            self._queue.put(("submit", run_id))

    def ended(self, run_id: str, future: Any) -> None:
        """A task's future is done (the client's event loop calls this: it only enqueues)."""
        if self._thread is not None:
            self._queue.put(("end", run_id, future, time.time()))

    def close(self) -> None:
        """Write what is left, and stop: the flow is ending."""
        if self._thread is None:
            return
        try:
            self._client.unsubscribe_topic(REPORT_TOPIC)
        except Exception as exc:  # noqa: BLE001 - a closed client: nothing more can arrive anyway
            logger.debug("unsubscribing from %s: %s", REPORT_TOPIC, exc)
        if self.pruner is not None:
            try:
                self._client.unregister_worker_plugin(PrunerAnswers.name)  # the workers may serve another flow
            except Exception as exc:  # noqa: BLE001 - a closed cluster: no worker waits any more
                logger.debug("unregistering %s: %s", PrunerAnswers.name, exc)
        self._queue.put(("close",))
        self._thread.join(CLOSE_TIMEOUT)
        if self._thread.is_alive():
            logger.warning("the trials' reports were not all written within %.0f s of the flow's end", CLOSE_TIMEOUT)
        if self._sender is not None:
            self._sender.shutdown(wait=True)  # the last stops and answers: the client still lives
        self._thread, self._client, self._sender = None, None, None

    # ---- the drain thread

    def _drain(self) -> None:
        next_flush = time.monotonic() + FLUSH_EVERY
        while True:
            batch: list[tuple[Any, ...]] = []
            release_at = self.decisions.release_at if self.decisions is not None else None
            wake = next_flush if release_at is None else min(next_flush, release_at)
            try:
                batch.append(self._queue.get(timeout=max(0.0, wake - time.monotonic())))
                while len(batch) < BATCH:
                    batch.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            closing = any(item[0] == "close" for item in batch)  # (a batch holds many more reports: events)
            try:
                self._handle(batch)
            except Exception:  # noqa: BLE001 - one bad batch must not end the bookkeeping of the whole run
                logger.exception("the trials' reports could not all be handled")
            if closing or time.monotonic() >= next_flush:
                self._flush()
                next_flush = time.monotonic() + FLUSH_EVERY
            if closing:
                return

    def _handle(self, batch: list[tuple[Any, ...]]) -> None:
        """Reports in order, the pruner asked at each one: ASHA and Hyperband record a trial's value at a rung
        as the value they are asked with, so a later step's (lower) loss must never stand in for a rung's.
        Then each trial waiting for its answer (trial.report) gets it: its last report's, one Dask run op."""
        answers: Answers = {}
        decisions = self.decisions
        for item in batch:
            if item[0] == "reports":
                for msg in item[1]:
                    self._report(msg, answers)
            elif item[0] == "submit" and decisions is not None:
                decisions.submitted(item[1])
            elif item[0] == "end":
                if decisions is not None and decisions.ended(item[1]):  # its held reports first: the pruner
                    self._release(answers)                               # learns of its end after them
                self._end(item[1], item[2], item[3])
            elif item[0] == "close":
                self._release(answers)
        if decisions is not None:
            if decisions.due():
                self._release(answers)
            decisions.answer(answers)

    def _send(self, worker: str | None, function: Any, *args: Any, **kwargs: Any) -> None:
        """Run `function` on the trial's worker (Dask's run op), from a thread of its own: the drain thread
        goes on deciding meanwhile."""
        if self._client is None or self._sender is None:
            return
        client = self._client

        def send() -> None:
            try:
                client.run(function, *args, workers=[worker] if worker else None, on_error="ignore", **kwargs)
            except Exception as exc:  # noqa: BLE001 - its worker is gone: so is the trial
                logger.info("could not reach the trial's worker %s: %s", worker, exc)

        self._sender.submit(send)

    def _report(self, msg: dict[str, Any], answers: Answers) -> None:
        trial_id, run_id, step, values = str(msg["trial"]), str(msg["run"]), int(msg["step"]), msg["values"]
        record = self.trials.get(trial_id)
        if record is None or record["run"] != run_id:  # its first report, or a new run of it (a retry)
            record = self._new_run(trial_id, run_id, msg, record)
        if self.decisions is not None:  # (what a held report waits for)
            self.decisions.note_pace(trial_id, record["last_step"], step, msg.get("since"))
        record["reports"] += 1
        record["last_step"], record["worker"] = step, msg.get("worker")
        record["last"].update(values)
        self._first_metric = self._first_metric or next(iter(values), None)
        metric = self.metric or self._first_metric
        if metric in values and self._better(values[metric], record["best"].get(metric)):
            record["best"] = dict(record["last"])
            self._best_step[trial_id] = step
        self._lines.setdefault(trial_id, []).append(
            json.dumps({"step": step, "time": msg.get("time"), "values": values}))
        self._dirty = True
        if self.decisions is not None and self.metric in values:
            if not self.decisions.report(trial_id, record, msg, answers):  # held for its rivals
                return
        if (ended := self._ended_early.pop(run_id, None)) is not None:
            self._finish(trial_id, "done", ended)

    def _release(self, answers: Answers) -> None:
        """Decide the held reports (the pruner's decisions); a trial whose task ended meanwhile is done after."""
        if self.decisions is None:
            return
        for run_id in self.decisions.release(answers):
            self._dirty = True
            if (ended := self._ended_early.pop(run_id, None)) is not None:
                self._finish(self._runs[run_id], "done", ended)

    def _new_run(self, trial_id: str, run_id: str, msg: dict[str, Any],
                 earlier: dict[str, Any] | None) -> dict[str, Any]:
        record = earlier or {"task": msg.get("task"), "run": run_id, "reports": 0, "last_step": None, "last": {},
                             "best": {}, "state": "running", "started": msg.get("time"), "ended": None,
                             "worker": msg.get("worker")}
        record["run"], record["ended"] = run_id, None
        if record["state"] != "pruned":
            record["state"] = "running"
        self.trials[trial_id] = record
        self._runs[run_id] = trial_id
        if self.decisions is not None:
            self.decisions.new_run(trial_id, record)
        return record

    def _end(self, run_id: str, future: Any, when: float) -> None:
        trial_id = self._runs.get(run_id)
        if trial_id is None:  # a task that never reported (or whose reports are still on their way)
            self._ended_early[run_id] = when
            if len(self._ended_early) > stopping.KEEP:
                self._ended_early.popitem(last=False)
            return
        if self.trials[trial_id]["run"] == run_id:
            self._finish(trial_id, _final_state(future), when)

    def _finish(self, trial_id: str, state: str, when: float) -> None:
        record = self.trials[trial_id]
        record["ended"] = when
        self._dirty = True
        if record["state"] == "pruned":
            return
        record["state"] = state
        if self.decisions is not None:
            self.decisions.finished(trial_id, state, record["last"].get(self.metric))

    # ---- the files

    def _flush(self) -> None:
        if self.run_dir is None:
            self._lines.clear()
            return
        try:
            for trial_id, lines in self._lines.items():
                append_private(self.run_dir.trial_metrics(trial_id), lines)
            self._lines.clear()
            if self._dirty:
                write_json(self.run_dir.metrics_summary, self.summary())
                self._dirty = False
        except OSError as exc:
            if not self._write_failed:
                logger.warning("could not write the trials' reports in %s: %s", self.run_dir.metrics_dir, exc)
            self._write_failed = True

    def summary(self) -> dict[str, Any]:
        """trials.json: the metric and its mode, the pruner, each trial, how many report and were pruned, the
        best trial by the metric."""
        metric = self.metric or self._first_metric
        best: dict[str, Any] | None = None
        for trial_id, record in self.trials.items():
            value = record["best"].get(metric)
            if value is not None and (best is None or self._better(value, best["value"])):
                best = {"trial": trial_id, "value": value, "step": self._best_step.get(trial_id)}
        states = [record["state"] for record in self.trials.values()]
        return {"metric": metric, "mode": self.mode, "pruner": self.pruner.name if self.pruner else None,
                "updated": time.time(), "trials": self.trials, "reporting": states.count("running"),
                "pruned": states.count("pruned"), "best": best}

    def _better(self, value: float, than: float | None) -> bool:
        if than is None or math.isnan(than):
            return True
        return value < than if self.mode == "min" else value > than


def run_record(metrics: TrialMetrics, run_id: str) -> dict[str, Any] | None:
    """A task run's trial record (state "pruned" once its pruner stopped it, "started": its first report's
    time), or None before its first report; read from the flow's thread (hpc_garage.search)."""
    trial_id = metrics._runs.get(run_id)  # noqa: SLF001 - this module's own
    return dict(metrics.trials.get(trial_id) or {}) or None if trial_id is not None else None


class PrunerAnswers(WorkerPlugin):
    """On each worker of a flow with a pruner: its trials' reports wait for the pruner's answer (trial.report)."""

    name = "hpc-garage-pruner-answers"

    def setup(self, worker: Any) -> None:
        stopping.answering(True)

    def teardown(self, worker: Any) -> None:
        stopping.answering(False)


def _final_state(future: Any) -> str:
    """"done", "failed" or "interrupted", from the Prefect state the task's future holds (the task runner
    submits with return_type="state": the state object, not the trial's data alone)."""
    if getattr(future, "status", None) != "finished":
        return "failed"
    try:
        state = future.result(timeout=10)
    except Exception:  # noqa: BLE001 - whatever it was, it did not finish
        return "failed"
    kind = getattr(getattr(state, "type", None), "value", None)
    return "done" if kind is None else FINAL_STATES.get(kind, "failed")
