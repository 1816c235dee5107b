"""Early stopping with Optuna's pruners: which trial to stop, decided from what the trials report.

`hpc_garage.task_runner(pruner=..., metric=..., mode=...)` names the pruner; the flow's process
(prefect/metrics.py) hands each report of `metric` to a `TrialPruner` and stops the trials it prunes. Optuna's
own pruners decide (median, percentile, successive halving / ASHA, Hyperband): the field's maintained
implementations, not ours. Optuna is imported only when a pruner is named (`pip install 'hpc-garage[tune]'`).

The live study is in memory: a decision costs tens of µs there, against milliseconds per write for Optuna's
journal file, and a trial may report thousands of times. What a later job must know is written to the
epoch's journal (`<results>/.pruner.journal`, JournalStorage: a file, no database server) when a trial ends,
is pruned or is interrupted, and read back when the next job of the epoch starts: finished trials keep
informing the pruner, a trial the study has as pruned is pruned again at its first report, and an
interrupted trial continues its Optuna trial (its reports so far, ASHA's rungs).
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from hpc_garage.core.errors import UserError
from hpc_garage.core.sweep import PRUNER_JOURNAL
from hpc_garage.pruning.rungs import Ladder, Rung
from hpc_garage.variables import RESULTS_ENV

__all__ = ["MODES", "PRUNERS", "Rung", "TrialPruner", "check_settings", "journal_path", "make_pruner"]

logger = logging.getLogger(__name__)

# a name -> Optuna's pruner class and the arguments it gets (Optuna's defaults otherwise). Every one prunes
# during a sweep's first wave: the median and percentile pruners compare with every other trial at the step
# (TrialPruner's peers), and successive halving and Hyperband get their resources up front; Optuna's "auto"
# has no rung until a first trial finished (a whole first wave runs to the end, and Hyperband then files the
# late steps of the running trials at its early rungs, where they beat the next wave's best trial).
PRUNERS: dict[str, tuple[str, dict[str, Any]]] = {
    # Ray Tune's MedianStoppingRule needs 3 other trials; a trial's first 2 steps are never judged
    "median": ("MedianPruner", {"n_startup_trials": 3, "n_warmup_steps": 2}),
    "percentile": ("PercentilePruner", {"percentile": 25.0, "n_startup_trials": 3, "n_warmup_steps": 2}),
    # Ray Tune's ASHA defaults (grace period 1 step, reduction factor 4: rungs at steps 1, 4, 16, ...)
    "asha": ("SuccessiveHalvingPruner", {"min_resource": 1, "reduction_factor": 4}),
    # ASHA's rungs (1, 4, 16, 64) as the brackets' first rungs: 4 brackets; max_resource is the longest trial
    # Hyperband plans its brackets for, in steps (Ray Tune's HyperBand max_t); a longer trial is decided on
    "hyperband": ("HyperbandPruner", {"min_resource": 1, "max_resource": 64, "reduction_factor": 4}),
}
MODES = ("min", "max")  # "min": lower is better (a loss), the default
STUDY = "hpc-garage"  # the study's name, in memory and in the epoch's journal
TRIAL_ATTR = "hpc_garage_trial"  # the Optuna trial's user attribute: the hpc-garage trial it is
INSTALL = "pip install 'hpc-garage[tune]'"


def check_settings(pruner: Any, metric: Any, mode: Any) -> None:
    """Refuse, in one line, a pruner, metric or mode `task_runner()` cannot use: when the flow is decorated,
    not at the first report on a GPU."""
    if mode not in MODES:
        raise UserError(f"task_runner(mode={mode!r}): use mode='min' (lower {metric or 'metric'} is better, the "
                        "default) or mode='max' (higher is better)")
    if metric is not None and (not isinstance(metric, str) or not metric.isidentifier()):
        raise UserError(f"task_runner(metric={metric!r}): name one of the values the trials report, as a string: "
                        "trial.report(step, loss=...) -> metric='loss'")
    if pruner is None:
        return
    if isinstance(pruner, str):
        if pruner not in PRUNERS:
            raise UserError(f"task_runner(pruner={pruner!r}): not a pruner hpc-garage knows; use one of "
                            f"{', '.join(map(repr, PRUNERS))} or an optuna.pruners.BasePruner instance")
        _optuna(f"task_runner(pruner={pruner!r})")
    elif not _is_optuna_pruner(pruner):
        raise UserError(f"task_runner(pruner={pruner!r}): not a pruner; use one of {', '.join(map(repr, PRUNERS))} "
                        "or an optuna.pruners.BasePruner instance")
    if metric is None:
        raise UserError(f"task_runner(pruner={_describe(pruner)!r}) needs metric=...: the reported value the pruner "
                        "compares, e.g. trial.report(step, loss=...) with metric='loss' (and mode='min' or 'max')")


def make_pruner(pruner: Any) -> Any:
    """Optuna's pruner for a name (with the arguments PRUNERS gives it), or the instance given."""
    if not isinstance(pruner, str):
        return pruner
    optuna = _optuna(f"task_runner(pruner={pruner!r})")
    name, kwargs = PRUNERS[pruner]
    return getattr(optuna.pruners, name)(**kwargs)


def journal_path(env: Mapping[str, str] | None = None) -> Path | None:
    """Where the epoch's study is kept: in the epoch's results directory under `hpc-garage run` (it survives
    the job, its follow-ups and `resume`); None elsewhere (the study is in memory only)."""
    results = (os.environ if env is None else env).get(RESULTS_ENV)
    return Path(results) / PRUNER_JOURNAL if results else None


class TrialPruner:
    """One study for the flow's trials, keyed by hpc-garage trial id; used from one thread only."""

    def __init__(self, pruner: Any, mode: str = "min", journal: Path | None = None) -> None:
        optuna = _optuna(f"task_runner(pruner={_describe(pruner)!r})")
        self._optuna = optuna
        self.pruner = make_pruner(pruner)
        self.name = type(self.pruner).__name__
        direction = "minimize" if mode == "min" else "maximize"
        self._storage = optuna.storages.InMemoryStorage()
        with _quiet(optuna):
            self._study = optuna.create_study(storage=self._storage, study_name=STUDY, direction=direction,
                                              pruner=self.pruner)
        self._study_id = self._storage.get_study_id_from_name(STUDY)
        self._live: dict[str, Any] = {}  # trial id -> its optuna.trial.Trial in the live study
        self._numbers: dict[str, int] = {}  # trial id -> its number in the live study
        self._steps: dict[str, set[int]] = {}  # trial id -> steps the study has (Optuna warns on a repeated one)
        self._ended: dict[str, str] = {}  # trial id -> "pruned", "complete" or "fail"
        self._last: dict[str, int] = {}  # trial id -> its latest step, while it runs (a named median's leaders)
        self._ladder = _ladder(pruner)  # successive halving's (Hyperband's) rungs, or None: every step
        # a named median or percentile pruner compares with the running trials too (_Peers); an object, as Optuna
        # documents it, with the finished ones only
        self._peers = isinstance(pruner, str) and isinstance(self.pruner, optuna.pruners.PercentilePruner)
        self._due: dict[str, Rung] = {}  # trial id -> the rung its next decision is at (successive halving)
        self._reached: dict[Rung, int] = {}  # a rung -> how many trials were decided at it
        self._journal = self._open_journal(journal, direction) if journal is not None else None

    # ---- what the driver asks

    def pruned(self, trial_id: str) -> bool:
        """Whether the study has this trial as pruned (in this job, or an earlier one of the epoch)."""
        return self._ended.get(trial_id) == "pruned"

    def decide(self, trial_id: str, step: int, value: float) -> bool:
        """Give the study one intermediate value; True: prune this trial (now, or already pruned)."""
        state = self._ended.get(trial_id)
        if state is not None:
            return state == "pruned"
        trial = self._note(trial_id, step, value)
        if (due := self.rung_due(trial_id, step)) is not None:
            self._reach(trial_id, due, step)
        frozen = self._storage.get_trial(self._trial_storage_id(self._numbers[trial_id]))
        if not self.pruner.prune(_Peers(self._study, frozen.number) if self._peers else self._study, frozen):
            return False
        with _quiet(self._optuna):
            self._study.tell(trial, state=self._optuna.trial.TrialState.PRUNED)
        self._end(trial_id, "pruned")
        return True

    def overtaken(self, step: int) -> list[str]:
        """A named median or percentile pruner: the running trials that reported `step` before their rivals did
        (a trial that started early or runs fast) judged again as they stood there, now that a rival reached it;
        the ones pruned. A trial ahead of every other is compared with no one at its own steps: without this it
        would never be pruned in a sweep's first wave."""
        if not self._peers:
            return []
        pruned = []
        for trial_id, last in list(self._last.items()):
            if last <= step or trial_id in self._ended or step not in self._steps.get(trial_id, ()):
                continue
            frozen = copy.copy(self._storage.get_trial(self._trial_storage_id(self._numbers[trial_id])))
            frozen.intermediate_values = {s: v for s, v in frozen.intermediate_values.items() if s <= step}
            if self.pruner.prune(_Peers(self._study, frozen.number), frozen):
                with _quiet(self._optuna):
                    self._study.tell(self._live[trial_id], state=self._optuna.trial.TrialState.PRUNED)
                self._end(trial_id, "pruned")
                pruned.append(trial_id)
        return pruned

    def next_decision(self, step: int, trial_id: str | None = None) -> int:
        """The first step after `step` at which this pruner can stop the trial: a trial waits for the answer to its
        report only there (trial.report). Successive halving ("asha") prunes only where a trial reaches a rung
        (steps 1, 4, 16, ...), so its trials wait three times in 30 steps, not 30; Hyperband ("hyperband") at the
        rungs of the trial's bracket; any other pruner may decide at every step."""
        if self._ladder is None:
            return step + 1
        return self._ladder.after(self._bracket(trial_id), step).step

    @property
    def lowest_rung(self) -> Rung | None:
        """The first rung of the first bracket (where trials that start together first meet), or None."""
        return self._ladder.first() if self._ladder is not None else None

    def rung_due(self, trial_id: str, step: int) -> Rung | None:
        """The rung a report at `step` brings the trial to (successive halving decides there), or None."""
        if self._ladder is None or trial_id in self._ended:
            return None
        due = self._due.get(trial_id) or self._ladder.first(self._bracket(trial_id))
        return due if step >= due.step else None

    def bracket_of(self, trial_id: str) -> int | None:
        """The trial's bracket (0 but with Hyperband), once it reported; None before, or without rungs."""
        if self._ladder is None or trial_id not in self._numbers:
            return None
        return self._bracket(trial_id)

    def gathers(self, rung: Rung, waiting: int) -> bool:
        """Whether a decision at `rung` should wait for rivals: fewer trials than the reduction factor reached it
        yet (counting the `waiting` ones). With so few, successive halving promotes whichever is the best so far,
        so trials started together would be promoted in the order their reports happen to arrive, not on merit."""
        return self._ladder is not None and self._reached.get(rung, 0) + waiting < self._ladder.factor

    def _bracket(self, trial_id: str | None) -> int:
        """The trial's Hyperband bracket, asking the study for its trial (its number) where it has none yet."""
        assert self._ladder is not None
        if trial_id is None or len(self._ladder.budgets) == 1:
            return 0
        if trial_id not in self._numbers:
            self._live_trial(trial_id)
        return self._ladder.bracket(self._numbers[trial_id])

    def _reach(self, trial_id: str, due: Rung, step: int) -> None:
        """A report at `step` brought the trial to its rung `due` and every rung of its bracket up to `step`:
        count it there, and note the rung its next decision is at."""
        assert self._ladder is not None
        for rung in itertools.takewhile(lambda rung: rung.step <= step, self._ladder.rungs(due)):
            self._reached[rung] = self._reached.get(rung, 0) + 1
        self._due[trial_id] = self._ladder.after(due.bracket, step)

    def finished(self, trial_id: str, value: float | None) -> None:
        """The trial's task ended: complete with its last value of the metric (None: failed)."""
        if trial_id in self._ended or trial_id not in self._live:
            return
        state = self._optuna.trial.TrialState
        if value is not None and math.isfinite(value):
            with _quiet(self._optuna):
                self._study.tell(self._live[trial_id], value)
            self._end(trial_id, "complete")
        else:
            with _quiet(self._optuna):
                self._study.tell(self._live[trial_id], state=state.FAIL)
            self._end(trial_id, "fail")

    def interrupted(self, trial_id: str) -> None:
        """The trial's job ended before it did: keep its Optuna trial running, for the job that continues it."""
        if trial_id in self._live and trial_id not in self._ended:
            self._persist(trial_id)

    # ---- the study

    def _live_trial(self, trial_id: str) -> Any:
        """The trial's Optuna trial, asked for at its first report (its number: its Hyperband bracket)."""
        trial = self._live.get(trial_id)
        if trial is None:
            trial = self._live[trial_id] = self._study.ask()
            trial.set_user_attr(TRIAL_ATTR, trial_id)
            self._numbers[trial_id] = trial.number
            self._steps[trial_id] = set()
        return trial

    def _note(self, trial_id: str, step: int, value: float) -> Any:
        trial = self._live_trial(trial_id)
        steps = self._steps[trial_id]
        if step not in steps:  # a trial continued from its checkpoint may report a step again: the first holds
            steps.add(step)
            trial.report(value, step)
            if self._peers:
                self._last[trial_id] = max(step, self._last.get(trial_id, step))
        return trial

    def _end(self, trial_id: str, state: str) -> None:
        self._ended[trial_id] = state
        self._persist(trial_id)
        self._steps.pop(trial_id, None)
        self._last.pop(trial_id, None)

    def _persist(self, trial_id: str) -> None:
        """Write the trial as it stands to the epoch's journal (the latest record of a trial id wins)."""
        if self._journal is None:
            return
        frozen = self._storage.get_trial(self._trial_storage_id(self._numbers[trial_id]))
        try:
            with _quiet(self._optuna):
                self._journal.add_trial(frozen)
        except Exception as exc:  # noqa: BLE001 - the sweep goes on; only a later job loses this trial's record
            logger.warning("could not record trial %s in the pruner's journal: %s", trial_id, exc)

    def _open_journal(self, path: Path, direction: str) -> Any:
        """The epoch's journal; what earlier jobs recorded is read into the live study (latest per trial)."""
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with _quiet(self._optuna):
            journal = self._optuna.create_study(storage=JournalStorage(JournalFileBackend(str(path))),
                                                study_name=STUDY, direction=direction, load_if_exists=True)
        latest: dict[str, Any] = {}
        for frozen in journal.get_trials(deepcopy=False):
            if isinstance(name := frozen.user_attrs.get(TRIAL_ATTR), str):
                latest[name] = frozen
        states = self._optuna.trial.TrialState
        for number, (trial_id, frozen) in enumerate(latest.items()):
            self._study.add_trial(frozen)
            self._numbers[trial_id] = number
            if self._ladder is not None and frozen.intermediate_values:  # the rungs its reports reached
                self._reach(trial_id, self._ladder.first(self._bracket(trial_id)), max(frozen.intermediate_values))
            if frozen.state == states.RUNNING:  # interrupted: its reports continue its Optuna trial
                self._live[trial_id] = self._optuna.trial.Trial(self._study, self._trial_storage_id(number))
                self._steps[trial_id] = set(frozen.intermediate_values)
            else:
                self._ended[trial_id] = {states.PRUNED: "pruned", states.COMPLETE: "complete"}.get(frozen.state, "fail")
        if latest:
            logger.info("pruner: %d trials read back from %s (%d pruned)", len(latest), path,
                        sum(s == "pruned" for s in self._ended.values()))
        return journal

    def _trial_storage_id(self, number: int) -> int:
        return int(self._storage.get_trial_id_from_study_id_trial_number(self._study_id, number))


def _ladder(pruner: Any) -> Ladder | None:
    """The rungs of a named successive-halving or Hyperband pruner, from the arguments hpc-garage gives it
    (Optuna's own attributes are private); None for any other pruner, or an instance: every step."""
    if not isinstance(pruner, str) or PRUNERS[pruner][0] not in ("SuccessiveHalvingPruner", "HyperbandPruner"):
        return None
    kind, kwargs = PRUNERS[pruner]
    first, factor = kwargs.get("min_resource"), int(kwargs.get("reduction_factor", 4 if kind[0] == "S" else 3))
    if not isinstance(first, int) or first < 1 or factor < 2:  # "auto": no rung until a trial completed
        return None
    if kind == "HyperbandPruner":
        most = kwargs.get("max_resource")
        return Ladder.hyperband(first, most, factor, STUDY) if isinstance(most, int) and most >= first else None
    return Ladder(first, factor, int(kwargs.get("min_early_stopping_rate", 0)))


class _Peers:
    """The study as a percentile (median) pruner sees it here: every other trial that reported, running, pruned
    or finished, stands where Optuna puts only the finished ones. Trials that start together are compared with
    each other from their first steps (Ray Tune's median stopping rule), so such a pruner prunes during a
    sweep's first wave; a trial best at every step is never above a percentile of the others."""

    PEER_STATES = ("COMPLETE", "RUNNING", "PRUNED")

    def __init__(self, study: Any, number: int) -> None:
        self._study, self._number = study, number

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def get_trials(self, deepcopy: bool = True, states: Any = None) -> list[Any]:
        return [t for t in self._study.get_trials(deepcopy=deepcopy)
                if t.number != self._number and t.state.name in self.PEER_STATES and t.intermediate_values]


def _optuna(where: str) -> Any:
    """Optuna, imported on first use; missing or older than 4: one line saying how to install it."""
    try:
        import optuna
    except ImportError:
        raise UserError(f"{where} uses Optuna's pruners, and Optuna is not installed here: {INSTALL}") from None
    if int(optuna.__version__.split(".")[0]) < 4:
        raise UserError(f"{where} needs Optuna 4 or later (installed: {optuna.__version__}): {INSTALL}")
    return optuna


def _is_optuna_pruner(pruner: Any) -> bool:
    try:
        import optuna
    except ImportError:
        return False
    return isinstance(pruner, optuna.pruners.BasePruner)


def _describe(pruner: Any) -> str:
    return pruner if isinstance(pruner, str) else type(pruner).__name__


class _quiet(warnings.catch_warnings):
    """Optuna's ExperimentalWarning (a storage or pruner feature it still calls experimental) and its INFO lines
    ("A new study created in memory", "Trial 3 pruned.") say nothing to a user of hpc-garage, who did not call
    Optuna: the one place they are silenced, for hpc-garage's own calls only (the flow's log keeps its own
    "pruned trial ..." line)."""

    def __init__(self, optuna: Any) -> None:
        super().__init__()
        self._category = optuna.exceptions.ExperimentalWarning
        self._logger = logging.getLogger("optuna")
        self._level = logging.NOTSET

    def __enter__(self) -> None:
        super().__enter__()
        warnings.simplefilter("ignore", self._category)
        self._level = self._logger.level
        self._logger.setLevel(max(self._level, logging.WARNING))

    def __exit__(self, *exc: Any) -> None:
        self._logger.setLevel(self._level)
        super().__exit__(*exc)
