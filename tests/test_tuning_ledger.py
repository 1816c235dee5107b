"""When a search stops asking (tuning/ledger.py): its trial count or its GPU-hour budget, whichever comes first,
its failures, or a job that winds down before a trial could report; and it says which."""

from __future__ import annotations

from hpc_garage.tuning.ledger import Ledger


def test_the_trial_count_stops_it_when_it_comes_first() -> None:
    ledger = Ledger(trials=3, budget=3600.0, max_failures=5, asked=3, used=100.0)
    assert ledger.stop_reason(0.0, [], None) == "trials: all 3 trials asked"


def test_the_budget_stops_it_when_it_comes_first_counting_the_trials_in_flight() -> None:
    ledger = Ledger(trials=100, budget=3600.0, max_failures=5, asked=10, used=3000.0)
    assert ledger.stop_reason(1000.0, [(900.0, 1.0), (950.0, 2.0)], None) is None  # 3000 + 100 + 100
    why = ledger.stop_reason(1000.0, [(900.0, 1.0), (500.0, 1.0)], None)  # 3000 + 100 + 500
    assert why == "budget: 1 GPUh of 1 GPUh used", why
    assert ledger.stop_reason(0.0, [], None) == why  # once stopped, it stays stopped


def test_no_budget_leaves_the_count_alone() -> None:
    ledger = Ledger(trials=5, budget=None, max_failures=5, asked=4, used=1e9)
    assert ledger.stop_reason(0.0, [], None) is None


def test_failures_end_it_with_the_last_one_named() -> None:
    ledger = Ledger(trials=100, budget=None, max_failures=2)
    ledger.failed("trial #3 failed: ValueError('depth 7\nbreaks')")
    assert ledger.stop_reason(0.0, [], None) is None
    ledger.failed("trial #5 failed: ValueError('boom')")
    why = ledger.stop_reason(0.0, [], None)
    assert why == "failures: 2 trials failed (max_failures=2); the last: trial #5 failed: ValueError('boom')"


def test_no_trial_starts_that_could_not_reach_its_first_report_before_the_wind_down() -> None:
    ledger = Ledger(trials=100, budget=None, max_failures=5, first_reports=[30.0, 40.0, 50.0])
    assert ledger.first_report() == 40.0
    assert ledger.stop_reason(1000.0, [], None) is None  # no job end known: nothing to judge by
    assert ledger.stop_reason(1000.0, [], 1041.0) is None  # it reports at 1040: before the wind-down
    why = ledger.stop_reason(1002.0, [], 1041.0)
    assert why is not None and why.startswith("walltime: a trial takes 40 s to its first report, and the job "
                                              "winds down in 39 s"), why


def test_before_any_trial_ended_the_wind_down_cannot_be_judged() -> None:
    ledger = Ledger(trials=100, budget=None, max_failures=5)
    assert ledger.first_report() is None and ledger.stop_reason(1000.0, [], 1001.0) is None


def test_a_trial_waits_in_the_queue_only_if_it_would_still_report_before_the_wind_down() -> None:
    ledger = Ledger(trials=100, budget=None, max_failures=5)
    assert ledger.may_queue(1000.0, None)  # no job end: always
    assert not ledger.may_queue(1000.0, 5000.0)  # a job end, and nothing seen yet to judge by
    ledger.first_reports += [10.0]
    ledger.durations += [100.0]
    assert ledger.may_queue(1000.0, 1110.0) and not ledger.may_queue(1000.0, 1109.0)
