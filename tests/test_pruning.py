"""The Optuna adapter (hpc_garage/pruning/) without a cluster: pruner names, the one-line refusals of a bad
pruner, metric or mode, decisions on scripted learning curves, the epoch's journal read back by a later job,
and a trial the study has as pruned pruned again at once."""

from __future__ import annotations

import builtins
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

optuna = pytest.importorskip("optuna")

from hpc_garage import pruning  # noqa: E402
from hpc_garage.core.errors import UserError  # noqa: E402
from hpc_garage.core.sweep import PRUNER_JOURNAL  # noqa: E402
from hpc_garage.pruning import TrialPruner, check_settings, journal_path, make_pruner  # noqa: E402
from hpc_garage.variables import RESULTS_ENV  # noqa: E402

STEPS = 20


def curve(floor: float, step: int) -> float:
    """A learning curve: falls from floor + 1 towards `floor`."""
    return floor + 1.0 / (step + 1)


def run_to_end(p: TrialPruner, trial_id: str, floor: float) -> int | None:
    """Report every step unless pruned; the step it was pruned at, or None (finished)."""
    for step in range(STEPS):
        if p.decide(trial_id, step, curve(floor, step)):
            return step
    p.finished(trial_id, curve(floor, STEPS - 1))
    return None


def test_the_names_are_optunas_pruners_with_their_defaults() -> None:
    assert type(make_pruner("median")) is optuna.pruners.MedianPruner
    assert type(make_pruner("asha")) is optuna.pruners.SuccessiveHalvingPruner
    assert type(make_pruner("hyperband")) is optuna.pruners.HyperbandPruner
    percentile = make_pruner("percentile")
    assert type(percentile) is optuna.pruners.PercentilePruner and percentile._percentile == 25.0
    mine = optuna.pruners.MedianPruner(n_startup_trials=1)
    assert make_pruner(mine) is mine
    assert set(pruning.PRUNERS) == {"median", "percentile", "asha", "hyperband"}


@pytest.mark.parametrize(("pruner", "metric", "mode", "said"), [
    ("medain", "loss", "min", r"^task_runner\(pruner='medain'\): not a pruner hpc-garage knows; use one of 'median'"),
    (42, "loss", "min", r"^task_runner\(pruner=42\): not a pruner; use one of"),
    ("median", None, "min", r"^task_runner\(pruner='median'\) needs metric=\.\.\.: .*metric='loss'"),
    ("asha", "", "min", r"^task_runner\(metric=''\): name one of the values the trials report"),
    ("asha", "loss", "minimize", r"^task_runner\(mode='minimize'\): use mode='min' \(lower loss is better"),
    (None, None, "up", r"^task_runner\(mode='up'\): use mode='min'"),
])
def test_a_bad_setting_is_one_line_naming_it_and_the_fix(pruner: Any, metric: Any, mode: Any, said: str) -> None:
    with pytest.raises(UserError, match=said) as refused:
        check_settings(pruner, metric, mode)
    assert "\n" not in str(refused.value)


def test_good_settings_pass_and_no_pruner_needs_no_metric() -> None:
    check_settings(None, None, "min")
    check_settings(None, "acc", "max")
    check_settings("hyperband", "loss", "min")
    check_settings(optuna.pruners.NopPruner(), "loss", "max")


def test_without_optuna_a_pruner_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = builtins.__import__

    def no_optuna(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "optuna" or name.startswith("optuna."):
            raise ImportError("No module named 'optuna'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_optuna)
    with pytest.raises(UserError, match=r"^task_runner\(pruner='median'\) uses Optuna's pruners, and Optuna is not "
                                        r"installed here: pip install 'hpc-garage\[tune\]'$"):
        check_settings("median", "loss", "min")
    check_settings(None, "loss", "min")  # reports without a pruner need no Optuna


def test_the_median_pruner_stops_the_poor_curves_and_keeps_the_good_ones() -> None:
    p = TrialPruner(optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=3), "min")
    assert p.name == "MedianPruner"
    assert run_to_end(p, "good-1", 0.1) is None and run_to_end(p, "good-2", 0.3) is None
    assert run_to_end(p, "poor", 2.0) == 3  # the first step past the warm-up
    assert p.pruned("poor") and not p.pruned("good-1")
    assert p.decide("poor", 9, 0.0) is True  # pruned stays pruned, whatever it reports later
    assert run_to_end(p, "better", 0.05) is None  # better than the median: runs to the end
    assert run_to_end(p, "mediocre", 0.5) == 3  # worse than the median of the finished ones


def test_max_mode_prunes_the_low_curves() -> None:
    p = TrialPruner(optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=1), "max")
    for step in range(5):
        assert not p.decide("high", step, 10.0 + step)
    p.finished("high", 14.0)
    assert not p.decide("low", 0, 1.0) and p.decide("low", 1, 2.0)


def test_the_named_asha_has_a_rung_at_step_1_before_any_trial_finished() -> None:
    """Ray Tune's ASHA defaults (grace period 1, reduction factor 4), not Optuna's min_resource="auto", which
    has no rung until a first trial finished."""
    p = TrialPruner("asha", "min")
    assert p.decide("a", 1, 0.1) is False  # alone at the rung: promoted
    assert p.decide("b", 1, 5.0) is True  # not in the best quarter at step 1 (with "auto": no rung yet, False)


def test_the_named_asha_is_waited_for_at_its_rungs_only_and_the_others_at_every_step() -> None:
    """A trial's report waits for the answer only where the pruner can stop it: the named successive halving's
    rungs (steps 1, 4, 16, 64 with Ray Tune's ASHA defaults), the named Hyperband's at its brackets' rungs (issue
    31: it had none), every step for any other pruner or an instance."""
    asha = TrialPruner("asha", "min")
    assert [asha.next_decision(s) for s in (0, 1, 2, 3, 4, 15, 16, 63)] == [1, 4, 4, 4, 16, 16, 64, 64]
    hyperband = TrialPruner("hyperband", "min")
    assert [hyperband.next_decision(s) for s in (0, 1, 3, 4, 15, 16)] == [1, 4, 4, 16, 16, 64]  # bracket 0
    for other in ("median", optuna.pruners.SuccessiveHalvingPruner(min_resource=1)):
        assert [TrialPruner(other, "min").next_decision(s) for s in (0, 1, 7)] == [1, 2, 8]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_the_named_asha_prunes_nowhere_but_where_it_said_it_would_decide(seed: int) -> None:
    """Optuna's own successive halving, fed random curves (8 trials x 40 steps, reported in a random order):
    every trial it prunes is pruned at a step `next_decision` named, so a trial that does not wait elsewhere
    misses no prune."""
    rng = random.Random(seed)
    p = TrialPruner("asha", "min")
    floors = [rng.uniform(0.0, 2.0) for _ in range(8)]
    for step in range(40):
        for trial in rng.sample(range(8), 8):
            if p.pruned(str(trial)):
                continue
            due = p.next_decision(step - 1) if step else 0
            if p.decide(str(trial), step, floors[trial] + rng.uniform(0.0, 1.0) / (step + 1)):
                assert step == due, (trial, step, due)


def test_asha_prunes_on_its_rungs() -> None:
    p = TrialPruner(optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=2), "min")
    stopped = {name: run_to_end(p, name, floor) for name, floor in
               [("a", 0.1), ("b", 0.2), ("c", 3.0), ("d", 0.05), ("e", 4.0), ("f", 5.0)]}
    assert stopped["a"] is None and stopped["d"] is None
    assert all(stopped[name] is not None for name in ("e", "f")), stopped


def test_a_repeated_step_keeps_the_first_value_and_warns_nothing() -> None:
    p = TrialPruner("median", "min")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert p.decide("t", 0, 1.0) is False
        assert p.decide("t", 0, 5.0) is False  # continued from a checkpoint: step 0 again
        assert p.decide("t", 1, 0.5) is False
    assert p._study.get_trials()[0].intermediate_values == {0: 1.0, 1: 0.5}


def test_the_journal_is_the_epochs_results_and_survives_a_new_job(tmp_path: Path) -> None:
    assert journal_path({}) is None
    path = journal_path({RESULTS_ENV: str(tmp_path / "results")})
    assert path == tmp_path / "results" / PRUNER_JOURNAL
    first = TrialPruner(optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=3), "min", path)
    assert run_to_end(first, "good-1", 0.1) is None and run_to_end(first, "good-2", 0.3) is None
    assert run_to_end(first, "poor", 2.0) == 3
    for step in range(5):  # the job ends under this one: interrupted, continued by the next job
        first.decide("long", step, curve(0.2, step))
    first.interrupted("long")
    assert path.exists()

    later = TrialPruner(optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=3), "min", path)
    assert later.pruned("poor") and later.decide("poor", 0, 0.0) is True  # a rerun of it is pruned at once
    assert not later.pruned("good-1") and later.decide("good-1", 0, 9.0) is False  # finished: not decided again
    assert run_to_end(later, "late-poor", 3.0) == 3  # the finished trials of the first job still inform it
    assert later.decide("long", 5, curve(0.2, 5)) is False  # its Optuna trial continues
    live = {t.user_attrs["hpc_garage_trial"]: t for t in later._study.get_trials()}
    assert sorted(live["long"].intermediate_values) == list(range(6))
    assert live["poor"].state == optuna.trial.TrialState.PRUNED
    assert live["good-1"].state == optuna.trial.TrialState.COMPLETE and live["good-1"].value == curve(0.1, STEPS - 1)


def test_every_task_runner_call_with_a_pruner_in_the_readme_and_the_guide_is_accepted() -> None:
    """The README's and the early-stopping guide's `task_runner(pruner=...)` calls, literally: each one is
    accepted as written (a pruner without `metric=` is refused, and the README once showed one)."""
    import ast
    import re

    root = Path(__file__).resolve().parents[1]
    calls = [call for doc in ("README.md", "docs/how-to/early-stopping.md")
             for call in re.findall(r"task_runner\((pruner=[^()`]*)\)", (root / doc).read_text())
             if "..." not in call]  # a signature in prose, not a call
    assert len(calls) >= 2, calls
    for call in calls:
        kwargs = {k.arg: ast.literal_eval(k.value) for k in ast.parse(f"f({call})").body[0].value.keywords}
        check_settings(kwargs.get("pruner"), kwargs.get("metric"), kwargs.get("mode", "min"))


def test_optunas_info_lines_stay_out_of_the_flows_log_and_the_users_own_study_keeps_them(
        caplog: pytest.LogCaptureFixture) -> None:
    """"A new study created in memory" and "Trial N pruned." are about hpc-garage's own study, not the user's:
    silenced for its calls, while a study of the user's (examples/optuna_ask_tell.py) still logs as Optuna does."""
    import logging

    optuna.logging.enable_propagation()
    try:
        with caplog.at_level(logging.INFO, logger="optuna"):
            p = TrialPruner("asha", "min")
            assert p.decide("a", 1, 1.0) is False and p.decide("b", 1, 2.0) is True
            p.finished("a", 0.5)
            assert [r.getMessage() for r in caplog.records if r.name.startswith("optuna")] == []
            optuna.create_study()
            assert any("A new study created" in r.getMessage() for r in caplog.records)
    finally:
        optuna.logging.disable_propagation()


# ------------------------------------------------------------------ issue 31: every named pruner, first wave


def test_the_hyperband_ladder_puts_each_trial_in_optunas_bracket() -> None:
    """pruning/rungs.py computes Hyperband's brackets from the arguments hpc-garage gives it; Optuna's own choice
    (a private method, read here only) must agree, or a trial would wait for answers at the wrong steps."""
    from hpc_garage.pruning.rungs import Ladder, Rung

    kwargs = pruning.PRUNERS["hyperband"][1]
    ladder = Ladder.hyperband(kwargs["min_resource"], kwargs["max_resource"], kwargs["reduction_factor"],
                              pruning.STUDY)
    p = TrialPruner("hyperband", "min")
    for i in range(64):  # every trial reports step 0: asked, numbered 0..63
        p.decide(str(i), 0, 1.0)
    study, pruner = p._study, p.pruner
    frozen = study.get_trials(deepcopy=False)
    assert [ladder.bracket(t.number) for t in frozen] == [pruner._get_bracket_id(study, t) for t in frozen]
    assert len(set(ladder.bracket(n) for n in range(64))) == len(ladder.budgets) == 4  # rungs 1, 4, 16, 64 first
    assert [ladder.first(b) for b in range(4)] == [Rung(0, 1), Rung(1, 4), Rung(2, 16), Rung(3, 64)]
    assert [p.next_decision(5, str(i)) for i in range(64)] == [ladder.after(ladder.bracket(i), 5).step
                                                               for i in range(64)]


def simulate(pruner: Any, lag: int, trials: int = 16, workers: int = 4) -> tuple[int, set[int], int, list[float]]:
    """The issue-31 sweep (examples/pruned_sweep.py, 16 trials of 30 steps, 4 GPU workers) step by step in
    TrialPruner alone: each round the running trials report (some lag at random), the ones reaching a step
    together decided the best first, as prefect/decisions.py holds them. Steps used, the finished trials,
    how many were pruned before any finished, and the curves."""
    from examples import pruned_sweep

    curves = [pruned_sweep.learning_curve(p["lr"], p["dropout"], 30) for p in pruned_sweep.sweep_params(trials)]
    p, rng = TrialPruner(pruner, "min"), random.Random(lag)
    waiting, running, used, finished, early = list(range(trials)), {}, 0, set(), 0
    while waiting or running:
        while waiting and len(running) < workers:
            running[waiting.pop(0)] = 0
        reports = sorted((curves[i][step], i, step) for i, step in running.items() if rng.random() >= 0.2)
        for value, i, step in reports:
            used += 1
            if p.decide(str(i), step + 1, value):
                early += not finished
                del running[i]
            elif step == 29:
                p.finished(str(i), value)
                finished.add(i)
                del running[i]
            else:
                running[i] = step + 1
    return used, finished, early, [c[-1] for c in curves]


@pytest.mark.parametrize("pruner", ["median", "percentile", "asha", "hyperband"])
def test_every_named_pruner_prunes_in_the_first_wave_keeps_the_best_and_saves_40_percent(pruner: str) -> None:
    for lag in range(5):
        used, finished, early, finals = simulate(pruner, lag)
        best = min(range(len(finals)), key=finals.__getitem__)
        assert best in finished and early > 0 and used <= 0.6 * 16 * 30, (lag, used, sorted(finished), early)


@pytest.mark.parametrize("name", ["median", "percentile"])
def test_a_named_median_or_percentile_compares_with_the_running_trials_and_an_object_as_optuna_does(
        name: str) -> None:
    """Optuna compares with finished trials only: before a first trial finished (a sweep's first wave) nothing
    prunes. The name compares with the running and pruned trials that reported the step too; an object with the
    same arguments keeps Optuna's meaning (the early-stopping guide says so)."""
    twin = make_pruner(name)
    assert type(twin).__name__ == pruning.PRUNERS[name][0] and twin._n_startup_trials == 3
    for pruner, prunes in ((name, True), (twin, False)):
        p = TrialPruner(pruner, "min")
        for step in range(4):
            for trial, floor in (("a", 0.1), ("b", 0.2), ("c", 0.3)):
                assert not p.decide(trial, step, curve(floor, step)) or (name == "percentile" and trial != "a")
        assert [p.decide("poor", step, curve(2.0, step)) for step in range(4)] == [False, False, prunes, prunes]
    assert simulate(twin, 0)[2] == 0  # the object: nothing pruned before a first trial finished


def test_a_trial_ahead_of_its_rivals_is_judged_where_they_catch_up_with_it() -> None:
    """A named median pruner compares a trial with the others at its own step: one that started first (a busy
    node, a slow start of the others) is compared with no one. When a rival reaches a step the leader reported,
    the leader is judged as it stood there; the best trial at every step never is pruned this way."""
    p = TrialPruner("median", "min")
    for step in range(10):  # "poor" runs ahead of all: nothing to compare with
        assert not p.decide("poor", step, curve(2.0, step))
    assert p.overtaken(0) == []
    for step in range(3):
        for trial, floor in (("a", 0.1), ("b", 0.2), ("c", 0.3)):
            p.decide(trial, step, curve(floor, step))
        assert p.overtaken(step) == (["poor"] if step == 2 else []), step  # past the 2 warm-up steps
    assert p.pruned("poor") and not p.pruned("a") and p.overtaken(2) == []
    q = TrialPruner("median", "min")
    for step in range(10):  # the best runs ahead: never judged worse than the rivals that catch up
        q.decide("best", step, curve(0.01, step))
    for step in range(10):
        for trial, floor in (("a", 0.1), ("b", 0.2), ("c", 0.3)):
            q.decide(trial, step, curve(floor, step))
        assert "best" not in q.overtaken(step)
    assert TrialPruner(optuna.pruners.MedianPruner(), "min").overtaken(3) == []  # an object: as Optuna does
