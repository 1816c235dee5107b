"""The pruner's side of the flow's reports: which report is decided when, the answer each waiting trial gets,
and the stop of each trial the pruner prunes.

prefect/metrics.py stores the reports and drains them in one thread; it hands each report of the metric here.
A report is decided at once, but for successive halving and Hyperband (pruning/rungs.py): a report that reaches
a rung fewer trials than the reduction factor have reached is held for its rivals (one of its steps, until the
running trials expected there soon arrive, or, at the lowest rung while submitted tasks have not reported yet,
until the rung has its share; HOLD_MAX at most), then the held ones are decided the best first. With so few
trials at a rung successive halving promotes whichever is the best so far, so trials that start together
would otherwise be promoted in the order their reports happen to arrive, not on merit. A trial the epoch's
study already has as pruned (a rerun after its job ended) is stopped at its first report.

Pure but for the clock (given) and `send` (given: Dask's run op on a trial's worker, from metrics.py), so that
the holds are tested without a cluster.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_garage.cluster import stopping
from hpc_garage.pruning import Rung, TrialPruner

__all__ = ["ARRIVAL_SLACK", "HOLD_MAX", "Answers", "PrunerDecisions"]

logger = logging.getLogger(__name__)

HOLD_MAX = 1.0  # s a report at a rung with few trials on it waits for its rivals at most
ARRIVAL_SLACK = 0.25  # of a rival's step: how much later than its pace says it may reach the rung

# run id -> (its worker, the number of the report answered, pruned, the step its reports wait at again)
Answers = dict[str, tuple[str | None, int, bool, int]]
Send = Callable[..., None]  # send(worker, function, *args, **kwargs): run `function` on the trial's worker


class PrunerDecisions:
    """One flow run's pruner decisions, on the records metrics.py keeps (trial id -> record; run id -> trial id);
    used from the drain thread only."""

    def __init__(self, pruner: TrialPruner, metric: str, mode: str, trials: dict[str, dict[str, Any]],
                 runs: dict[str, str], send: Send, clock: Callable[[], float] = time.monotonic) -> None:
        self.pruner, self.metric, self.mode = pruner, metric, mode
        self._trials, self._runs, self._send, self._clock = trials, runs, send, clock
        self._stopped: set[str] = set()  # task run ids told to stop
        # reports waiting for their rivals at a rung, with that rung (None: a later report of a trial whose
        # report waits there)
        self._held: list[tuple[dict[str, Any], Rung | None]] = []
        self.release_at: float | None = None  # clock time the held reports are decided at the latest
        self._held_since = 0.0  # clock time the first of them was held
        self._in_flight: set[str] = set()  # task run ids submitted and not ended
        self._pace: dict[str, tuple[float, int, float]] = {}  # trial id -> (its last report here, its step, s/step)

    @classmethod
    def open(cls, setting: Any, metric: str, mode: str, journal: Path | None, trials: dict[str, dict[str, Any]],
             runs: dict[str, str], send: Send) -> PrunerDecisions:
        """The pruner named by task_runner(pruner=...), its study in the epoch's journal where there is one."""
        try:
            pruner = TrialPruner(setting, mode, journal)
        except OSError as exc:  # the journal's directory or file: decide in memory rather than not at all
            logger.warning("the pruner's journal %s cannot be used (%s); its study is kept in memory only",
                           journal, exc)
            pruner = TrialPruner(setting, mode, None)
        return cls(pruner, metric, mode, trials, runs, send)

    def submitted(self, run_id: str) -> None:
        self._in_flight.add(run_id)

    def ended(self, run_id: str) -> bool:
        """A task ended: True where its reports are held (decide them first: the pruner learns of its end after)."""
        self._in_flight.discard(run_id)
        return self.holds(run_id)

    def holds(self, run_id: str) -> bool:
        """Whether a report of this task run waits for its rivals (a few at most, and only for a moment)."""
        return any(str(msg["run"]) == run_id for msg, _ in self._held)

    def new_run(self, trial_id: str, record: dict[str, Any]) -> None:
        """A trial's first report here, or its retry's: stopped at once where the epoch's study has it pruned."""
        if self.pruner.pruned(trial_id):  # pruned in an earlier job of the epoch
            record["state"] = "pruned"
        if record["state"] == "pruned":
            self.stop(trial_id, record, "the study has it as pruned")

    def note_pace(self, trial_id: str, last_step: int | None, step: int, since: Any) -> None:
        """When the trial reported (here), at which step, and its seconds per step: when it reaches a rung."""
        if self.pruner.lowest_rung is None or not isinstance(since, (int, float)) or since < 0:
            return
        steps = step - last_step if last_step is not None else max(step, 1)
        if steps > 0:
            self._pace[trial_id] = (self._clock(), step, since / steps)

    def report(self, trial_id: str, record: dict[str, Any], msg: dict[str, Any], answers: Answers) -> bool:
        """One report of the metric: decided now (True), or held for its rivals (False)."""
        run_id, step = str(msg["run"]), int(msg["step"])
        rung = self.pruner.rung_due(trial_id, step) if record["state"] == "running" else None
        if self.holds(run_id):  # its earlier report waits for rivals: this one after it
            self._hold(msg, None)
            return False
        if rung is not None and self.pruner.gathers(rung, 0):
            self._hold(msg, rung)
            if not self.pruner.gathers(rung, sum(at == rung for _, at in self._held)):  # enough: decide now
                self.release(answers)
            return False
        self._prune(trial_id, record, msg, answers)
        return True

    def release(self, answers: Answers) -> list[str]:
        """Decide the held reports: trial by trial, the best value of the metric first, each trial's in order.
        The run ids decided."""
        held, self._held, self.release_at = self._held, [], None
        runs: dict[str, list[dict[str, Any]]] = {}
        for msg, _ in held:
            runs.setdefault(str(msg["run"]), []).append(msg)
        sign = 1.0 if self.mode == "min" else -1.0
        for run_id, msgs in sorted(runs.items(), key=lambda item: sign * item[1][0]["values"][self.metric]):
            trial_id = str(msgs[0]["trial"])
            record = self._trials[trial_id]
            if record["run"] == run_id:  # (else a newer run of the trial reported meanwhile: this one is over)
                for msg in msgs:
                    self._prune(trial_id, record, msg, answers)
        return list(runs)

    def due(self) -> bool:
        """Whether the held reports are due to be decided."""
        return self.release_at is not None and self._clock() >= self.release_at

    def finished(self, trial_id: str, state: str, value: float | None) -> None:
        """The trial's task ended ("done", "failed", "interrupted"), with its last value of the metric."""
        self._pace.pop(trial_id, None)
        if state == "interrupted":
            self.pruner.interrupted(trial_id)
        else:
            self.pruner.finished(trial_id, value if state == "done" else None)

    def stop(self, trial_id: str, record: dict[str, Any], why: str) -> None:
        """Tell the trial on its worker to stop; each run once."""
        run_id = record["run"]
        if run_id in self._stopped:
            return
        self._stopped.add(run_id)
        logger.info("pruned trial %s (%s, task run %s): %s", trial_id, record.get("task"), run_id, why)
        self._send(record.get("worker"), stopping.stop, "pruned", trial=run_id)

    def answer(self, answers: Answers) -> None:
        """Tell each trial's worker that its report was decided, stopping the trial where it was pruned, and from
        which step its reports wait for an answer again (the pruner's next possible decision)."""
        for run_id, (worker, number, pruned, wait_from) in answers.items():
            self._send(worker, stopping.decided, run_id, number, pruned, wait_from)

    def _prune(self, trial_id: str, record: dict[str, Any], msg: dict[str, Any], answers: Answers) -> None:
        """Ask the pruner about one report; answer it where the trial waits, or stop the trial it prunes."""
        run_id, step = str(msg["run"]), int(msg["step"])
        fresh = record["state"] == "running" and self._decide(trial_id, step, msg["values"][self.metric])
        pruned, number = record["state"] == "pruned", msg.get("number")
        if isinstance(number, int) and (fresh or msg.get("answer")):
            # the trial waits for it, or must stop; it waits again only where the pruner can decide next
            answers[run_id] = (msg.get("worker"), number, pruned, self.pruner.next_decision(step, trial_id))
        elif fresh:  # a report without a number (an older worker): the stop alone
            self._send(msg.get("worker"), stopping.stop, "pruned", trial=run_id)
        for other in self.pruner.overtaken(step):  # (a named median or percentile pruner)
            ahead = self._trials.get(other)
            if ahead is not None and ahead["state"] == "running":
                ahead["state"] = "pruned"
                self.stop(other, ahead, f"{self.metric} at step {step} worse than its rivals' there")

    def _decide(self, trial_id: str, step: int, value: float) -> bool:
        """Whether the pruner prunes the trial now (its stop goes with the answer to this report)."""
        record = self._trials[trial_id]
        if record["state"] != "running" or not self.pruner.decide(trial_id, step, value):
            return False
        record["state"] = "pruned"
        self._stopped.add(record["run"])
        logger.info("pruned trial %s (%s, task run %s): %s %g at step %d", trial_id, record.get("task"),
                    record["run"], self.metric, value, step)
        return True

    def _hold(self, msg: dict[str, Any], rung: Rung | None) -> None:
        """Keep a report that reaches a rung with few trials on it, so that the trials reaching it together are
        decided together, the best first: for one of its trial's steps, or until the running trials of its
        bracket expected at the rung within HOLD_MAX arrive (from their pace); HOLD_MAX after the first held
        report at most."""
        now = self._clock()
        trial_id = str(msg["trial"])
        if not self._held:
            self._held_since = now
        self._held.append((msg, rung))
        since = msg.get("since")
        deadline = now + (min(HOLD_MAX, since) if isinstance(since, (int, float)) and since >= 0 else HOLD_MAX)
        if rung is not None:
            if rung == self.pruner.lowest_rung and not self._in_flight <= self._runs.keys():
                deadline = now + HOLD_MAX  # tasks in flight have not reported yet: trials that started with it
            for rival, (seen, step, pace) in self._pace.items():
                record = self._trials.get(rival)
                if rival == trial_id or record is None or record["state"] != "running" or step >= rung.step:
                    continue
                if self.pruner.bracket_of(rival) != rung.bracket:  # (Hyperband: another bracket's trials)
                    continue
                expected = seen + (rung.step - step) * pace
                if expected - now <= HOLD_MAX:
                    deadline = max(deadline, expected + ARRIVAL_SLACK * pace)
        latest = self._held_since + HOLD_MAX
        self.release_at = min(latest, deadline if self.release_at is None else max(self.release_at, deadline))
