"""A sweep's identity: which jobs belong to one sweep, and which of them share finished results.

Every `submit`, `sbatch` and `run` belongs to a sweep. Its *name* is `--sweep NAME`, or derived from the
site, the script and its arguments, so submitting the same thing twice names the same sweep. Results are
shared within one *epoch* of a sweep: a fresh `submit`/`run` starts the next epoch (everything runs), while
`resume`, `--resume`, a requeued job and a walltime follow-up job continue the epoch they belong to
(finished trials are read back, not run). The cache key of a trial is its task's source and inputs plus
`SweepKey`: sweep name and epoch, in place of Prefect's default flow-run id.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_garage.core.errors import UserError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# In an epoch's results directory, beside Prefect's result files: the source each trial last ran with (one
# file per task name + inputs), and one line per trial that ran again because its task's source changed.
SOURCES_DIR = ".sources"
SOURCE_CHANGES = ".source-changes.jsonl"
CHECKPOINTS_DIR = ".checkpoints"  # one directory per trial (its result key): hpc_garage.trial.checkpoint_dir()
TRIALS_DIR = ".trials"  # one record per interrupted trial (its result key): cluster/wind_down.py writes it
PRUNER_JOURNAL = ".pruner.journal"  # the pruner's Optuna study (JournalStorage): hpc_garage/pruning/


@dataclass(frozen=True)
class SweepKey:
    """One epoch of one sweep: what trials' cache keys are scoped to."""

    name: str
    epoch: int

    def __str__(self) -> str:
        return f"{self.name}@{self.epoch}"


def check_name(name: str, where: str) -> str:
    """A sweep name names a directory on shared storage: letters, digits, `.`, `_`, `-`; no path, no dot-file."""
    if not NAME.fullmatch(name) or ".." in name:
        raise UserError(f"{where} {name!r} is not a sweep name; use 1-64 letters, digits, '.', '_' or '-', "
                        "starting with a letter or digit (e.g. lr-scan-2)")
    return name


def check_epoch(value: str, where: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise UserError(f"{where} {value!r} is not a sweep epoch; it is a whole number from 1")
    return int(value)


def script_of(command: Sequence[str]) -> tuple[str, list[str]]:
    """(program, its arguments) of a command: `python sweep.py --lr 1` is (sweep.py's path, ['--lr', '1']), so a
    job that runs the script with another interpreter belongs to the same sweep as the `submit` that made it."""
    words = list(command)
    if len(words) >= 2 and os.path.basename(words[0]).startswith("python") and not words[1].startswith("-"):
        return words[1], words[2:]
    return (words[0], words[1:]) if words else ("", [])


def derived_name(site: str, script: str, args: Sequence[str], cwd: str) -> str:
    """The default sweep name: the script's stem and a digest of (site, script's absolute path, arguments)."""
    path = os.path.normpath(os.path.join(cwd, script))
    digest = hashlib.sha256(json.dumps([site, path, list(args)]).encode()).hexdigest()[:10]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.splitext(os.path.basename(path))[0]).lstrip("._-") or "sweep"
    return f"{stem[:40]}-{digest}"
