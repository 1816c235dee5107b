"""The pruner's decisions (hpc_garage/prefect/decisions.py) without Dask or a real clock: which report is held for
its rivals at a rung and for how long, the best decided first, answers and stops handed to `send`."""

from __future__ import annotations

from typing import Any

import pytest

optuna = pytest.importorskip("optuna")

from hpc_garage.prefect.decisions import HOLD_MAX, PrunerDecisions  # noqa: E402
from hpc_garage.pruning import TrialPruner  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(pruner: str) -> tuple[PrunerDecisions, dict[str, dict[str, Any]], list[tuple[Any, ...]], Clock]:
    trials: dict[str, dict[str, Any]] = {}
    sent: list[tuple[Any, ...]] = []
    clock = Clock()
    decisions = PrunerDecisions(TrialPruner(pruner, "min"), "loss", "min", trials, {},
                                lambda worker, function, *args, **kw: sent.append((function.__name__, *args)), clock)
    return decisions, trials, sent, clock


def report(decisions: PrunerDecisions, trials: dict[str, dict[str, Any]], trial: str, step: int, loss: float,
           since: float = 0.1) -> dict[str, tuple[Any, ...]]:
    """One numbered report the trial waits on, through what metrics.py does with it; the answers it got."""
    record = trials.setdefault(trial, {"run": f"run-{trial}", "state": "running", "last_step": None})
    decisions.note_pace(trial, record["last_step"], step, since)
    record["last_step"] = step
    answers: dict[str, tuple[Any, ...]] = {}
    decisions.report(trial, record, {"trial": trial, "run": f"run-{trial}", "step": step, "values": {"loss": loss},
                                     "number": step, "answer": True, "since": since, "worker": "w"}, answers)
    return answers


def test_the_first_four_at_an_asha_rung_are_held_and_decided_the_best_first() -> None:
    decisions, trials, _, clock = setup("asha")
    assert report(decisions, trials, "w", 1, 2.4) == {} and decisions.release_at == clock.now + 0.1
    assert report(decisions, trials, "x", 1, 2.0) == {} and report(decisions, trials, "y", 1, 2.2) == {}
    answers = report(decisions, trials, "best", 1, 1.8)  # the fourth: the rung has its share, all decided
    assert {run: a[2] for run, a in answers.items()} == {"run-w": True, "run-x": True, "run-y": True,
                                                        "run-best": False}
    assert answers["run-best"][3] == 4 and decisions.release_at is None  # it waits again at the next rung


def test_a_held_report_is_decided_after_one_of_its_steps_and_never_later_than_hold_max() -> None:
    decisions, trials, _, clock = setup("asha")
    report(decisions, trials, "alone", 1, 2.0, since=0.3)
    clock.now += 0.29
    assert not decisions.due()
    clock.now += 0.02
    assert decisions.due() and decisions.release({}) == ["run-alone"]
    report(decisions, trials, "slow", 4, 2.0, since=30.0)  # a step of 30 s: HOLD_MAX at most
    assert decisions.release_at == pytest.approx(clock.now + HOLD_MAX)


def test_hyperband_waits_for_a_rival_of_the_same_bracket_only() -> None:
    """A rival whose pace brings it to the rung soon is waited for where it is in the rung's bracket; a trial of
    another bracket is not compared there (Hyperband's brackets are separate successive halvings)."""
    decisions, trials, _, clock = setup("hyperband")
    pruner = decisions.pruner
    names = [f"t{i}" for i in range(40)]
    for name in names:  # each reports step 0 (numbered in this order: its bracket)
        report(decisions, trials, name, 0, 3.0, since=0.1)
    zero = [n for n in names if pruner.bracket_of(n) == 0]
    other = [n for n in names if pruner.bracket_of(n) != 0]
    assert len(zero) >= 2 and other
    # bracket 0's first rung is step 1: the first there waits for its bracket's rivals (0.1 s a step: due now)
    clock.now += 0.05
    report(decisions, trials, zero[0], 1, 2.0, since=0.1)
    held_until = decisions.release_at
    assert held_until is not None and held_until > clock.now + 0.05  # beyond its own step: rivals are near
    decisions.release({})
    for name in zero[2:] + other:  # only trials of another bracket are left running short of step 1
        trials[name]["state"] = "done" if name in zero else "running"
    report(decisions, trials, zero[1], 1, 2.0, since=0.01)
    assert decisions.release_at == pytest.approx(clock.now + 0.01)  # its own step alone: no rival of its bracket


def test_a_named_median_stops_a_trial_that_ran_ahead_once_its_rivals_catch_up() -> None:
    """The leader was compared with no one at its steps; when the rivals reach a step it reported, it is judged
    as it stood there, and its worker told to stop it."""
    decisions, trials, sent, _ = setup("median")
    for step in range(6):
        assert report(decisions, trials, "poor", step, 2.0 + 1.0 / (step + 1)) == {"run-poor": ("w", step, False,
                                                                                                   step + 1)}
    for step in range(3):
        for trial, floor in (("a", 0.1), ("b", 0.2), ("c", 0.3)):
            report(decisions, trials, trial, step, floor + 1.0 / (step + 1))
    assert trials["poor"]["state"] == "pruned" and ("stop", "pruned") in [s[:2] for s in sent]
    assert trials["a"]["state"] == trials["b"]["state"] == "running"  # (c: worse than the median of a, b, poor)
