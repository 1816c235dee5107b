"""The flow's side of `hpc_garage.trial.report()`: store what the trials report, ask the pruner, stop the
trials it prunes.

The trials' reports arrive as Dask events on the task runner's own client (each worker logs them, several to an
event, on its batched stream to the scheduler, which forwards them to subscribed clients): no Prefect API call, no extra
connection. The client's event loop only enqueues each one; one daemon thread drains the queue, so a slow
disk or a pruner never holds up the client. It:
- appends each report to `metrics/<trial>.jsonl` in the job's run directory and keeps `metrics/trials.json`
  (each trial's last and best values, its state; the best trial; counts) up to date, at most once a second
  and at the end (the readers: status, the report, the Prefect artifacts);
- with a pruner (`task_runner(pruner=..., metric=...)`), gives it the metric at every report and answers the
  reports a trial waits on (trial.report: a trial whose steps are slow waits for the decision, as under Ray
  Tune; a worker plugin tells every worker that answers come), through Dask's `run` op on that one worker
  (`stopping.decided`), which stops a pruned trial first; the trial sees `should_stop()` and returns. The
  answer names the step the trial waits at next (successive halving's next rung). A report that reaches a
  rung fewer trials than the reduction factor have reached is held for its rivals (one of its steps, until
  the running trials expected there soon arrive, or, at the first rung while submitted tasks have not reported
  yet, until the rung has its share; HOLD_MAX at most), then the held ones are decided the best first. A
  trial the epoch's study already has as pruned (a rerun after its job ended) is stopped at its first report;
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
from hpc_garage.pruning import TrialPruner, journal_path
from hpc_garage.rundir import RunDir

__all__ = ["FLUSH_EVERY", "TrialMetrics"]

logger = logging.getLogger(__name__)

FLUSH_EVERY = 1.0  # s: the files are brought up to date at most this often (and at the end)
BATCH = 10_000  # reports drained at once at most (the pruner decides at every one)
SENDERS = 2  # threads sending the pruner's answers and stops to the workers
HOLD_MAX = 1.0  # s a report at a rung with few trials on it waits for its rivals at most
ARRIVAL_SLACK = 0.25  # of a rival's step: how much later than its pace says it may reach the rung
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
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._client: Any = None
        self._thread: threading.Thread | None = None
        self.trials: dict[str, dict[str, Any]] = {}  # trial id -> its record in trials.json
        self._runs: dict[str, str] = {}  # task run id -> trial id
        self._best_step: dict[str, int] = {}  # trial id -> the step of its best value of the metric
        self._first_metric: str | None = None  # without a metric: the first one reported ranks the trials
        self._lines: dict[str, list[str]] = {}  # trial id -> its JSON lines not yet written
        self._ended_early: OrderedDict[str, float] = OrderedDict()  # task run id -> when it ended, unreported yet
        self._stopped: set[str] = set()  # task run ids told to stop
        self._sender: ThreadPoolExecutor | None = None  # sends stops and answers to the workers
        # reports waiting for their rivals at a rung (successive halving), with that rung (None: a later report of
        # a trial whose report waits there)
        self._held: list[tuple[dict[str, Any], int | None]] = []
        self._release_at: float | None = None  # monotonic time the held reports are decided at the latest
        self._held_since = 0.0  # monotonic time the first of them was held
        self._in_flight: set[str] = set()  # task run ids submitted and not ended (with a pruner)
        self._pace: dict[str, tuple[float, int, float]] = {}  # trial id -> (its last report here, its step, s/step)
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
            try:
                self.pruner = TrialPruner(self._pruner_setting, self.mode, self._journal)
            except OSError as exc:  # the journal's directory or file: decide in memory rather than not at all
                logger.warning("the pruner's journal %s cannot be used (%s); its study is kept in memory only",
                               self._journal, exc)
                self.pruner = TrialPruner(self._pruner_setting, self.mode, None)
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
            wake = next_flush if self._release_at is None else min(next_flush, self._release_at)
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
        answers: dict[str, tuple[str | None, int, bool, int]] = {}
        for item in batch:
            if item[0] == "reports":
                for msg in item[1]:
                    self._report(msg, answers)
            elif item[0] == "submit":
                self._in_flight.add(item[1])
            elif item[0] == "end":
                self._in_flight.discard(item[1])
                if self._holds(item[1]):  # its held reports first: the pruner learns of its end after them
                    self._release(answers)
                self._end(item[1], item[2], item[3])
            elif item[0] == "close":
                self._release(answers)
        if self._release_at is not None and time.monotonic() >= self._release_at:
            self._release(answers)
        for run_id, (worker, number, pruned, wait_from) in answers.items():
            self._answer(run_id, worker, number, pruned, wait_from)

    def _answer(self, run_id: str, worker: str | None, number: int, pruned: bool, wait_from: int) -> None:
        """Tell the trial's worker that report `number` was decided, stopping the trial where it was pruned, and
        from which step its reports wait for an answer again (the pruner's next possible decision)."""
        self._send(worker, stopping.decided, run_id, number, pruned, wait_from)

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

    def _report(self, msg: dict[str, Any], answers: dict[str, tuple[str | None, int, bool, int]]) -> None:
        trial_id, run_id, step, values = str(msg["trial"]), str(msg["run"]), int(msg["step"]), msg["values"]
        record = self.trials.get(trial_id)
        if record is None or record["run"] != run_id:  # its first report, or a new run of it (a retry)
            record = self._new_run(trial_id, run_id, msg, record)
        if self.pruner is not None and self.pruner.first_rung is not None:  # (what a held report waits for)
            self._note_pace(trial_id, record["last_step"], step, msg.get("since"))
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
        if self.pruner is not None and self.metric in values:
            rung = self.pruner.rung_due(trial_id, step) if record["state"] == "running" else None
            if self._holds(run_id):  # its earlier report waits for rivals: this one after it
                self._hold(msg, None)
                return
            if rung is not None and self.pruner.gathers(rung, 0):
                self._hold(msg, rung)
                if not self.pruner.gathers(rung, sum(at == rung for _, at in self._held)):  # enough: decide now
                    self._release(answers)
                return
            self._prune(trial_id, record, msg, answers)
        if (ended := self._ended_early.pop(run_id, None)) is not None:
            self._finish(trial_id, "done", ended)

    def _prune(self, trial_id: str, record: dict[str, Any], msg: dict[str, Any],
               answers: dict[str, tuple[str | None, int, bool, int]]) -> None:
        """Ask the pruner about one report; answer it where the trial waits, or stop the trial it prunes."""
        assert self.pruner is not None and self.metric is not None
        run_id, step = str(msg["run"]), int(msg["step"])
        fresh = record["state"] == "running" and self._decide(trial_id, step, msg["values"][self.metric])
        pruned, number = record["state"] == "pruned", msg.get("number")
        if isinstance(number, int) and (fresh or msg.get("answer")):
            # the trial waits for it, or must stop; it waits again only where the pruner can decide next
            answers[run_id] = (msg.get("worker"), number, pruned, self.pruner.next_decision(step))
        elif fresh:  # a report without a number (an older worker): the stop alone
            self._send(msg.get("worker"), stopping.stop, "pruned", trial=run_id)

    def _holds(self, run_id: str) -> bool:
        """Whether a report of this task run waits for its rivals (a few at most, and only for a moment)."""
        return any(str(msg["run"]) == run_id for msg, _ in self._held)

    def _note_pace(self, trial_id: str, last_step: int | None, step: int, since: Any) -> None:
        """When the trial reported (here), at which step, and its seconds per step: when it reaches a rung."""
        if not isinstance(since, (int, float)) or since < 0:
            return
        steps = step - last_step if last_step is not None else max(step, 1)
        if steps > 0:
            self._pace[trial_id] = (time.monotonic(), step, since / steps)

    def _hold(self, msg: dict[str, Any], rung: int | None) -> None:
        """Keep a report that reaches a rung with few trials on it, so that the trials reaching it together are
        decided together, the best first: for one of its trial's steps, or until the running trials expected
        at the rung within HOLD_MAX arrive (from their pace); HOLD_MAX after the first held report at most."""
        now = time.monotonic()
        trial_id = str(msg["trial"])
        if not self._held:
            self._held_since = now
        self._held.append((msg, rung))
        since = msg.get("since")
        deadline = now + (min(HOLD_MAX, since) if isinstance(since, (int, float)) and since >= 0 else HOLD_MAX)
        if rung is not None:
            if self.pruner is not None and rung == self.pruner.first_rung and not self._in_flight <= self._runs.keys():
                deadline = now + HOLD_MAX  # tasks in flight have not reported yet: trials that started with it
            for rival, (seen, step, pace) in self._pace.items():
                record = self.trials.get(rival)
                if rival == trial_id or record is None or record["state"] != "running" or step >= rung:
                    continue
                expected = seen + (rung - step) * pace
                if expected - now <= HOLD_MAX:
                    deadline = max(deadline, expected + ARRIVAL_SLACK * pace)
        latest = self._held_since + HOLD_MAX
        self._release_at = min(latest, deadline if self._release_at is None else max(self._release_at, deadline))

    def _release(self, answers: dict[str, tuple[str | None, int, bool, int]]) -> None:
        """Decide the held reports: trial by trial, the best value of the metric first, each trial's in order."""
        held, self._held, self._release_at = self._held, [], None
        runs: dict[str, list[dict[str, Any]]] = {}
        for msg, _ in held:
            runs.setdefault(str(msg["run"]), []).append(msg)
        sign = 1.0 if self.mode == "min" else -1.0
        for run_id, msgs in sorted(runs.items(), key=lambda item: sign * item[1][0]["values"][self.metric]):
            trial_id = str(msgs[0]["trial"])
            record = self.trials[trial_id]
            if record["run"] == run_id:  # (else a newer run of the trial reported meanwhile: this one is over)
                for msg in msgs:
                    self._prune(trial_id, record, msg, answers)
            if (ended := self._ended_early.pop(run_id, None)) is not None:
                self._finish(trial_id, "done", ended)

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
        if self.pruner is not None and self.pruner.pruned(trial_id):  # pruned in an earlier job of the epoch
            record["state"] = "pruned"
        if record["state"] == "pruned":
            self._stop(trial_id, record, "the study has it as pruned")
        return record

    def _decide(self, trial_id: str, step: int, value: float) -> bool:
        """Whether the pruner prunes the trial now (its stop goes with the answer to this report)."""
        record = self.trials[trial_id]
        if self.pruner is None or record["state"] != "running" or not self.pruner.decide(trial_id, step, value):
            return False
        record["state"] = "pruned"
        self._dirty = True
        self._stopped.add(record["run"])
        logger.info("pruned trial %s (%s, task run %s): %s %g at step %d", trial_id, record.get("task"),
                    record["run"], self.metric, value, step)
        return True

    def _stop(self, trial_id: str, record: dict[str, Any], why: str) -> None:
        """Tell the trial on its worker to stop; each run once."""
        run_id = record["run"]
        if run_id in self._stopped:
            return
        self._stopped.add(run_id)
        logger.info("pruned trial %s (%s, task run %s): %s", trial_id, record.get("task"), run_id, why)
        self._send(record.get("worker"), stopping.stop, "pruned", trial=run_id)

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
        self._pace.pop(trial_id, None)
        self._dirty = True
        if record["state"] == "pruned":
            return
        record["state"] = state
        if self.pruner is not None:
            if state == "interrupted":
                self.pruner.interrupted(trial_id)
            else:
                value = record["last"].get(self.metric) if state == "done" else None
                self.pruner.finished(trial_id, value)

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
