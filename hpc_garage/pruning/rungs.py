"""Where successive halving can stop a trial: its rungs, and, for Hyperband, the bracket a trial is in.

Successive halving ("asha") decides only where a trial reaches a rung; Hyperband runs one successive halving per
bracket, each with its own first rung, and puts each trial into one bracket by a hash of the study's name and the
trial's number. The flow's process needs both before the pruner is asked: a trial waits for an answer only at a
rung (trial.report), and the first trials at a rung are decided together (prefect/decisions.py). Pure: the
numbers come from the arguments hpc-garage gives Optuna's pruner, never from the pruner's private state.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Ladder", "Rung"]


class Rung(NamedTuple):
    """One rung of one bracket: where the trials of that bracket that reach `step` are compared."""

    bracket: int
    step: int


@dataclass(frozen=True)
class Ladder:
    """Rung k of a trial in bracket b is at min_resource x factor ** (rate + b + k); `budgets` are the brackets'
    shares of the trials (one bracket: successive halving alone)."""

    min_resource: int
    factor: int
    rate: int = 0
    budgets: tuple[int, ...] = (1,)
    study: str = ""

    @classmethod
    def hyperband(cls, min_resource: int, max_resource: int, factor: int, study: str) -> Ladder:
        """Optuna's HyperbandPruner: floor(log_factor(max / min)) + 1 brackets, bracket b holding a share
        ceil(n x factor ** s / (s + 1)) of the trials (s = n - 1 - b), as Optuna allocates them."""
        n = math.floor(math.log(max_resource / min_resource, factor)) + 1
        budgets = tuple(math.ceil(n * factor ** (n - 1 - b) / (n - b)) for b in range(n))
        return cls(min_resource, factor, 0, budgets, study)

    def bracket(self, number: int) -> int:
        """The bracket of the study's trial `number` (Optuna's hash: crc32 of "<study>_<number>")."""
        if len(self.budgets) == 1:
            return 0
        n = zlib.crc32(f"{self.study}_{number}".encode()) % sum(self.budgets)
        for bracket, budget in enumerate(self.budgets):
            n -= budget
            if n < 0:
                return bracket
        raise AssertionError("unreachable: n < sum(budgets)")

    def first(self, bracket: int = 0) -> Rung:
        """The bracket's first rung."""
        return Rung(bracket, self.min_resource * self.factor ** (self.rate + bracket))

    def rungs(self, rung: Rung) -> Iterator[Rung]:
        """The bracket's rungs from `rung` on (endless)."""
        step = rung.step
        while True:
            yield Rung(rung.bracket, step)
            step *= self.factor

    def after(self, bracket: int, step: int) -> Rung:
        """The bracket's first rung past `step`."""
        return next(rung for rung in self.rungs(self.first(bracket)) if rung.step > step)
