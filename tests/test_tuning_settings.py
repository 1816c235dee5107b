"""hpc_garage.search's arguments: each bad one refused in one line naming it and the fix; good ones become
Optuna's own objects (tuning/settings.py)."""

from __future__ import annotations

import optuna
import pytest

from hpc_garage.core.errors import UserError
from hpc_garage.tuning import settings

GOOD = {"space": {"lr": ("log", 1e-5, 1e-1), "depth": ("int", 2, 8), "act": ["relu", "gelu"]}, "trials": 10,
        "metric": "loss", "mode": "min", "sampler": "tpe", "budget": "20 GPUh", "max_failures": 5, "name": "search"}


def checked(**changed: object) -> settings.Settings:
    return settings.check(**{**GOOD, **changed})


def test_a_space_becomes_optuna_distributions() -> None:
    given = checked(space={**GOOD["space"], "wd": optuna.distributions.FloatDistribution(0.0, 0.1),
                           "width": ("logint", 8, 512), "p": ("float", 0, 1)})
    d = given.space
    assert d["lr"] == optuna.distributions.FloatDistribution(1e-5, 1e-1, log=True)
    assert d["depth"] == optuna.distributions.IntDistribution(2, 8)
    assert d["width"] == optuna.distributions.IntDistribution(8, 512, log=True)
    assert d["act"] == optuna.distributions.CategoricalDistribution(["relu", "gelu"])
    assert d["wd"] == optuna.distributions.FloatDistribution(0.0, 0.1)
    assert d["p"] == optuna.distributions.FloatDistribution(0.0, 1.0)
    assert given.direction == "minimize" and checked(mode="max").direction == "maximize"


@pytest.mark.parametrize(("budget", "seconds"), [("20 GPUh", 72000.0), ("1.5 gpu hours", 5400.0),
                                                 ("90 GPUmin", 5400.0), ("90 GPU-min", 5400.0), ("600 GPUs", 600.0),
                                                 ("600 gpu-sec", 600.0), (2, 7200.0), (0.5, 1800.0), (None, None)])
def test_a_budget_is_read_in_gpu_seconds(budget: object, seconds: float | None) -> None:
    assert checked(budget=budget).budget_seconds == seconds


@pytest.mark.parametrize(("changed", "says"), [
    ({"space": {}}, "search(space={}): give a non-empty dict"),
    ({"space": None}, "search(space=None): give a non-empty dict"),
    ({"space": {"lr": (1e-5, 1e-1)}}, "search(space={'lr': (1e-05, 0.1)}): use (kind, low, high)"),
    ({"space": {"lr": ("log", 0, 1)}}, "low > 0 (a log scale)"),
    ({"space": {"lr": ("float", 1, 1)}}, "low < high"),
    ({"space": {"n": ("int", 1.5, 4)}}, "must be ints"),
    ({"space": {"act": []}}, "list at least one choice"),
    ({"space": {"my-lr": ("float", 0, 1)}}, "'my-lr' is not an identifier"),
    ({"sampler": "bayes"}, "search(sampler='bayes'): not a sampler; use one of 'tpe', 'random', 'qmc'"),
    ({"sampler": optuna.pruners.MedianPruner()}, "not a sampler"),
    ({"budget": "20 hours"}, "search(budget='20 hours'): give GPU time as '20 GPUh'"),
    ({"budget": "20 GPUd"}, "search(budget='20 GPUd')"),
    ({"budget": 0}, "search(budget=0)"),
    ({"budget": "-3 GPUh"}, "search(budget='-3 GPUh')"),
    ({"trials": 0}, "search(trials=0): give how many trials"),
    ({"trials": True}, "search(trials=True)"),
    ({"metric": None}, "search(metric=None): name the value"),
    ({"mode": "minimize"}, "search(mode='minimize'): use mode='min'"),
    ({"max_failures": 0}, "search(max_failures=0)"),
    ({"name": "a b"}, "search(name='a b')"),
])
def test_bad_arguments_are_refused_in_one_line(changed: dict[str, object], says: str) -> None:
    with pytest.raises(UserError) as refused:
        checked(**changed)
    message = str(refused.value)
    assert says in message and "\n" not in message, message


def test_the_named_samplers_are_optunas_and_tpe_lies_constantly() -> None:
    tpe = settings.make_sampler("tpe", 3, optuna)
    assert isinstance(tpe, optuna.samplers.TPESampler) and tpe._constant_liar  # noqa: SLF001 - what it promises
    assert isinstance(settings.make_sampler("random", 3, optuna), optuna.samplers.RandomSampler)
    assert isinstance(settings.make_sampler("qmc", 3, optuna), optuna.samplers.QMCSampler)
    mine = optuna.samplers.CmaEsSampler(seed=1)
    assert checked(sampler=mine).sampler is mine and settings.make_sampler(mine, 3, optuna) is mine


def test_fixed_arguments_are_a_dict_apart_from_the_space() -> None:
    space = checked().space
    assert settings.fixed_arguments(None, space) == {} and settings.fixed_arguments({"steps": 3}, space) == {"steps": 3}
    with pytest.raises(UserError, match=r"^search\(fixed=\.\.\.\): lr is in the space too"):
        settings.fixed_arguments({"lr": 0.1}, space)
    with pytest.raises(UserError, match=r"^search\(fixed=\[3\]\): give a dict"):
        settings.fixed_arguments([3], space)
