"""`hpc_garage.search`: an Optuna study driven over the job's workers, one trial in flight per worker that can run it.

The flow asks the study for parameters, submits the task with them, and as each task ends tells the study its
value (pruned where the task runner's pruner stopped it, failed where it raised) and at once asks for the next
trial for the freed worker. The study lives in a journal file under the sweep's results directory
($HPC_GARAGE_RESULTS; outside hpc-garage ./search.journal), so a follow-up job, a requeue or `resume` opens the
same study: told trials are not asked again, and the trials the last job left running (asked, not told) run
again with their own parameters first: a finished one comes from the sweep's cache, an interrupted one
continues from its checkpoint (`trial.checkpoint_dir()` is keyed by the task's inputs).

It stops asking at its trial count, its GPU-hour budget, `max_failures` failed trials, or when a trial (judged
from those seen so far) could not reach its first report before the job winds down: then it waits, trials
done, for the wind-down, and the follow-up job continues the search (ledger.py says which and why).
"""

from __future__ import annotations

import inspect
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.rundir import RunDir
from hpc_garage.tuning import settings as checks
from hpc_garage.tuning.ledger import GPU_SECONDS, INTERRUPTED, TRIALS, WALLTIME, Ledger, hours
from hpc_garage.tuning.leaderboard import publish, write_summary
from hpc_garage.variables import RESULTS_ENV

__all__ = ["Best", "Search", "SearchInterrupted", "search"]

logger = logging.getLogger(__name__)

JOURNAL = "search.journal"  # the studies' journal, in the epoch's results directory
WIND_DOWN_POLL = 5.0  # s: how often a search waiting for its job's wind-down looks again
END_READ_EVERY = 30.0  # s: how often the job's end is read again from the run directory (an admin may move it)


class SearchInterrupted(RuntimeError):
    """The job ended under the search (walltime, preemption, cancel): the next job or `resume` continues it.
    The flow fails with it, so that `run` knows the sweep is not done (cluster/wind_down.py)."""


@dataclass(frozen=True)
class Best:
    """The best finished trial: its number in the study, its parameters, its value of the metric."""

    number: int
    params: dict[str, Any]
    value: float


@dataclass
class TrialResult:
    """One trial this job ran to its end: what the task returned, and when on its worker."""

    number: int
    params: dict[str, Any]
    state: str  # "complete", "pruned", "failed" or "interrupted"
    value: float | None
    output: Any
    start: float
    end: float


@dataclass
class Search:
    """What `search` returns: the study (all jobs) and what this job ran; `best` is (number, params, value)."""

    study: Any
    metric: str
    stopped: str  # why it stopped: "trials: ...", "budget: ...", "failures: ...", "walltime: ...", "interrupted: ..."
    gpu_seconds: float
    budget_seconds: float | None
    workers: int
    results: list[TrialResult] = field(default_factory=list)

    @property
    def best(self) -> Best | None:
        complete = [t for t in self.study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
        if not complete:
            return None
        trial = self.study.best_trial
        return Best(trial.number, dict(trial.params), float(trial.value))

    def counts(self) -> dict[str, int]:
        """Trials of the study by state: told (complete + pruned + failed), complete, pruned, failed, running."""
        states = [t.state.name for t in self.study.get_trials(deepcopy=False)]
        found = {s.lower(): states.count(s) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
        return {"told": found["complete"] + found["pruned"] + found["fail"], "complete": found["complete"],
                "pruned": found["pruned"], "failed": found["fail"], "running": found["running"]}

    def summary(self) -> dict[str, Any]:
        """For status, the report and the leaderboard (JSON)."""
        best = self.best
        return {"study": self.study.study_name, "metric": self.metric,
                "mode": "max" if self.study.direction.name == "MAXIMIZE" else "min", "stopped": self.stopped,
                "workers": self.workers, **self.counts(), "gpu_hours": round(self.gpu_seconds / 3600, 4),
                "budget_gpu_hours": None if self.budget_seconds is None else round(self.budget_seconds / 3600, 4),
                "best": None if best is None else {"number": best.number, "params": best.params, "value": best.value}}

    def line(self) -> str:
        counts, best = self.counts(), self.best
        budget = f" of {hours(self.budget_seconds)}" if self.budget_seconds is not None else ""
        found = (f"best #{best.number} {self.metric} {best.value:.6g} {best.params}" if best is not None
                 else "no trial finished")
        return (f"search {self.study.study_name}: {counts['told']} told ({counts['complete']} complete, "
                f"{counts['pruned']} pruned, {counts['failed']} failed) on {self.workers} workers, "
                f"{hours(self.gpu_seconds)}{budget}; {found}; stopped: {self.stopped}")


def search(task: Any, space: Any, trials: int, metric: str, mode: str = "min", sampler: Any = "tpe",
           budget: Any = None, *, max_failures: int = 5, seed: int | None = None, name: str = "search",
           fixed: dict[str, Any] | None = None) -> Search:
    """Run an Optuna study's trials on every worker that can run `task` (see hpc_garage.search)."""
    given = checks.check(space, trials, metric, mode, sampler, budget, max_failures, name)
    fixed = checks.fixed_arguments(fixed, given.space)
    runner = _runner()
    _check_task(task, [*given.space, *fixed])
    optuna = checks.optuna_module("search()")
    from hpc_garage.prefect.task_runner import task_resources, worker_resources

    need = task_resources(task)
    workers = sum(_capacity(offer, need) for offer in worker_resources())
    if workers < 1:
        raise UserError(f"search({task.name}): no worker offers what the task asks ({need}); ask for a job with "
                        "such workers, or change the task's hpc_garage.resources(...)")
    study = _open_study(given, seed, optuna)
    return _Driver(task, given, study, runner, workers, need.get("GPU", 1.0) or 1.0, optuna, fixed).run()


class _Driver:
    """One search's loop in the flow's thread: every worker busy, each ended trial told, the next one asked."""

    def __init__(self, task: Any, given: checks.Settings, study: Any, runner: Any, workers: int, gpus: float,
                 optuna: Any, fixed: dict[str, Any]) -> None:
        self.task, self.given, self.study, self.runner, self.fixed = task, given, study, runner, fixed
        self.workers, self.gpus, self.optuna = workers, gpus, optuna
        self.states = optuna.trial.TrialState
        self.ledger = Ledger(trials=given.trials, budget=given.budget_seconds, max_failures=given.max_failures)
        # future -> [its Optuna trial, when it started: submitted to a free worker, or one freed for it; None: queued]
        self.in_flight: dict[Any, list[Any]] = {}
        self.ahead = max(1, workers // 4) if workers > 1 else 0  # trials queued in Dask beyond the free workers
        self.results: list[TrialResult] = []
        self.interrupted: list[int] = []  # trials this job's end interrupted (left running for the next job)
        self.rundir = RunDir.of_this_run()  # under `hpc-garage run`: search.json for status and the report
        self._end: tuple[float, float | None] = (-END_READ_EVERY, None)  # (read at, winds down at)
        known = study.get_trials(deepcopy=False)
        self.ledger.asked = len(known)
        self.ledger.used = float(study.user_attrs.get(GPU_SECONDS, 0.0))  # all jobs' trials so far
        self.ledger.failures = sum(t.state == self.states.FAIL for t in known)
        # the last job's trials asked and not told: run again first, each with its own parameters
        self.left = [t for t in known if t.state == self.states.RUNNING]
        if self.left:
            logger.info("search %s: %d trials told before; %d left running by the last job run again", given.name,
                        len(known) - len(self.left), len(self.left))

    def run(self) -> Search:
        from hpc_garage.prefect.search_runs import first_done

        while True:
            self._fill()
            if not self.in_flight:
                break
            self._ended(first_done(list(self.in_flight)))
        stopped = self.ledger.stopped or "trials: none left to ask"
        result = self._result(stopped)
        logger.info("%s", result.line())
        publish(result, self.rundir)
        if stopped.startswith(WALLTIME):
            self._await_wind_down()
        if self.interrupted:  # the flow ends as its trials did (the job's end, not the search's): `run` then
            # hands the search on to the follow-up job, which a flow that returned would cancel
            raise SearchInterrupted(result.line())
        return result

    def _result(self, stopped: str | None) -> Search:
        return Search(self.study, self.given.metric, stopped or self.ledger.stopped or "", self.ledger.used,
                      self.given.budget_seconds, self.workers, self.results)

    def _fill(self) -> None:
        """Every free worker gets a trial, and `ahead` more wait in Dask's queue, so that a worker whose trial
        ends starts the next at once, without a round trip through this loop (Dask's resources keep it to one
        trial per GPU): the last job's left trials first, then new ones while the ledger allows."""
        while len(self.in_flight) < self.workers + self.ahead:
            now = time.time()
            spent = [(start, self.gpus) for _, start in self.in_flight.values() if start is not None]
            winds_down_at = self._winds_down_at(now)
            why = self.ledger.stop_reason(now, spent, winds_down_at)
            queued = len(self.in_flight) >= self.workers
            if queued and not self.ledger.may_queue(now, winds_down_at):
                return
            if self.left and (why is None or why.startswith(TRIALS)):  # asked before: the count holds them
                trial = self.left.pop(0)
            elif why is None:
                trial = self.study.ask(fixed_distributions=self.given.space)
                self.ledger.asked += 1
            else:
                return
            future = self.task.submit(**trial.params, **self.fixed)
            self.in_flight[future] = [trial, None if queued else time.time()]

    def _ended(self, future: Any) -> None:
        trial, start = self.in_flight.pop(future)
        state, end = future.state, time.time()
        if start is None:  # it ended before a worker was known free for it (e.g. its result was cached)
            start = end
        waiting = [entry for entry in self.in_flight.values() if entry[1] is None]
        if waiting:  # the worker it freed starts the oldest queued trial now
            waiting[0][1] = end
        run = self._run_record(future)
        first = run.get("started") if run else None
        self.ledger.first_reports.append(max(0.0, (first if isinstance(first, (int, float)) else end) - start))
        spent = (end - start) * self.gpus
        self.ledger.durations.append(end - start)
        self.ledger.used += spent
        self.study.set_user_attr(GPU_SECONDS, self.ledger.used)
        if isinstance(trial, self.optuna.trial.Trial):  # asked in this job (the last job's: the study's total only)
            trial.set_user_attr(GPU_SECONDS, spent)
        output, value, kind = None, None, "failed"
        if state.is_crashed():  # interrupted (its job is ending): left running for the job that continues it
            kind = "interrupted"
            self.interrupted.append(trial.number)
            self.ledger.stopped = self.ledger.stopped or (f"{INTERRUPTED}: the job is ending; the next job continues "
                                                          f"trial #{trial.number} and the search")
        elif state.is_completed():
            output = future.result()
            value = _value(output, self.given.metric)
            if run and run.get("state") == "pruned":
                kind = "pruned"
                self._tell(trial.number, state=self.states.PRUNED)
            elif value is None:
                self.ledger.failed(f"trial #{trial.number} returned {_short(output)}: return the value of "
                                   f"{self.given.metric!r} (a number) or a dict holding it")
                logger.warning("search: %s", self.ledger.last_failure)
                self._tell(trial.number, state=self.states.FAIL)
            else:
                kind = "complete"
                self._tell(trial.number, value)
        else:
            self.ledger.failed(f"trial #{trial.number} {state.type.value.lower()}: {state.message or state.name}")
            logger.warning("search: %s (it is told as failed; the search goes on)", self.ledger.last_failure)
            self._tell(trial.number, state=self.states.FAIL)
        self.results.append(TrialResult(trial.number, dict(trial.params), kind, value, output, start, end))
        write_summary(self._result(None), self.rundir)  # status shows the search as it goes

    def _tell(self, number: int, value: float | None = None, state: Any = None) -> None:
        self.study.tell(number, value, state=state, skip_if_finished=True)

    def _run_record(self, future: Any) -> dict[str, Any] | None:
        """The task run's reports as the task runner keeps them (prefect/metrics.py): pruned?, first report."""
        from hpc_garage.prefect.search_runs import run_record

        return run_record(self.runner, future.task_run_id)

    def _winds_down_at(self, now: float) -> float | None:
        """When the job winds down at the latest (run's wind-down notes the end in state.json), or None."""
        read_at, at = self._end
        if now - read_at >= END_READ_EVERY:
            state = (self.rundir.state() if self.rundir is not None else None) or {}
            ends_at, lead = state.get("ends_at"), state.get("wind_down_margin") or 0
            at = float(ends_at) - float(lead) if isinstance(ends_at, (int, float)) else None
            self._end = (now, at)
        return at

    def _await_wind_down(self) -> None:
        """No trial fits before the wind-down: end nothing here (a flow that ended would end the sweep and
        cancel the follow-up job); wait for the wind-down to stop the flow."""
        logger.info("search %s: %s", self.given.name, self.ledger.stopped)
        at = self._winds_down_at(time.time())
        while at is not None and time.time() < at + 2 * END_READ_EVERY:
            time.sleep(WIND_DOWN_POLL)


def _runner() -> Any:
    from hpc_garage.prefect.search_runs import flow_runner

    runner = flow_runner()
    if runner is None:
        raise UserError("search() runs inside a flow whose task runner is hpc_garage.task_runner(): "
                        "@flow(task_runner=hpc_garage.task_runner(...))")
    return runner


def _check_task(task: Any, space: list[str]) -> None:
    from hpc_garage.prefect.search_runs import is_task

    if not is_task(task):
        raise UserError(f"search({task!r}): give a Prefect task, e.g. @task(tags=hpc_garage.resources(gpu=1))")
    parameters = inspect.signature(task.fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return
    missing = [name for name in space if name not in parameters]
    required = [n for n, p in parameters.items() if p.default is p.empty and n not in space
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing or required:
        raise UserError(f"search({task.name}, space=...): " + "; ".join(
            ([f"the task takes no parameter {', '.join(missing)}"] if missing else [])
            + ([f"the space gives no value for {', '.join(required)} (give it a default)"] if required else [])))


def _capacity(offer: dict[str, float], need: dict[str, float]) -> int:
    """How many of the task one worker runs at once: 1 for a task that asks nothing."""
    if not need:
        return 1
    return min(int(offer.get(resource, 0.0) // amount) for resource, amount in need.items())


def _open_study(given: checks.Settings, seed: int | None, optuna: Any) -> Any:
    """The study in the epoch's journal (created, or loaded by a later job of the sweep)."""
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    path = Path(os.environ.get(RESULTS_ENV) or ".", JOURNAL)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    study = optuna.create_study(study_name=given.name, direction=given.direction, load_if_exists=True,
                                storage=JournalStorage(JournalFileBackend(str(path))),
                                sampler=checks.make_sampler(given.sampler, seed, optuna))
    if study.direction.name.lower() != given.direction:
        raise UserError(f"search(mode={given.mode!r}): the study {given.name!r} in {path} was started with the other "
                        "mode; give name='another' for a new study, or the mode it was started with")
    return study


def _value(output: Any, metric: str) -> float | None:
    """The metric's value in what the task returned: a number, or a dict (a mapping) holding it."""
    if isinstance(output, dict):
        output = output.get(metric)
    try:
        value = float(output) if output is not None and not isinstance(output, (str, bytes, bool)) else None
    except (TypeError, ValueError):
        return None
    return value if value is not None and value == value and abs(value) != float("inf") else None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
