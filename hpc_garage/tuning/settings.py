"""What `hpc_garage.search(...)` is asked, checked before anything runs: the space, the sampler, the budget.

Each bad argument is refused in one line (UserError) naming the argument, the value and the fix, when the flow
calls `search`, before a study is opened or a trial submitted. Optuna's own objects are the vocabulary: a
distribution where a space entry is, a sampler instance where a name is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpc_garage.core.errors import UserError

INSTALL = "pip install 'hpc-garage[tune]'"
KINDS = ("float", "log", "int", "logint")  # a space entry ("log", 1e-5, 1e-1); a list is a categorical
SAMPLERS = ("tpe", "random", "qmc")  # names; any optuna.samplers.BaseSampler instance is accepted too
MODES = {"min": "minimize", "max": "maximize"}
# "20 GPUh", "90 GPU-min", "3600 GPUs", "1.5 gpu hours": the unit says how many seconds one of it is
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e[-+]?\d+)?)\s*gpu[-_ ]?(h|hr|hrs|hours?|m|min|mins|minutes?|s|sec|secs|"
                     r"seconds?)\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0}


@dataclass(frozen=True)
class Settings:
    """A checked search: Optuna distributions by name, the sampler to build, the stops."""

    space: dict[str, Any]  # name -> optuna.distributions.BaseDistribution
    trials: int
    metric: str
    mode: str
    sampler: Any  # a name in SAMPLERS or a BaseSampler instance
    budget_seconds: float | None  # GPU-seconds, or None: the trial count alone stops the search
    max_failures: int
    name: str

    @property
    def direction(self) -> str:
        return MODES[self.mode]


def check(space: Any, trials: Any, metric: Any, mode: Any, sampler: Any, budget: Any, max_failures: Any,
          name: Any) -> Settings:
    """The search's arguments, checked; a UserError (one line) for the first bad one."""
    optuna = optuna_module("search()")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise UserError(f"search(trials={trials!r}): give how many trials to run at most, an int >= 1")
    if not isinstance(metric, str) or not metric.isidentifier():
        raise UserError(f"search(metric={metric!r}): name the value the task returns (a number, or a dict holding "
                        "it) and reports, as a string: trial.report(step, loss=...) -> metric='loss'")
    if mode not in MODES:
        raise UserError(f"search(mode={mode!r}): use mode='min' (lower {metric} is better) or mode='max'")
    if not isinstance(max_failures, int) or isinstance(max_failures, bool) or max_failures < 1:
        raise UserError(f"search(max_failures={max_failures!r}): give how many failed trials end the search, "
                        "an int >= 1")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise UserError(f"search(name={name!r}): name the study with letters, digits, '_', '.' or '-'")
    return Settings(space=distributions(space, optuna), trials=trials, metric=metric, mode=mode,
                    sampler=checked_sampler(sampler, optuna), budget_seconds=budget_seconds(budget),
                    max_failures=max_failures, name=name)


def distributions(space: Any, optuna: Any) -> dict[str, Any]:
    """Optuna distributions for `space`: {"lr": ("log", 1e-5, 1e-1), "depth": ("int", 2, 8), "act": ["relu",
    "gelu"], "wd": optuna.distributions.FloatDistribution(0, 0.1)}."""
    if not isinstance(space, Mapping) or not space:
        raise UserError(f"search(space={space!r}): give a non-empty dict of parameter -> range, e.g. "
                        "{'lr': ('log', 1e-5, 1e-1), 'depth': ('int', 2, 8), 'act': ['relu', 'gelu']}")
    found = {}
    for key, entry in space.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise UserError(f"search(space=...): parameter name {key!r} is not an identifier; the task receives "
                            "each parameter as a keyword argument")
        found[key] = _distribution(key, entry, optuna.distributions)
    return found


def _distribution(key: str, entry: Any, dists: Any) -> Any:
    if isinstance(entry, dists.BaseDistribution):
        return entry
    if isinstance(entry, list):
        if not entry:
            raise UserError(f"search(space={{{key!r}: []}}): list at least one choice")
        try:
            return dists.CategoricalDistribution(entry)
        except (TypeError, ValueError) as exc:
            raise UserError(f"search(space={{{key!r}: {entry!r}}}): {exc}") from None
    fix = (f"use (kind, low, high) with kind one of {', '.join(map(repr, KINDS))}, a list of choices, or an "
           "optuna.distributions object")
    if not isinstance(entry, tuple) or len(entry) != 3 or entry[0] not in KINDS:
        raise UserError(f"search(space={{{key!r}: {entry!r}}}): {fix}")
    kind, low, high = entry
    numbers = (int,) if kind in ("int", "logint") else (int, float)
    if not all(isinstance(v, numbers) and not isinstance(v, bool) and math.isfinite(v) for v in (low, high)) \
            or low >= high or (kind in ("log", "logint") and low <= 0):
        kinds = "ints" if kind in ("int", "logint") else "finite numbers"
        raise UserError(f"search(space={{{key!r}: {entry!r}}}): low and high must be {kinds} with low < high"
                        + (" and low > 0 (a log scale)" if kind in ("log", "logint") else ""))
    if kind in ("int", "logint"):
        return dists.IntDistribution(low, high, log=kind == "logint")
    return dists.FloatDistribution(float(low), float(high), log=kind == "log")


def fixed_arguments(fixed: Any, space: dict[str, Any]) -> dict[str, Any]:
    """The task's arguments every trial gets unchanged (fixed={"steps": 30}): a dict, none also in the space."""
    if fixed is None:
        return {}
    if not isinstance(fixed, Mapping) or not all(isinstance(k, str) and k.isidentifier() for k in fixed):
        raise UserError(f"search(fixed={fixed!r}): give a dict of the task's other arguments by name, e.g. "
                        "fixed={'steps': 30}")
    if both := sorted(set(fixed) & set(space)):
        raise UserError(f"search(fixed=...): {', '.join(both)} is in the space too; give it in one of the two")
    return dict(fixed)


def checked_sampler(sampler: Any, optuna: Any) -> Any:
    if isinstance(sampler, optuna.samplers.BaseSampler) or sampler in SAMPLERS:
        return sampler
    raise UserError(f"search(sampler={sampler!r}): not a sampler; use one of {', '.join(map(repr, SAMPLERS))} or "
                    "an optuna.samplers.BaseSampler instance (e.g. optuna.samplers.TPESampler(constant_liar=True))")


def make_sampler(sampler: Any, seed: int | None, optuna: Any) -> Any:
    """The sampler to ask with. "tpe" lies constantly (TPESampler(constant_liar=True)): the trials in flight
    count as bad, so that trials asked in parallel do not all land on the same point."""
    if not isinstance(sampler, str):
        return sampler
    if sampler == "tpe":
        return optuna.samplers.TPESampler(constant_liar=True, seed=seed)
    if sampler == "qmc":
        return optuna.samplers.QMCSampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def budget_seconds(budget: Any) -> float | None:
    """GPU-seconds from "20 GPUh", "90 GPUmin", "600 GPUs" or a number of GPU-hours; None for None."""
    if budget is None:
        return None
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        if math.isfinite(budget) and budget > 0:
            return float(budget) * 3600.0
    elif isinstance(budget, str) and (match := _BUDGET.match(budget)) and float(match.group(1)) > 0:
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)[0].lower()]
    raise UserError(f"search(budget={budget!r}): give GPU time as '20 GPUh', '90 GPUmin' or '600 GPUs' (or a "
                    "number of GPU-hours > 0), or budget=None for no budget")


def optuna_module(where: str) -> Any:
    try:
        import optuna
    except ImportError:
        raise UserError(f"{where} needs Optuna, which is not installed here: {INSTALL}") from None
    return optuna
