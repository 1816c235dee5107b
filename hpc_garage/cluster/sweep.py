"""Which sweep (and epoch) a `run` works on, and what COMMAND and the workers are told of it.

A job that `submit` wrote names its sweep and epoch on its `run` line, so a requeued job and a walltime
follow-up (the same script) continue that epoch. A `run` typed by hand derives the sweep from the site and
COMMAND, and starts a fresh epoch unless `--resume` (or the batch system restarted this very job: a requeue
keeps the job id, and the job is found in the epoch it joined). See core/sweep.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hpc_garage.core.errors import UserError
from hpc_garage.core.site import Site
from hpc_garage.core.sweep import SweepKey, script_of
from hpc_garage.sweeps import SweepBook, add_job, epoch_of_job, next_epoch, results_key, sweep_of
from hpc_garage.variables import RESULTS_ENV, SWEEP_ENV


@dataclass(frozen=True)
class RunSweep:
    book: SweepBook
    key: SweepKey

    @property
    def results(self) -> str:
        return str(self.book.results(self.key.epoch))

    @property
    def env(self) -> dict[str, str]:
        """What COMMAND's task runner (and a task submitting tasks, on a worker) keys and stores trials by."""
        return {SWEEP_ENV: str(self.key), RESULTS_ENV: self.results}


def join_sweep(site: Site, command: list[str], job_id: str, *, name: str | None,
               epoch: int | None, resume: bool, in_job: bool) -> RunSweep:
    """Find or start the sweep epoch this run belongs to and record the job in it; checks come first, so a
    refusal leaves nothing behind."""
    if name is None and epoch is not None:
        raise UserError("--sweep-epoch needs --sweep NAME (job scripts that `submit` writes give both)")
    cwd = os.getcwd()
    script, args = script_of(command)
    book = sweep_of(site, name, script, args, cwd)
    if epoch is not None and in_job and not book.path.is_dir():  # `submit` made it: this node cannot see it
        raise UserError(f"{results_key(site)}: {book.path} (made at submit) is not visible on this compute node; "
                        "put results_directory on storage every node shares")
    if epoch is None:
        record = book.read()
        epoch = epoch_of_job(record, job_id) if in_job else None  # restarted with its id: the same epoch
        if epoch is None:
            epoch = next_epoch(book, resume, "--resume")
    key = SweepKey(book.name, epoch)
    add_job(book, key, job_id, "run", {"site": site.name, "script": os.path.join(cwd, script), "args": args,
                                       "cwd": cwd})
    book.results(epoch).mkdir(mode=0o700, exist_ok=True)
    return RunSweep(book, key)
